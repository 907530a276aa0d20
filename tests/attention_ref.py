"""Float64 references of attention for the test_attention_* files, written from the definitions:
``softmax(scale * q k^T + bias)`` with a mask, an optional sink logit per head in the denominator
(``exp(s_i) / (exp(sink) + sum_j exp(s_j))``) and dropout of the probabilities; and the same
attention run separately on each document of a packed row (the packing reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def attend64(q, k, v, scale, keep=None, sink=None, drop_keep=None, rate=0.0):
    """q (b, sq, h, d), k/v (b, sk, g, d) float64; keep (b|1, 1|h, sq, sk) True = attend; sink
    (h,) or None; drop_keep (b, h, sq, sk) the kept probabilities. Rows with no key give 0."""
    h, g = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if keep is None:
        keep = jnp.ones(s.shape, bool)
    keep = jnp.broadcast_to(keep, s.shape)
    m = jnp.max(jnp.where(keep, s, -jnp.inf), axis=-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, jnp.reshape(sink, (1, -1, 1, 1)))
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        den = den + jnp.exp(jnp.reshape(sink, (1, -1, 1, 1)) - m)
    p = e / jnp.where(den > 0, den, 1.0)
    if drop_keep is not None:
        p = jnp.where(drop_keep, p / (1.0 - rate), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def segment_pos(ids):
    """Positions inside each run of equal ids (numpy, (b, s))."""
    ids = np.asarray(ids)
    pos = np.zeros_like(ids)
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            pos[r, t] = pos[r, t - 1] + 1 if ids[r, t] == ids[r, t - 1] else 0
    return pos


def per_document64(q, k, v, ids_q, ids_kv, scale, causal, sink=None, bottom_right=False):
    """The packed rows' attention run per document (float64): each non-zero id of each row is its
    own sequence (its tokens in order), causal top-left or bottom-right within it. Padding
    tokens (id 0) output 0."""
    ids_q, ids_kv = np.asarray(ids_q), np.asarray(ids_kv)
    out = jnp.zeros(q.shape, q.dtype)
    for r in range(q.shape[0]):
        for doc in sorted(set(ids_q[r].tolist()) - {0}):
            tq, tk = np.where(ids_q[r] == doc)[0], np.where(ids_kv[r] == doc)[0]
            keep = None
            if causal:
                off = len(tk) - len(tq) if bottom_right else 0
                keep = jnp.asarray(np.arange(len(tk))[None, :] <= np.arange(len(tq))[:, None] + off)[
                    None, None
                ]
            o = attend64(q[r : r + 1, tq], k[r : r + 1, tk], v[r : r + 1, tk], scale, keep, sink)
            out = out.at[r, tq].set(o[0])
    return out


def to64(*arrays):
    return tuple(jnp.asarray(np.asarray(a, np.float64)) for a in arrays)
