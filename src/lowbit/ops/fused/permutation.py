"""Token dispatch and combine: the (token, expert) pairs sorted into per-expert row groups and back.

A :class:`DispatchPlan` is made once per routing (:func:`plan_dispatch`): every pair ``(t, j)``
(token t's j-th expert) gets a row ``dest[t, j]`` of a static-size buffer; the rows of expert e
are consecutive, in token order, from ``offsets[e]``; ``group_sizes[e]`` rows belong to it
(alignment padding included: zero rows). Pairs past an expert's capacity (``capacity``, optional)
get ``dest = rows`` (dropped: they read a zero row and add nothing). Everything is computed on the
device with static shapes: group sizes never reach the host.

:func:`permute` gathers ``x[t]`` into row ``dest[t, j]`` (its backward sums each token's rows,
a gather as well); :func:`unpermute` gives ``sum_j w[t, j] * y[dest[t, j]]`` in float32 (its
backward: a gather of the weighted gradient into the buffer, and ``<g[t], y[dest[t, j]]>`` for
the weights). Both custom VJPs read the plan's two index maps (``dest`` and ``src``, the pair in
each row), so neither direction scatters.

``impl``: "xla" (this module's JAX) or "fused" (lowbit's kernels,
:mod:`lowbit.ops.fused.permutation_fused`); None takes the trace-time default that
``lowbit.moe.kernels(impl)`` sets (initially "xla").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from lowbit.ops.fused import permutation_fused as _fused


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Where each pair goes. ``dest`` (T, k) int32 (``rows`` = dropped); ``src`` (rows,) int32:
    the pair (``t * k + j``) in each row, ``T * k`` for padding; ``group_sizes`` (E,) int32;
    ``offsets`` (E,) int32: each expert's first row; ``tokens_per_expert`` (E,) int32: the routed
    pairs per expert before capacity and padding."""

    dest: jax.Array
    src: jax.Array
    group_sizes: jax.Array
    offsets: jax.Array
    tokens_per_expert: jax.Array


def exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def buffer_rows(
    pairs: int,
    num_experts: int,
    align_size: int = 0,
    capacity: Optional[int] = None,
    round_rows: bool = False,
) -> int:
    """Static rows of the dispatch buffer: every pair plus the worst-case alignment padding
    (``num_experts * (align_size - 1)``; ``round_rows``: rounded up to a multiple of
    ``align_size``), or ``num_experts`` aligned capacities if smaller."""
    a = max(int(align_size), 1)
    rows = pairs + num_experts * (a - 1)
    if round_rows:
        rows = -(-rows // a) * a
    if capacity is not None:
        rows = min(rows, num_experts * (-(-int(capacity) // a) * a))
    return rows


def plan_dispatch(
    experts: jax.Array,
    num_experts: int,
    *,
    align_size: int = 0,
    capacity: Optional[int] = None,
    impl: Optional[str] = None,
    round_rows: bool = False,
) -> DispatchPlan:
    """The plan for (T, k) int ``experts`` (see the module docstring). ``align_size`` > 0 rounds
    each expert's group up to a multiple of it (``round_rows``: the buffer's rows too, so that
    its row stride is aligned as well); ``capacity`` caps each expert's pairs (the first
    ``capacity`` in token order are kept)."""
    if jnp.ndim(experts) != 2 or not jnp.issubdtype(jnp.result_type(experts), jnp.integer):
        raise ValueError(
            f"plan_dispatch: experts must be a 2-D integer array (tokens, topk), got shape "
            f"{tuple(jnp.shape(experts))} dtype {jnp.result_type(experts)}"
        )
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 0:
        raise ValueError(f"plan_dispatch: align_size must be an integer >= 0, got {align_size!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"plan_dispatch: capacity must be None or an integer >= 1, got {capacity!r}")
    if not isinstance(round_rows, bool):
        raise ValueError(f"plan_dispatch: round_rows must be a bool, got {round_rows!r}")
    impl = _fused.check_impl("plan_dispatch", impl)
    T, k = experts.shape
    P = T * k
    rows = buffer_rows(P, num_experts, align_size, capacity, round_rows)
    if impl == "fused":
        dest, src, sizes, offsets, counts = _fused.plan_fused(
            experts, num_experts, rows, align_size, capacity
        )
        return DispatchPlan(dest, src, sizes, offsets, counts)
    flat = experts.reshape(-1).astype(jnp.int32)
    # Stable sort by expert: token order inside each group. rank = position inside the group.
    order = jnp.argsort(flat, stable=True)
    sorted_pos = jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rank = sorted_pos - exclusive_cumsum(counts)[flat]
    kept = counts if capacity is None else jnp.minimum(counts, capacity)
    a = max(align_size, 1)
    sizes = (kept + a - 1) // a * a
    offsets = exclusive_cumsum(sizes)
    dest = jnp.where(rank < kept[flat], offsets[flat] + rank, rows).astype(jnp.int32)
    src = jnp.full((rows,), P, jnp.int32).at[dest].set(jnp.arange(P, dtype=jnp.int32), mode="drop")
    return DispatchPlan(dest.reshape(T, k), src, sizes, offsets, counts)


# ---------------------------------------------------------------------------------------------
# permute: rows[r] = x[src[r] // k] (zero for padding)
# ---------------------------------------------------------------------------------------------
def _with_zero_row(a):
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def _gather_rows(x, src, k):
    P = x.shape[0] * k
    return _with_zero_row(x)[jnp.where(src < P, src // k, x.shape[0])]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute(k, x, dest, src):
    return _gather_rows(x, src, k)


def _permute_fwd(k, x, dest, src):
    return _gather_rows(x, src, k), (dest, src)


def _permute_bwd(k, res, g):
    dest, _ = res
    dx = jnp.sum(_with_zero_row(g)[dest].astype(jnp.float32), axis=1).astype(g.dtype)
    return dx, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x: jax.Array, plan: DispatchPlan, impl: Optional[str] = None) -> jax.Array:
    """(T, d) tokens -> (rows, d) rows grouped by expert (zero padding rows)."""
    impl = _fused.check_impl("permute", impl)
    T, k = plan.dest.shape
    if jnp.ndim(x) != 2 or x.shape[0] != T:
        raise ValueError(
            f"permute: x must be (tokens, hidden) with tokens = {T} (the plan's), got {tuple(jnp.shape(x))}"
        )
    if impl == "fused":
        return _fused.permute_fused(k, x, plan.dest, plan.src)
    return _permute(k, x, plan.dest, plan.src)


def permute_probs(weights: jax.Array, plan: DispatchPlan) -> jax.Array:
    """(T, k) per-pair values -> (rows,) in row order (zero for padding): the permuted probs."""
    P = weights.size
    return jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[jnp.minimum(plan.src, P)]


# ---------------------------------------------------------------------------------------------
# unpermute: out[t] = sum_j w[t, j] * y[dest[t, j]], float32
# ---------------------------------------------------------------------------------------------
def _combine(y, w, dest, out_dtype):
    picked = _with_zero_row(y)[dest].astype(jnp.float32)  # (T, k, d)
    return jnp.einsum("tkd,tk->td", picked, w.astype(jnp.float32)).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute(out_dtype, y, w, dest, src):
    return _combine(y, w, dest, out_dtype)


def _unpermute_fwd(out_dtype, y, w, dest, src):
    return _combine(y, w, dest, out_dtype), (y, w, dest, src)


def _unpermute_bwd(out_dtype, res, g):
    y, w, dest, src = res
    T, k = w.shape
    g32 = g.astype(jnp.float32)
    wg = (w.astype(jnp.float32)[..., None] * g32[:, None, :]).reshape(T * k, -1)  # per pair
    dy = _with_zero_row(wg)[jnp.minimum(src, T * k)].astype(y.dtype)
    dw = jnp.einsum("tkd,td->tk", _with_zero_row(y)[dest].astype(jnp.float32), g32).astype(w.dtype)
    return dy, dw, None, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(
    y: jax.Array,
    plan: DispatchPlan,
    weights: Optional[jax.Array] = None,
    out_dtype=None,
    impl: Optional[str] = None,
) -> jax.Array:
    """(rows, d) expert outputs -> (T, d): each token's rows summed with ``weights`` (T, k)
    (None: plain sum), in float32, rounded to ``out_dtype`` (default y's)."""
    T, k = plan.dest.shape
    if jnp.ndim(y) != 2 or y.shape[0] != plan.src.shape[0]:
        raise ValueError(
            f"unpermute: y must be (rows, hidden) with rows = {plan.src.shape[0]} (the plan's buffer), "
            f"got {tuple(jnp.shape(y))}"
        )
    if weights is None:
        weights = jnp.ones((T, k), jnp.float32)
    if tuple(jnp.shape(weights)) != (T, k):
        raise ValueError(
            f"unpermute: weights must have shape (tokens, topk) = ({T}, {k}), got {tuple(jnp.shape(weights))}"
        )
    return combine_pairs(y, weights, plan.dest, plan.src, out_dtype, impl)


def combine_pairs(y, weights, dest, src, out_dtype=None, impl=None) -> jax.Array:
    """:func:`unpermute` from bare index maps: ``dest`` (T, k) rows (``len(y)`` = none),
    ``src`` (rows,) pairs (``T * k`` = none)."""
    out_dtype = jnp.dtype(out_dtype if out_dtype is not None else y.dtype)
    if _fused.check_impl("unpermute", impl) == "fused":
        return _fused.combine_fused(out_dtype, y, weights, dest, src)
    return _unpermute(out_dtype, y, weights, dest, src)


def row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """(rows,) int32: the expert each buffer row belongs to (``E`` past the last group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right").astype(jnp.int32)


def sort_chunks(
    x: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Reorders consecutive row chunks (sizes ``split_sizes``) into the order ``sorted_indices``
    lists; rows past the chunks stay in place. Returns ``(out, row_map)`` with ``out[i] =
    x[row_map[i]]`` (differentiable through the gather)."""
    n = x.shape[0]
    sizes = split_sizes.astype(jnp.int32)
    starts = exclusive_cumsum(sizes)
    new_sizes = sizes[sorted_indices]
    new_starts = exclusive_cumsum(new_sizes)
    i = jnp.arange(n, dtype=jnp.int32)
    chunk = jnp.searchsorted(jnp.cumsum(new_sizes), i, side="right")
    inside = chunk < sizes.shape[0]
    c = jnp.minimum(chunk, sizes.shape[0] - 1)
    row_map = jnp.where(inside, starts[sorted_indices[c]] + i - new_starts[c], i).astype(jnp.int32)
    return x[row_map], row_map


__all__ = [
    "DispatchPlan",
    "buffer_rows",
    "combine_pairs",
    "exclusive_cumsum",
    "permute",
    "permute_probs",
    "plan_dispatch",
    "row_experts",
    "sort_chunks",
    "unpermute",
]
