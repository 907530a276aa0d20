"""The attention computations behind DotProductAttention's paths, and what picks between them.

* no dropout: ``jax.nn.dot_product_attention`` (cuDNN on a GPU where it applies, else XLA);
* dropout on a GPU (bf16/fp16, head_dim a multiple of 8 up to 128), outside loop bodies and
  where XLA's command buffers leave cuDNN out: :func:`cudnn_attention_dropout`;
* dropout otherwise: :func:`attention_reference` (float32 logits, ``lowbit.softmax``, dropout
  from the module's RNG stream).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from lowbit.flax.attention_masks import bias_per_batch
from lowbit.ops.attention.per_shard import per_shard_attention as _per_shard
from lowbit.ops.fused_attention import reference_attention

# Traces whose body XLA runs repeatedly: cuDNN's dropout inside them aborts XLA (jax 0.11.2, H100:
# "Fatal Python error: Aborted" compiling lax.scan over the attention), so dropout there takes the
# reference path.
LOOP_TRACES = ("scan", "while", "fori_loop", "map")


def traced_in_loop() -> bool:
    """Whether the current trace, or one it is nested in, traces a loop body (lax.scan, nn.scan,
    while/fori loops). Reads JAX's trace stack (private); if that is not readable, answers True
    so that dropout takes the safe reference path."""
    try:
        from jax._src import core

        t = core.trace_ctx.trace
        while t is not None:
            frame = getattr(t, "frame", None)
            what = getattr(getattr(frame, "debug_info", None), "traced_for", "") or ""
            if any(w in what for w in LOOP_TRACES):
                return True
            t = getattr(t, "parent_trace", None)
        return False
    except Exception:
        return True


def cudnn_dropout_allowed(implementation) -> bool:
    """cuDNN's fused attention with dropout crashes XLA (jax 0.11.2, H100) when XLA records the
    cuDNN call into a command buffer (CUDA graph): "Check failed: local_device_ordinal.has_value()"
    in cuda_dnn.cc at the first execution of a full layer. It runs when asked for explicitly
    (``implementation="cudnn"`` or ``LOWBIT_CUDNN_DROPOUT=1``) or when XLA_FLAGS sets
    ``--xla_gpu_enable_command_buffer`` to a list without CUDNN; otherwise dropout takes the
    reference path."""
    if implementation == "cudnn" or os.environ.get("LOWBIT_CUDNN_DROPOUT", "") == "1":
        return True
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_gpu_enable_command_buffer="):
            return "CUDNN" not in flag.split("=", 1)[1].upper()
    return False


def default_is_gpu() -> bool:
    """Whether attention will run on a GPU: the jax.default_device in effect, else the backend."""
    dev = getattr(jax.config, "jax_default_device", None)
    if dev is not None:
        return getattr(dev, "platform", str(dev)) in ("gpu", "cuda")
    return jax.default_backend() == "gpu"


def attention_reference(q, k, v, masked, bias, bias_type, scale, rate, rng, plain_causal=False):
    """logits (float32) -> ``lowbit.softmax`` -> dropout (``rate``, from ``rng``) -> values:
    :func:`lowbit.ops.fused_attention.reference_attention` with a bias given once per batch shard
    repeated per sequence.

    ``q (b, sq, h, d)``, ``k``/``v (b, sk, g, d)``, ``masked`` True = out (broadcastable to
    ``(b, h, sq, sk)``) or None; ``plain_causal``: the mask is exactly the square causal triangle."""
    bias = bias_per_batch(bias, q.shape[0])
    pre = bias_type == "pre_scale_bias"
    return reference_attention(q, k, v, bias, masked, scale, rate, rng, None, plain_causal, pre)


def per_shard_attention(fn, query, key, value, bias=None, mask=None):
    """``fn(query, key, value, bias, mask)`` run per (batch, heads) shard under a mesh:
    :func:`lowbit.ops.attention.per_shard.per_shard_attention` without a sink or dropout key."""
    return _per_shard(lambda q, k, v, b, m, _s, _r: fn(q, k, v, b, m), query, key, value, bias, mask)


def cudnn_attention_dropout(q, k, v, masked, bias, bias_type, scale, rate, seed, plain_causal=False):
    """cuDNN's fused attention with dropout (GPU, bf16/fp16): same inputs as
    :func:`attention_reference`; the dropout stream is cuDNN's (``seed`` and an offset that
    advances with every execution of the compiled program)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

    if bias is not None:
        bias = bias_per_batch(bias, q.shape[0]).astype(q.dtype)
        if bias_type == "pre_scale_bias":
            bias = (bias * scale).astype(q.dtype)
    keep = None if (masked is None or plain_causal) else jnp.logical_not(masked)
    return cudnn_dpa(
        q,
        k,
        v,
        bias,
        keep,
        scale=scale,
        mask_type=MaskType.CAUSAL if plain_causal else MaskType.NO_MASK,
        seed=int(seed),
        dropout_rate=float(rate),
        qkv_layout="BTNH",
    )


__all__ = [
    "attention_reference",
    "cudnn_attention_dropout",
    "per_shard_attention",
    "cudnn_dropout_allowed",
    "default_is_gpu",
    "traced_in_loop",
]


def check_score_mod(module) -> None:
    """TE's ``score_mod`` / ``score_mod_bprop`` are cuDNN-frontend graph callbacks (its flex
    attention): lowbit has no such kernel, so a callback set is refused by name."""
    for field in ("score_mod", "score_mod_bprop"):
        if getattr(module, field) is not None:
            raise NotImplementedError(
                f"{type(module).__name__}({field}={getattr(module, field)!r}): TransformerEngine's "
                "cuDNN-frontend score-modification callbacks are not supported by lowbit; leave it None"
            )


def max_logit(q, k, masked, bias, bias_type, scale):
    """TE's ``return_max_logit``: per head, the largest logit the softmax sees (scaled, with the
    bias, over batch, queries and the keys not masked out), shape ``(h,)``; computed in float32
    at full precision, with no gradient (TE's has none). ``-inf`` for a head with every key masked."""
    q, k = (jax.lax.stop_gradient(t).astype(jnp.float32) for t in (q, k))
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)  # GQA: head i reads group i // (h / g)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        b = jax.lax.stop_gradient(bias_per_batch(bias, q.shape[0])).astype(jnp.float32)
        s = (s + b) * scale if bias_type == "pre_scale_bias" else s * scale + b
    else:
        s = s * scale
    if masked is not None:
        s = jnp.where(masked, -jnp.inf, s)
    return jnp.max(s, axis=(0, 2, 3))
