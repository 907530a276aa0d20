"""Fused scaled dot-product attention that lowbit runs end to end: cuDNN's SDPA through lowbit's
own FFI handler on a GPU (csrc/kernels/cuda/attention_cudnn.cc), a float32 reference elsewhere.

Numerics: ``s = scale * q.k^T`` in float32 (+ ``bias``, post-scale), masked entries excluded
(``causal``: key ``j > i`` of query ``i``, top-left; padding: query ``i >= seqlens_q[b]`` or key
``j >= seqlens_kv[b]``), ``p = softmax(s)`` (with ``sink``: one more logit per head in the
denominator, gpt-oss style), dropout keeps ``p / (1 - rate)`` with probability ``1 - rate``,
``out = p.v`` rounded once to q's dtype. Rows of padded queries are zeros, and so are their
gradients. The reference path is :func:`lowbit.flax.attention_paths.attention_reference`'s
computation (same softmax, same dropout draw from ``rng``), so on the CPU the two agree exactly.

On the GPU the dropout mask comes from cuDNN's Philox stream, seeded from ``rng`` through device
tensors (no host sync, reproducible from the key; not the reference's mask, only its
distribution). The handler is not command-buffer compatible, so dropout runs inside
``lax.scan`` with default XLA flags.

FP8 (``fp8=``): q, k, v are quantized to E4M3 with the given encode scales, cuDNN's FP8 SDPA
runs forward (O in E4M3) and backward (dO and dQ/dK/dV in E5M2), and the results are decoded
back to q's dtype. The amaxes cuDNN reports are not returned here (the delayed-scaling
bookkeeping lives above this op). On the CPU the reference runs on the quantize-dequantized
inputs and output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._ffi import attention as ffi
from lowbit.ops.softmax import softmax as _softmax
from lowbit.quantization.checks import as_array

_FLOATS = (jnp.bfloat16, jnp.float16)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


class Fp8AttentionScales(NamedTuple):
    """Encode scales (fp8 = x * scale), float32 scalars: inputs q, k, v; softmax s; output o;
    gradients do, dp (of the probabilities), dq, dk, dv."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    s: jax.Array
    o: jax.Array
    do: jax.Array
    dp: jax.Array
    dq: jax.Array
    dk: jax.Array
    dv: jax.Array


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    padding: bool
    scale: float
    rate: float
    has_bias: bool
    has_sink: bool
    fp8: bool
    deterministic: bool

    def flags(self) -> int:
        f = ffi.CAUSAL if self.causal else 0
        f |= ffi.PADDING if self.padding else 0
        f |= ffi.DROPOUT if self.rate > 0 else 0
        f |= ffi.SINK if self.has_sink else 0
        f |= ffi.FP8 if self.fp8 else 0
        return f | (ffi.DETERMINISTIC if self.deterministic else 0)


def _rows(values) -> jax.Array:
    """Scalars -> (n, SCALE_STRIDE) float32, the value in column 0 (16-byte aligned rows)."""
    col = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])[:, None]
    return jnp.pad(col, ((0, 0), (0, ffi.SCALE_STRIDE - 1)))


def _quantize(x, scale, dtype):
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)


def _decoded(x8):
    """FP8 values as float32 through a 256-entry table, not ``astype``: XLA's GPU pipeline
    deletes a convert pair f32 -> f8 -> f32 (simplify-fp-conversions, on under the default
    ``xla_allow_excess_precision``), so an emulation written with ``astype`` rounds nothing on
    a GPU. A gather of the codes is not a convert chain."""
    table = np.arange(256, dtype=np.uint8).view(jnp.dtype(x8.dtype)).astype(np.float32)
    codes = jax.lax.bitcast_convert_type(x8, jnp.uint8).astype(jnp.int32)
    return jnp.asarray(table)[codes]


def _fake_quantize(x, scale, dtype):
    """``x`` rounded to ``dtype`` with encode scale ``scale``, decoded (float32)."""
    return _decoded(_quantize(x, scale, dtype)) / scale


def _zero_padded(x, lens, axis_len):
    """Rows (axis 1) at or past each batch's length -> 0."""
    keep = jnp.arange(axis_len)[None, :] < lens[:, None]
    return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))


