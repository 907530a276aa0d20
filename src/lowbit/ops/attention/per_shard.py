"""Attention run per (batch, heads) shard under a mesh: the one shard_map wrapper the fused
paths share (Flax's jax.nn / cuDNN paths and lowbit's cuDNN op "cudnn_ffi").

The fused attention custom calls have no partitioning rule XLA can use for a heads-split bias
(their cuDNN graph build failed on DP x TP, issue 24), and attention is independent per sequence
and head, so each shard runs the whole op locally: batch over dp/fsdp, heads over tp
(:func:`lowbit.sharding.plan_heads`).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from lowbit.sharding import batch_shards, plan_heads, shard_map


def _axis_names(*entries) -> tuple:
    return tuple(a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e))


def per_shard_attention(fn, query, key, value, bias=None, mask=None, sink=None, rng=None):
    """``fn(query, key, value, bias, mask, sink, rng)`` (layouts (b, s, heads, d); bias and mask
    broadcastable to (b, h, sq, skv); sink (h,); rng a key) run per shard under a mesh, else
    called once as given.

    A bias or mask shared over the batch (leading dim 1) is replicated over the batch axes (its
    cotangent is summed over them); one with a row per sequence or per batch shard is split with
    the batch. The sink is split with the heads. Each shard gets ``rng`` folded with its index
    along every split axis: a different dropout stream per shard."""
    plan = plan_heads(query.shape[0], query.shape[2], key.shape[2]) if query.ndim == key.ndim == 4 else None
    if plan is None:
        return fn(query, key, value, bias, mask, sink, rng)
    mesh, b, h = plan
    qkv = P(b, None, h, None)

    def spec4(a):  # (b or batch shards or 1, h or 1, sq, skv); anything else replicated
        if a.ndim != 4:
            return P()
        split = a.shape[0] in (query.shape[0], batch_shards(query.shape[0])) and a.shape[0] > 1
        return P(b if split else None, h if a.shape[1] > 1 else None)

    args = {n: a for n, a in (("bias", bias), ("mask", mask), ("sink", sink), ("rng", rng)) if a is not None}
    specs = {"sink": lambda a: P(h), "rng": lambda a: P()}
    axes = _axis_names(b, h)

    def body(q, k, v, *rest):
        got = dict(zip(args, rest))
        r = got.get("rng")
        if r is not None:
            for a in axes:
                r = jax.random.fold_in(r, jax.lax.axis_index(a))
        return fn(q, k, v, got.get("bias"), got.get("mask"), got.get("sink"), r)

    in_specs = (qkv, qkv, qkv, *(specs.get(n, spec4)(a) for n, a in args.items()))
    return shard_map(body, mesh, in_specs, qkv)(query, key, value, *args.values())


__all__ = ["per_shard_attention"]
