"""lowbit's cuDNN-frontend attention (:func:`lowbit.ops.fused_attention.fused_attention`) as the
implementation "cudnn_ffi" of :func:`lowbit.ops.attention.attention`.

It takes the specs with dropout that it can run (bf16/fp16 on a GPU with cuDNN loaded, one
segment per sequence, no context parallelism or window, no explicit mask array): those are the
calls XLA's own cuDNN path runs only outside loop bodies and command buffers, and lowbit's
handler is not command-buffer compatible, so dropout inside ``lax.scan`` and under remat takes it
with default XLA flags. Calls without dropout keep jax's fused attention until this one is
measured faster. Under a mesh it runs per (batch, heads) shard as the other paths do
(:func:`lowbit.ops.attention.per_shard.per_shard_attention`), each shard's dropout key folded
with its position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.ops import fused_attention as fa
from lowbit.ops.attention.core import sink_logit
from lowbit.ops.attention.dispatch import AttentionArrays, AttentionSpec, register_implementation
from lowbit.ops.attention.per_shard import per_shard_attention

_MASKS = ("no_mask", "padding", "causal", "padding_causal")


def supports(spec: AttentionSpec) -> bool:
    plain = (
        spec.dropout_rate > 0
        and not (spec.thd or spec.has_segments or spec.has_mask or spec.cp_axis)
        and spec.window is None
        and spec.max_segments_per_seq in (None, 1)
        and spec.mask_type in _MASKS
        and ("causal" not in spec.mask_type or spec.seq_q == spec.seq_kv)
    )
    return plain and handler_runs(spec)


def handler_runs(spec: AttentionSpec) -> bool:
    """Whether lowbit's cuDNN handler can run here at all: a GPU with cuDNN loaded, bf16/fp16,
    head_dim a multiple of 8 up to 256."""
    if jax.default_backend() != "gpu":
        return False
    if jnp.dtype(spec.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    if spec.head_dim % 8 or spec.head_dim > 256:
        return False
    return fa.ffi.cudnn_status()[0]


def run(q, k, v, spec: AttentionSpec, arrays: AttentionArrays):
    bias = arrays.bias
    if bias is not None and spec.bias_type == "pre_scale_bias":  # softmax(scale * (qk + bias))
        bias = (bias.astype(jnp.float32) * spec.scale).astype(q.dtype)
    sink = sink_logit(spec.softmax_type, arrays.softmax_offset, spec.heads)
    causal = "causal" in spec.mask_type

    def one(q, k, v, bias, _mask, sink, rng):
        if bias is not None and bias.shape[0] not in (1, q.shape[0]):  # one per batch shard
            bias = jnp.repeat(bias, q.shape[0] // bias.shape[0], axis=0)
        return fa.fused_attention(
            q, k, v, bias, causal=causal, scale=spec.scale, dropout_rate=spec.dropout_rate, rng=rng, sink=sink
        )

    return per_shard_attention(one, q, k, v, bias, None, sink, arrays.rng)


register_implementation("cudnn_ffi", run, supports, priority=10)