def _fwd_scales(sc: Fp8AttentionScales):
    return _rows([1 / sc.q, 1 / sc.k, 1 / sc.v, 1 / sc.s, sc.s, sc.o])


def _bwd_scales(sc: Fp8AttentionScales):
    inv = [1 / sc.q, 1 / sc.k, 1 / sc.v, 1 / sc.o, 1 / sc.do, 1 / sc.s, 1 / sc.dp]
    return _rows(inv + [sc.s, sc.dq, sc.dk, sc.dv, sc.dp])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cudnn(cfg: _Config, q, k, v, bias, seqlens_q, seqlens_kv, seed, offset, sink, scales):
    return _cudnn_fwd(cfg, q, k, v, bias, seqlens_q, seqlens_kv, seed, offset, sink, scales)[0]


def _cudnn_fwd(cfg, q, k, v, bias, seqlens_q, seqlens_kv, seed, offset, sink, scales):
    if cfg.fp8:
        ins = (_quantize(q, scales.q, E4M3), _quantize(k, scales.k, E4M3), _quantize(v, scales.v, E4M3))
        fp8_scales, o_dtype = _fwd_scales(scales), E4M3
    else:
        ins, fp8_scales, o_dtype = (q, k, v), None, q.dtype
    o, stats, _ = ffi.attention_fwd(
        *ins, bias, seqlens_q, seqlens_kv, None, seed, offset, sink, fp8_scales,
        flags=cfg.flags(), scale=cfg.scale, dropout_rate=cfg.rate, max_sq=q.shape[1],
        max_skv=k.shape[1], o_dtype=o_dtype, dv=v.shape[-1],
    )  # fmt: skip
    out = (o.astype(jnp.float32) / scales.o).astype(q.dtype) if cfg.fp8 else o
    if cfg.padding:
        out = _zero_padded(out, seqlens_q, q.shape[1])
    return out, (ins, o, stats, bias, seqlens_q, seqlens_kv, seed, offset, sink, scales)


def _cudnn_bwd(cfg, res, ct):
    ins, o, stats, bias, seqlens_q, seqlens_kv, seed, offset, sink, scales = res
    q, k, v = ins
    dtype = ct.dtype  # the output's: q's dtype (residuals hold arrays only, for remat)
    if cfg.fp8:
        do, fp8_scales, grad_dtype = _quantize(ct, scales.do, E5M2), _bwd_scales(scales), E5M2
    else:
        do, fp8_scales, grad_dtype = ct.astype(dtype), None, dtype
    dq, dk, dv, dbias, dsink, _ = ffi.attention_bwd(
        q, k, v, o, do, stats, bias, seqlens_q, seqlens_kv, None, seed, offset, sink, fp8_scales,
        flags=cfg.flags(), scale=cfg.scale, dropout_rate=cfg.rate, max_sq=q.shape[1],
        max_skv=k.shape[1], grad_dtype=grad_dtype, want_dbias=cfg.has_bias and not cfg.fp8,
        want_dsink=cfg.has_sink,
    )  # fmt: skip
    if cfg.fp8:
        dq, dk, dv = ((g.astype(jnp.float32) / s).astype(dtype) for g, s in zip((dq, dk, dv), scales[7:]))
    if cfg.padding:  # cuDNN leaves padded rows unwritten
        dq = _zero_padded(dq, seqlens_q, q.shape[1])
        dk, dv = (_zero_padded(g, seqlens_kv, k.shape[1]) for g in (dk, dv))
    return (dq, dk, dv, dbias if cfg.has_bias and not cfg.fp8 else None, None, None, None, None,
            dsink if cfg.has_sink else None, None)  # fmt: skip


_cudnn.defvjp(_cudnn_fwd, _cudnn_bwd)


