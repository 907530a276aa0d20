"""Packed sequences on cuDNN's ragged (THD) attention: the documents of each row of a
``(b, s, heads, d)`` batch become the sequences of one ragged call, so each attends only to
itself without a (s, s) mask or wasted blocks.

A document is a run of equal non-zero segment ids in a row (id 0 is padding); each row holds at
most ``max_segments`` of them (later runs are dropped: the descriptor checks enforce the bound on
concrete inputs). Query document ``k`` of a row attends to the key/value document of the same
row with the same id. Causal (``padding_causal``) is top-left inside each document, the same as
comparing positions that count up inside a document. Tokens outside every document get output
0 and gradient 0.

The handler takes the packed tokens ``(b * s, heads, d)``, one sequence per (row, document slot)
with its length (``seqlens``) and the element offset of its first token (``ragged``, rows q, k, v,
o); lengths and offsets come from the segment ids on the device (no host sync).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lowbit.ops._ffi import attention as ffi


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    scale: float
    rate: float
    max_s: int

    def flags(self) -> int:
        f = ffi.PADDING | ffi.RAGGED | (ffi.CAUSAL if self.causal else 0)
        return f | (ffi.DROPOUT if self.rate > 0 else 0)


def documents(ids, n: int):
    """``(starts, lens, doc_ids, inside)`` of the runs of equal non-zero ``ids (b, s)``: per row
    up to ``n`` documents in order, ``starts``/``lens``/``doc_ids (b, n)`` int32 (unused slots:
    start ``s``, length 0, id 0), ``inside (b, s)`` whether a token belongs to a kept document."""
    b, s = ids.shape
    prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
    start = (ids != 0) & (ids != prev)
    idx = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1
    inside = (ids != 0) & (idx < n)
    slot = jnp.where(inside, idx, n)
    t = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    rows = jnp.arange(b)[:, None]
    lens = jnp.zeros((b, n + 1), jnp.int32).at[rows, slot].add(1)[:, :n]
    starts = jnp.full((b, n + 1), s, jnp.int32).at[rows, jnp.where(start & inside, slot, n)].min(t)[:, :n]
    doc_ids = jnp.zeros((b, n + 1), jnp.int32).at[rows, slot].max(ids.astype(jnp.int32))[:, :n]
    return starts, lens, doc_ids, inside


def _pair_kv(q_docs, kv_docs):
    """kv's (starts, lens) reordered so that slot k holds the kv document with q's k-th id."""
    (_, _, id_q, _), (st, ln, id_kv, _) = q_docs, kv_docs
    match = (id_q[:, :, None] == id_kv[:, None, :]) & (id_q[:, :, None] != 0)
    j = jnp.argmax(match, axis=-1)
    found = jnp.any(match, axis=-1)
    take = lambda a: jnp.take_along_axis(a, j, axis=1)  # noqa: E731
    return jnp.where(found, take(st), 0), jnp.where(found, take(ln), 0)


def _offsets(starts, s, per_token):
    """Element offsets (b * n + 1,) int32 of the documents of a (b, s) token grid."""
    b = starts.shape[0]
    tok = (jnp.arange(b, dtype=jnp.int32)[:, None] * s + starts).reshape(-1)
    return jnp.concatenate([tok, jnp.array([b * s], jnp.int32)]) * per_token


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(cfg: _Config, q, k, v, lens_q, lens_kv, ragged, in_q, in_kv, seed, offset):
    return _ragged_fwd(cfg, q, k, v, lens_q, lens_kv, ragged, in_q, in_kv, seed, offset)[0]


def _zero_outside(x, inside):
    return jnp.where(inside[:, None, None], x, jnp.zeros((), x.dtype))


def _ragged_fwd(cfg, q, k, v, lens_q, lens_kv, ragged, in_q, in_kv, seed, offset):
    o, stats, _ = ffi.attention_fwd(
        q, k, v, None, lens_q, lens_kv, ragged, seed, offset, None, None, flags=cfg.flags(),
        scale=cfg.scale, dropout_rate=cfg.rate, max_sq=cfg.max_s, max_skv=cfg.max_s, o_dtype=q.dtype,
        dv=v.shape[-1],
    )  # fmt: skip
    o = _zero_outside(o, in_q)
    return o, (q, k, v, o, stats, lens_q, lens_kv, ragged, in_q, in_kv, seed, offset)


def _ragged_bwd(cfg, res, ct):
    q, k, v, o, stats, lens_q, lens_kv, ragged, in_q, in_kv, seed, offset = res
    dq, dk, dv, _, _, _ = ffi.attention_bwd(
        q, k, v, o, ct.astype(q.dtype), stats, None, lens_q, lens_kv, ragged, seed, offset, None, None,
        flags=cfg.flags(), scale=cfg.scale, dropout_rate=cfg.rate, max_sq=cfg.max_s,
        max_skv=cfg.max_s, grad_dtype=q.dtype, want_dbias=False, want_dsink=False,
    )  # fmt: skip
    dq = _zero_outside(dq, in_q)
    dk, dv = _zero_outside(dk, in_kv), _zero_outside(dv, in_kv)
    return dq, dk, dv, None, None, None, None, None, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def packed_attention(q, k, v, ids_q, ids_kv, *, max_segments: int, causal: bool, scale: float,
                     dropout_rate: float = 0.0, rng=None):  # fmt: skip
    """Attention of ``q (b, s, h, d)`` over ``k``/``v (b, s, g, d)`` per document
    (``ids_q``/``ids_kv (b, s)``, at most ``max_segments`` per row) through cuDNN's ragged path
    (GPU, bf16/fp16). Returns ``(b, s, h, d)`` in q's dtype, 0 outside every document."""
    b, s, h, d = q.shape
    g = k.shape[2]
    n = int(max_segments)
    dq_docs, dkv_docs = documents(ids_q, n), documents(ids_kv, n)
    st_kv, ln_kv = _pair_kv(dq_docs, dkv_docs)
    st_q, ln_q = dq_docs[0], dq_docs[1]
    ragged = jnp.stack([
        _offsets(st_q, s, h * d), _offsets(st_kv, s, g * d), _offsets(st_kv, s, g * v.shape[-1]),
        _offsets(st_q, s, h * v.shape[-1]),
    ]).astype(jnp.int32)  # fmt: skip
    seed = offset = None
    if dropout_rate > 0:
        bits = jax.random.bits(rng, (4,), jnp.uint32)
        seed, offset = bits[:2], bits[2:]
    cfg = _Config(bool(causal), float(scale), float(dropout_rate), s)
    flat = lambda x: x.reshape((b * s,) + x.shape[2:])  # noqa: E731
    out = _ragged(
        cfg, flat(q), flat(k), flat(v), ln_q.reshape(-1), ln_kv.reshape(-1), ragged,
        dq_docs[3].reshape(-1), dkv_docs[3].reshape(-1), seed, offset,
    )  # fmt: skip
    return out.reshape(b, s, h, v.shape[-1])


__all__ = ["documents", "packed_attention"]
