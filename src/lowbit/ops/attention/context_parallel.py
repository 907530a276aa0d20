"""Context parallelism: the sequence split over one mesh axis, as TransformerEngine's
``context_parallel_axis`` / ``context_parallel_strategy``.

* all-gather: each device gathers the whole key/value sequence (and its segment ids and
  positions) and attends its query block to it;
* ring: each device keeps its query block and passes its key/value block around the ring with
  ``ppermute``; every step merges the partial result of the block it holds by the online softmax
  (log-sum-exp). The next block's ``ppermute`` is issued before the current block's attention, so
  XLA can overlap the transfer with the compute. Gradients are JAX's autodiff through the ring
  (the transposed ``ppermute`` runs the ring backwards).

Causal load balancing: the tokens are reordered before the split
(:func:`reorder_causal_load_balancing`) so every device holds early and late positions; the
masks compare the reordered positions, so the result is the unsplit attention's, reordered.
"""

from __future__ import annotations

import enum
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lowbit.ops.attention.core import merge
from lowbit.sharding import current_mesh, plan_heads, shard_map

CP_STRATEGIES = {
    "DEFAULT": "all_gather",
    "ALL_GATHER": "all_gather",
    "ALLGATHER": "all_gather",
    "RING": "ring",
}


class ReorderStrategy(enum.Enum):
    """TransformerEngine's load-balancing orders. DualChunkSwap: the sequence in ``2 * cp``
    chunks, device ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``. Striped: stripes of
    ``stripe_size`` tokens dealt round-robin, device ``r`` holding stripes ``r, r + cp, ...``."""

    DualChunkSwap = 0
    Striped = 1


def strategy_name(v) -> str:
    """``context_parallel_strategy`` (a string, case-insensitive, or a CPStrategy member) as
    "all_gather" or "ring" (DEFAULT: all-gather, as TransformerEngine picks for BSHD)."""
    s = getattr(v, "name", v)
    key = s.upper() if isinstance(s, str) else s
    if key not in CP_STRATEGIES:
        raise ValueError(
            f"context_parallel_strategy must be one of {list(CP_STRATEGIES)} (case insensitive), got {v!r}"
        )
    return CP_STRATEGIES[key]


def _strategy(strategy):
    if isinstance(strategy, ReorderStrategy):
        return strategy
    name = getattr(strategy, "name", strategy)
    for s in ReorderStrategy:
        if isinstance(name, str) and name.lower() == s.name.lower():
            return s
    raise ValueError(f"strategy must be a ReorderStrategy (DualChunkSwap or Striped), got {strategy!r}")


def load_balance_order(strategy, cp_size: int, seq: int, stripe_size: Optional[int] = None) -> np.ndarray:
    """The original position of each token after reordering (a permutation of ``range(seq)``)."""
    strategy = _strategy(strategy)
    if not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if strategy is ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(f"stripe_size must be None for DualChunkSwap, got {stripe_size!r}")
        if seq % (2 * cp_size):
            raise ValueError(f"the sequence length {seq} must be a multiple of 2 * cp_size = {2 * cp_size}")
        chunks = np.arange(seq).reshape(2 * cp_size, -1)
        return np.concatenate(
            [np.concatenate([chunks[r], chunks[2 * cp_size - 1 - r]]) for r in range(cp_size)]
        )
    stripe = 1 if stripe_size is None else stripe_size
    if not isinstance(stripe, (int, np.integer)) or stripe < 1:
        raise ValueError(f"stripe_size must be a positive int, got {stripe_size!r}")
    if seq % (cp_size * stripe):
        raise ValueError(
            f"the sequence length {seq} must be a multiple of cp_size * stripe_size = {cp_size * stripe}"
        )
    return np.arange(seq).reshape(-1, cp_size, stripe).transpose(1, 0, 2).reshape(-1)


def _take(tensor, order, seq_dim):
    if not -tensor.ndim <= seq_dim < tensor.ndim:
        raise ValueError(f"seq_dim={seq_dim} out of range for a tensor of rank {tensor.ndim}")
    return jnp.take(tensor, jnp.asarray(order), axis=seq_dim)


def reorder_causal_load_balancing(tensor, strategy, cp_size: int, seq_dim: int, stripe_size=None):
    """``tensor`` reordered along ``seq_dim`` for causal load balancing over ``cp_size`` devices."""
    order = load_balance_order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return _take(tensor, order, seq_dim)


def inverse_reorder_causal_load_balancing(tensor, strategy, cp_size: int, seq_dim: int, stripe_size=None):
    """The inverse of :func:`reorder_causal_load_balancing`."""
    order = load_balance_order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return _take(tensor, np.argsort(order), seq_dim)