def reference_attention(
    q, k, v, bias, masked, scale, rate, rng, sink=None, plain_causal=False, pre_scale_bias=False
):
    """The float32 reference (layouts as :func:`fused_attention`; ``masked`` True = out,
    broadcastable to (b, h, sq, skv), or None): logits (float32) -> ``lowbit.softmax`` (with
    ``sink``: one more logit per head) -> dropout (``rate``, from ``rng``) -> values. The bias is
    added after the scale, or before it with ``pre_scale_bias`` (``softmax(scale * (qk + bias))``).
    The Flax modules' reference path (lowbit.flax.attention_paths) is this function."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, preferred_element_type=jnp.float32).reshape(b, h, sq, sk)
    smax_scale = scale
    if bias is not None and pre_scale_bias:
        logits = logits + bias.astype(jnp.float32)
    elif bias is not None:
        logits, smax_scale = logits * scale + bias.astype(jnp.float32), 1.0
    if sink is not None:
        probs = _sink_softmax(logits * smax_scale, masked, sink)
    elif plain_causal:
        probs = _softmax(logits, smax_scale, softmax_type="scaled_upper_triang_masked")
    elif masked is not None:
        probs = _softmax(logits, smax_scale, mask=masked, softmax_type="scaled_masked")
    else:
        probs = _softmax(logits, smax_scale)
    if rate > 0:
        keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
    probs = probs.astype(q.dtype)
    out = jnp.einsum(
        "bgrqk,bkgd->bqgrd", probs.reshape(b, g, h // g, sq, sk), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, sq, h, v.shape[-1]).astype(q.dtype)


def _sink_softmax(s, masked, sink):
    """softmax over the keys with one extra logit sink[h] in the denominator (float32)."""
    if masked is not None:
        s = jnp.where(masked, -jnp.inf, s)
    sink = sink.astype(jnp.float32)[None, :, None, None]
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
    e = jnp.exp(s - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


def padding_mask(seqlens_q, seqlens_kv, sq, skv, causal):
    """(b, 1, sq, skv) True = masked out, from the lengths (and the causal triangle)."""
    qi = jnp.arange(sq)[None, :, None]
    kj = jnp.arange(skv)[None, None, :]
    out = jnp.zeros((1, sq, skv), bool)
    if seqlens_q is not None:
        out = out | (qi >= seqlens_q[:, None, None]) | (kj >= seqlens_kv[:, None, None])
    if causal:
        out = out | (kj > qi)
    return out[:, None]


def check_scale_and_rate(head_dim: int, scale, dropout_rate, rng) -> tuple:
    """``(scale, rate)`` as floats (scale defaults to ``1/sqrt(head_dim)``), or an error naming the
    argument: a scale that is not finite, a rate outside [0, 1), dropout without ``rng``."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    rate = float(dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate > 0 and rng is None:
        raise ValueError("dropout_rate > 0 needs rng (a jax.random key)")
    return scale, rate


def _check(q, k, v, bias, seqlens_q, seqlens_kv, sink):
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array of q's dtype {q.dtype}, got {x.dtype}")
    b, sq, h, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch={b}, skv, kv_heads, head_dim) "
            f"with k's head_dim {d} (q's)"
        )
    if h % k.shape[2]:
        raise ValueError(f"q's heads ({h}) must be a multiple of k's and v's heads ({k.shape[2]})")
    if bias is not None:
        bias = as_array(bias, "bias")
        ok = bias.ndim == 4 and bias.shape[0] in (1, b) and bias.shape[1] in (1, h)
        if not ok or bias.shape[2:] != (sq, k.shape[1]):
            raise ValueError(
                f"bias must be (1 or {b}, 1 or {h}, {sq}, {k.shape[1]}), got {tuple(bias.shape)}"
            )
    if (seqlens_q is None) != (seqlens_kv is None):
        raise ValueError("seqlens_q and seqlens_kv must be given together")
    if seqlens_q is not None:
        for name, x in (("seqlens_q", seqlens_q), ("seqlens_kv", seqlens_kv)):
            x = as_array(x, name)
            if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(
                    f"{name} must be an integer array of shape ({b},), got {x.dtype}{tuple(x.shape)}"
                )
        seqlens_q, seqlens_kv = jnp.asarray(seqlens_q, jnp.int32), jnp.asarray(seqlens_kv, jnp.int32)
    if sink is not None:
        sink = as_array(sink, "sink")
        if sink.shape != (h,):
            raise ValueError(f"sink must be one logit per q head, shape ({h},), got {tuple(sink.shape)}")
    return q, k, v, bias, seqlens_q, seqlens_kv, sink


