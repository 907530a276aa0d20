"""The attention math every JAX-level path shares: a partial attention over one block of keys
that returns its output with the log-sum-exp of its logits, the merge of such partials (ring
attention, attention sinks) and the masks built from segment ids and positions.

Written in plain ``jnp`` with float32 logits (float64 under x64 inputs), differentiable by JAX's
autodiff (the sink logit's gradient included), and usable on every backend: the CPU path, the
GPU fallback, the per-chunk step of context parallelism.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

# Masked logits: finite, so a row with every key of a block masked out keeps a finite
# log-sum-exp (about MASKED) and weighs nothing when merged with another block or a sink.
MASKED = -1e30

SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")
_SOFTMAX_ALIASES = {"off-by-one": "off_by_one", "vanilla_softmax": "vanilla"}


def softmax_type_name(v) -> str:
    """``softmax_type`` as one of :data:`SOFTMAX_TYPES` (a string, case-insensitive, or an enum
    member such as TransformerEngine's ``AttnSoftmaxType.OFF_BY_ONE_SOFTMAX``)."""
    s = getattr(v, "name", v)
    if isinstance(s, str):
        s = s.lower()
        s = _SOFTMAX_ALIASES.get(s, s)
        if s.endswith("_softmax"):
            s = s[: -len("_softmax")]
    if s not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type must be one of {list(SOFTMAX_TYPES)}, got {v!r}")
    return s


def acc_dtype(dtype):
    """The logits' dtype: float32, or float64 for float64 inputs (the references)."""
    return jnp.promote_types(dtype, jnp.float32)


def segment_keep(ids_q, pos_q, ids_kv, pos_kv, causal: bool, window) -> jax.Array:
    """``(b, 1, sq, sk)`` True where query ``i`` may attend to key ``j``: same non-zero segment,
    and (causal) ``pos_kv <= pos_q``, (window ``(left, right)``, negative = unbounded)
    ``pos_q - left <= pos_kv <= pos_q + right``."""
    iq, ik = ids_q[:, :, None], ids_kv[:, None, :]
    pq, pk = pos_q[:, :, None], pos_kv[:, None, :]
    keep = (iq == ik) & (iq != 0) & (ik != 0)
    if causal:
        keep &= pk <= pq
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= pk >= pq - left
        if right >= 0:
            keep &= pk <= pq + right
    return keep[:, None]


def partial_attention(
    q,
    k,
    v,
    *,
    scale: float,
    keep: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None,
    rate: float = 0.0,
    rng: Optional[jax.Array] = None,
) -> Tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of ``q (b, sq, h, d)`` over the keys ``k``/``v (b, sk, g, d)`` (GQA when
    ``g < h``): ``out (b, sq, h, d)`` in the logits' dtype, normalised by this block's softmax,
    ``lse (b, h, sq)`` its log-sum-exp. ``bias`` is added to the scaled logits (broadcastable to
    ``(b, h, sq, sk)``); ``keep`` (same) False = masked out; a query row with no key kept gets
    ``out`` 0 and ``lse`` :data:`MASKED`. Dropout (``rate``) draws
    ``jax.random.bernoulli(rng, 1 - rate, (b, h, sq, sk))``: the same mask for the same key."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    qg = q.reshape(b, sq, g, h // g, d)
    # HIGHEST: float32 inputs multiply in float32 on a GPU too (its default for float32 dots is TF32,
    # ~1e-3 relative); bf16 inputs are unaffected.
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, preferred_element_type=acc, precision=hi).reshape(b, h, sq, sk)
    s = s.astype(acc) * scale
    if bias is not None:
        s = s + bias.astype(acc)
    if keep is not None:
        s = jnp.where(keep, s, MASKED)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True)
    lse = (m + jnp.log(den))[..., 0]
    p = p / den
    if rate > 0:
        if rng is None:
            raise ValueError("attention dropout (rate > 0) needs an rng key")
        drop_keep = jax.random.bernoulli(rng, 1.0 - rate, (b, h, sq, sk))
        p = jnp.where(drop_keep, p / (1.0 - rate), 0.0)
    p = p.astype(v.dtype) if v.dtype != acc else p
    out = jnp.einsum(
        "bgrqk,bkgd->bqgrd", p.reshape(b, g, h // g, sq, sk), v, preferred_element_type=acc, precision=hi
    )
    out = out.reshape(b, sq, h, d).astype(acc)
    if keep is not None:  # a query with no key to attend to (padding): output 0, weight 0
        valid = jnp.broadcast_to(jnp.any(keep, axis=-1), (b, h, sq))
        lse = jnp.where(valid, lse, MASKED)
        out = jnp.where(valid.transpose(0, 2, 1)[..., None], out, 0.0)
    return out, lse


def _weights(lse, total):
    """``exp(lse - total)`` as ``(b, sq, h, 1)``, to scale outputs laid out ``(b, sq, h, d)``."""
    return jnp.exp(lse - total).transpose(0, 2, 1)[..., None]


def merge(a, b):
    """Two partial results ``(out, lse)`` over disjoint key sets as one (online softmax)."""
    (oa, la), (ob, lb) = a, b
    total = jnp.logaddexp(la, lb)
    return oa * _weights(la, total) + ob * _weights(lb, total), total


def apply_sink(out, lse, sink_logit):
    """``(out, lse)`` with one more logit in the denominator and no value: ``sink_logit`` 0 is
    the off-by-one softmax, a learnable per-head value (``(h,)``) the learnable one."""
    sink = jnp.broadcast_to(jnp.reshape(sink_logit, (1, -1, 1)).astype(lse.dtype), lse.shape)
    total = jnp.logaddexp(lse, sink)
    return out * _weights(lse, total), total


def sink_logit(softmax_type: str, softmax_offset, heads: int):
    """The sink logit per head of ``softmax_type``, or None for the vanilla softmax.
    ``softmax_offset``: TransformerEngine's learnable parameter, shape ``(1, heads, 1, 1)``."""
    if softmax_type == "vanilla":
        if softmax_offset is not None:
            raise ValueError("softmax_offset is only used with softmax_type='learnable'")
        return None
    if softmax_type == "off_by_one":
        return jnp.zeros((heads,), jnp.float32)
    if softmax_offset is None:
        raise ValueError("softmax_type='learnable' needs softmax_offset, shape (1, heads, 1, 1)")
    off = jnp.asarray(softmax_offset)
    if off.size != heads or (off.ndim == 4 and off.shape != (1, heads, 1, 1)):
        raise ValueError(f"softmax_offset must have shape (1, {heads}, 1, 1), got {tuple(off.shape)}")
    return off.reshape(heads)


__all__ = [
    "MASKED",
    "SOFTMAX_TYPES",
    "acc_dtype",
    "apply_sink",
    "merge",
    "partial_attention",
    "segment_keep",
    "sink_logit",
    "softmax_type_name",
]