def cp_mesh(axis: str):
    """``(mesh, size)`` of the context-parallel axis, or None where context parallelism does not
    apply: no axis named, no mesh, an axis of size 1 (ignored, as TransformerEngine does)."""
    if not axis:
        return None
    if not isinstance(axis, str):
        raise TypeError(f"context_parallel_axis must be a mesh axis name (str), got {axis!r}")
    mesh = current_mesh()
    if mesh is None:
        return None
    if axis not in mesh.axis_names:
        raise ValueError(
            f"context_parallel_axis={axis!r} is not an axis of the mesh in context "
            f"(axes {tuple(mesh.axis_names)})"
        )
    size = int(mesh.shape[axis])
    return None if size == 1 else (mesh, size)


def _inside_manual(axis) -> bool:
    get_abstract = getattr(jax.sharding, "get_abstract_mesh", None)
    return axis in set(getattr(get_abstract(), "manual_axes", ()) or ()) if get_abstract else False


def _ring(step_fn, q, kv, axis, size, rng):
    """``q`` against every device's ``kv`` block, passed around the ring; partials merged."""
    me = jax.lax.axis_index(axis)
    perm = [(i, (i + 1) % size) for i in range(size)]
    acc = None
    for step in range(size):
        # Issue the transfer of the next block first: it depends only on the current one.
        nxt = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), kv) if step < size - 1 else None
        src = (me - step) % size
        part = step_fn(q, kv, None if rng is None else jax.random.fold_in(rng, me * size + src))
        acc = part if acc is None else merge(acc, part)
        kv = nxt
    return acc


def _gather(step_fn, q, kv, axis, size, rng):
    full = jax.tree.map(lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True), kv)
    me = jax.lax.axis_index(axis)
    return step_fn(q, full, None if rng is None else jax.random.fold_in(rng, me))


def context_parallel(
    step_fn: Callable,
    q,
    kv: tuple,
    q_extra: tuple,
    rng,
    *,
    axis: str,
    strategy: str,
):
    """Run ``step_fn((q, *q_extra), kv_block, rng) -> (out, lse)`` with the sequence (axis 1 of
    ``q``, of every ``kv`` array and of every ``q_extra`` array) split over mesh ``axis``:
    ``strategy`` "all_gather" or "ring". Returns ``(out, lse)`` of the whole sequence (``out``
    laid out as ``q``, ``lse (b, h, sq)``), or None where the axis does not apply (size 1, no
    mesh). Batch and heads stay split as :func:`lowbit.sharding.plan_heads` plans them."""
    body = _ring if strategy == "ring" else _gather
    return over_context(functools.partial(body, step_fn), q, kv, q_extra, rng, axis=axis)


def over_context(body: Callable, q, kv: tuple, q_extra: tuple, rng, *, axis: str, with_lse: bool = True):
    """``body((q, *q_extra), kv, axis, size, rng)`` run per device with the sequence (axis 1 of
    every array) split over mesh ``axis`` (batch and heads as :func:`lowbit.sharding.plan_heads`
    plans them), or called directly inside a shard_map over ``axis``. ``body`` returns
    ``(out, lse)``, or ``out`` alone with ``with_lse=False``. None where the axis does not
    apply (size 1, no mesh)."""
    if _inside_manual(axis):  # already per shard (the caller's shard_map)
        size = jax.lax.psum(1, axis)
        return body((q, *q_extra), kv, axis, size, rng)
    found = cp_mesh(axis)
    if found is None:
        return None
    mesh, size = found
    b, sq, h = q.shape[:3]
    for name, a in (("query", q), *((f"key/value[{i}]", a) for i, a in enumerate(kv))):
        if a.shape[1] % size:
            raise ValueError(
                f"context_parallel_axis={axis!r} of size {size} must divide the {name} sequence "
                f"length {a.shape[1]}"
            )
    plan = plan_heads(b, h, kv[0].shape[2])
    bax, hax = (plan[1], plan[2]) if plan is not None and plan[0] is mesh else (None, None)

    def spec(a):  # (b, s, heads?, ...): batch and sequence split, heads where planned
        rest = [hax if a.ndim == 4 and i == 0 else None for i in range(a.ndim - 2)]
        return P(bax, axis, *rest)

    def run(q, kv, extra, key):
        return body((q, *extra), kv, axis, size, key)

    in_specs = (spec(q), tuple(spec(a) for a in kv), tuple(spec(a) for a in q_extra), P())
    out_specs = (spec(q), P(bax, hax, axis)) if with_lse else spec(q)
    return shard_map(run, mesh, in_specs, out_specs)(q, tuple(kv), tuple(q_extra), rng)


__all__ = [
    "CP_STRATEGIES",
    "ReorderStrategy",
    "context_parallel",
    "cp_mesh",
    "inverse_reorder_causal_load_balancing",
    "load_balance_order",
    "over_context",
    "reorder_causal_load_balancing",
    "strategy_name",
]