def _use_cudnn(implementation, q, k, v, fp8) -> bool:
    if implementation == "reference":
        return False
    if implementation not in (None, "cudnn"):
        raise ValueError(f"implementation must be None, 'cudnn' or 'reference', got {implementation!r}")
    why = None
    if jax.default_backend() != "gpu":
        why = "no GPU backend"
    elif q.dtype not in _FLOATS:
        why = f"q's dtype {q.dtype} (cuDNN needs bfloat16 or float16)"
    elif q.shape[-1] % 8 or v.shape[-1] % 8 or max(q.shape[-1], v.shape[-1]) > 256:
        why = "head_dim (cuDNN needs multiples of 8, at most 256)"
    else:
        ok, reason = ffi.cudnn_status()
        why = None if ok else reason
    if why is not None and implementation == "cudnn":
        raise ValueError(f"implementation='cudnn' cannot run here: {why}")
    return why is None


def fused_attention(
    q,
    k,
    v,
    bias=None,
    *,
    causal: bool = False,
    seqlens_q=None,
    seqlens_kv=None,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    rng=None,
    sink=None,
    fp8: Optional[Fp8AttentionScales] = None,
    deterministic: bool = False,
    implementation: Optional[str] = None,
) -> jax.Array:
    """Scaled dot-product attention, differentiable in q, k, v, bias and sink.

    Args:
      q: (batch, sq, heads, head_dim) bfloat16/float16 (float32 runs the reference).
      k, v: (batch, skv, kv_heads, head_dim[_v]); heads % kv_heads == 0 (GQA/MQA).
      bias: post-scale additive bias, (1 or batch, 1 or heads, sq, skv), or None.
      causal: mask key j > query i (top-left).
      seqlens_q, seqlens_kv: int (batch,) valid lengths (padding mask), both or neither.
      scale: logits scale, default 1/sqrt(head_dim).
      dropout_rate: probability of dropping an attention weight; needs ``rng``.
      rng: a jax.random key (dropout only).
      sink: float (heads,) learnable sink logits (attention sinks), or None.
      fp8: encode scales (:class:`Fp8AttentionScales`) for FP8 attention, or None.
      deterministic: cuDNN's deterministic backward (slower).
      implementation: None (cuDNN where it applies, else the reference), "cudnn" (error if it
        cannot run), "reference".
    Returns: (batch, sq, heads, head_dim_v) in q's dtype.
    """
    q, k, v, bias, seqlens_q, seqlens_kv, sink = _check(q, k, v, bias, seqlens_q, seqlens_kv, sink)
    scale, rate = check_scale_and_rate(q.shape[-1], scale, dropout_rate, rng)
    if fp8 is not None and not isinstance(fp8, Fp8AttentionScales):
        raise TypeError(f"fp8 must be an Fp8AttentionScales or None, got {type(fp8).__name__}")
    if fp8 is not None and bias is not None:
        raise ValueError("fp8 attention takes no bias (cuDNN's FP8 SDPA has no bias gradient)")
    padding = seqlens_q is not None
    if _use_cudnn(implementation, q, k, v, fp8):
        cfg = _Config(causal, padding, scale, rate, bias is not None, sink is not None, fp8 is not None,
                      bool(deterministic))  # fmt: skip
        seed = offset = None
        if rate > 0:
            bits = jax.random.bits(rng, (4,), jnp.uint32)
            seed, offset = bits[:2], bits[2:]
        return _cudnn(cfg, q, k, v, None if bias is None else bias.astype(q.dtype), seqlens_q, seqlens_kv,
                      seed, offset, None if sink is None else sink.astype(jnp.float32), fp8)  # fmt: skip
    masked = (
        padding_mask(seqlens_q, seqlens_kv, q.shape[1], k.shape[1], causal) if (padding or causal) else None
    )
    plain = causal and not padding and q.shape[1] == k.shape[1]
    if fp8 is None:
        return reference_attention(q, k, v, bias, masked, scale, rate, rng, sink, plain)
    q, k, v = (_fake_quantize(x, s, E4M3).astype(x.dtype) for x, s in zip((q, k, v), fp8))
    out = reference_attention(q, k, v, None, masked, scale, rate, rng, sink, plain)
    return _fake_quantize(out, fp8.o, E4M3).astype(q.dtype)


__all__ = ["Fp8AttentionScales", "fused_attention", "padding_mask", "reference_attention"]
