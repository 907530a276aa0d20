"""FP8 attention's kernels run per (batch, heads) shard under a mesh.

:func:`lowbit.ops.attention.fp8.fp8_attention` keeps its custom VJP (and so the scales and the
DelayedScaling state update) outside the shard_map: the scales enter every shard replicated, the
kernels (cuDNN or the emulation) run on the shard's sequences and heads, and the amaxes the
kernels report come back as the max over the shards, so the state and the current-scaling bounds
are the ones one device would compute. Each shard folds the dropout key with its index along
every split axis (a different dropout stream per shard, as the BF16 per-shard path does); the
cuDNN seeds that derive from it travel as one row per shard between the forward and the
backward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lowbit.sharding import shard_map


def _axes(*entries) -> tuple:
    return tuple(a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e))


def _fold(rng, axes):
    if rng is None:
        return None
    for a in axes:
        rng = jax.random.fold_in(rng, jax.lax.axis_index(a))
    return rng


def _pmax(x, axes):
    return jax.lax.pmax(x, axes) if axes else x


def _res_specs(res, qkv, stats, shards):
    """Specs of a forward's residuals: (b, s, h, d) arrays with q, the cuDNN stats (b, h, sq)
    with the batch and heads, per-shard seeds (one row each) over every split axis."""
    out = []
    for r in res:
        if r is None:
            out.append(None)
        elif r.ndim == 4:
            out.append(qkv)
        elif r.ndim == 3:
            out.append(stats)
        else:  # a seed or offset, made per shard: (1, 2) locally
            out.append(shards)
    return tuple(out)


def _wrap_seeds(res):
    return tuple(r[None] if r is not None and r.ndim == 1 else r for r in res)


def _unwrap_seeds(res):
    return tuple(r[0] if r is not None and r.ndim == 2 else r for r in res)


def sharded_fwd(cfg, run, plan, q, k, v, sc, rng):
    """``run(cfg, q, k, v, sc, rng)`` (-> out, residuals, amax(s), amax(o)) per shard of ``plan``
    (mesh, batch entry, head entry)."""
    mesh, b, h = plan
    axes = _axes(b, h)
    qkv, stats, shards = P(b, None, h, None), P(b, h, None), P(axes)
    # The residual structure (which entries exist, their ranks) from an abstract run on one shard.
    local = [jax.ShapeDtypeStruct(_local_shape(x.shape, mesh, b, h), x.dtype) for x in (q, k, v)]
    spec_of = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)  # noqa: E731
    abstract = jax.eval_shape(
        lambda q, k, v, sc, rng: run(cfg, q, k, v, sc, rng), *local, jax.tree.map(spec_of, sc),
        None if rng is None else spec_of(rng),
    )  # fmt: skip
    res_spec = _res_specs(abstract[1], qkv, stats, shards)

    def body(q, k, v, sc, *rest):
        out, res, a_s, a_o = run(cfg, q, k, v, sc, _fold(rest[0] if rest else None, axes))
        return out, _wrap_seeds(res), _pmax(a_s, axes), _pmax(a_o, axes)

    extra = () if rng is None else (rng,)
    in_specs = (qkv, qkv, qkv, P(), *((P(),) if extra else ()))
    out, res, a_s, a_o = shard_map(body, mesh, in_specs, (qkv, res_spec, P(), P()))(q, k, v, sc, *extra)
    return out, res, a_s, a_o


def sharded_bwd(cfg, run, plan, res, sc, ct, rng):
    """``run(cfg, res, sc, ct, rng)`` (-> (dq, dk, dv), amaxes) per shard, residuals as
    :func:`sharded_fwd` returned them."""
    mesh, b, h = plan
    axes = _axes(b, h)
    qkv, stats, shards = P(b, None, h, None), P(b, h, None), P(axes)
    res_spec = _res_specs(_unwrap_seeds(res), qkv, stats, shards)

    def body(res, sc, ct, *rest):
        grads, am = run(cfg, _unwrap_seeds(res), sc, ct, _fold(rest[0] if rest else None, axes))
        return grads, {r: _pmax(a, axes) for r, a in am.items()}

    extra = () if rng is None else (rng,)
    in_specs = (res_spec, P(), qkv, *((P(),) if extra else ()))
    return shard_map(body, mesh, in_specs, ((qkv, qkv, qkv), P()))(res, sc, ct, *extra)


def _local_shape(shape, mesh, b, h):
    """(b, s, h, d) divided by the sizes of the batch and head entries."""

    def size(e):
        return math.prod(mesh.shape[a] for a in _axes(e))

    return (shape[0] // size(b), shape[1], shape[2] // size(h), shape[3])


__all__ = ["sharded_bwd", "sharded_fwd"]
