"""ep_dispatch: the index work of the expert-parallel capacity dispatch (lowbit.ops.fused.moe).

A device's (token, expert) pairs go to (devices, rows) send blocks, one per destination, grouped
by expert inside each block (:func:`send_slots`); each block carries its per-expert counts in
extra rows of the payload's dtype (:func:`encode_counts`), so one all-to-all moves both; the
receiver turns the counts into index maps between its (source, row) blocks and the expert-major
rows of its grouped GEMMs (:func:`receive_maps`), with no sort. :func:`move_rows` applies such a
map with a gather in both directions (a plain gather's transpose is a scatter-add of token rows,
slow on GPUs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowbit.ops.fused.permutation import DispatchPlan, buffer_rows, exclusive_cumsum

DIGIT = 256  # counts travel as base-256 digits: integers below 256 are exact in bf16
DIGITS = 3  # counts below 2^24


def meta_rows(experts_local: int, d: int) -> int:
    """Rows appended to each (source, destination) block to carry its per-expert row counts."""
    return -(-(DIGITS * experts_local) // d)


def encode_counts(counts, d, dtype):
    """(n, El) int32 -> (n, m, d) rows of ``dtype`` holding each count's base-256 digits."""
    n, El = counts.shape
    m = meta_rows(El, d)
    digits = jnp.stack([(counts // DIGIT**i) % DIGIT for i in range(DIGITS)], axis=-1)
    flat = jnp.zeros((n, m * d), dtype).at[:, : DIGITS * El].set(digits.reshape(n, -1).astype(dtype))
    return flat.reshape(n, m, d)


def decode_counts(rows, El):
    """The inverse of :func:`encode_counts`: (n, m, d) -> (n, El) int32."""
    n = rows.shape[0]
    digits = rows.reshape(n, -1)[:, : DIGITS * El].astype(jnp.float32).astype(jnp.int32)
    return jnp.sum(digits.reshape(n, El, DIGITS) * DIGIT ** jnp.arange(DIGITS), axis=-1)


@jax.custom_vjp
def move_rows(x, take, give):
    """``out[i] = x[take[i]]`` (zero where ``take[i] == len(x)``); ``give`` is the inverse map
    (``give[r] = i`` where ``take[i] == r``, else ``len(out)``). Both directions gather: a
    scatter-add of token rows (the transpose of a plain gather) is slow on GPUs."""
    return _take_rows(x, take)


def _take_rows(x, idx):
    return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[idx]


def _move_rows_fwd(x, take, give):
    return _take_rows(x, take), give


def _move_rows_bwd(give, g):
    return _take_rows(g, give), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def send_slots(plan: DispatchPlan, experts, devices: int, rows: int):
    """Sender: pair (t, j) -> slot ``dest * rows + rank`` of the (devices, rows) send blocks,
    rank its place among the pairs for that destination in (expert, token) order; ``devices *
    rows`` past ``rows`` (dropped). ``plan``: the dropless :func:`plan_dispatch` of ``experts``
    (global expert ids, split evenly over the devices). Returns (plan with those slots as dest
    and src, kept rows per (destination, local expert) (devices, E / devices))."""
    n, C = devices, rows
    T, k = experts.shape
    sizes = plan.group_sizes.reshape(n, -1)
    j = experts.reshape(-1) // sizes.shape[1]
    rank = plan.dest.reshape(-1) - exclusive_cumsum(jnp.sum(sizes, axis=1))[j]
    slot = jnp.where(rank < C, j * C + rank, n * C).astype(jnp.int32)
    src = jnp.full((n * C,), T * k, jnp.int32).at[slot].set(jnp.arange(T * k, dtype=jnp.int32), mode="drop")
    kept = jnp.clip(C - exclusive_cumsum(sizes, axis=1), 0, sizes)
    return dataclasses.replace(plan, dest=slot.reshape(T, k), src=src), kept


def receive_maps(recv, C, align: int = 0):
    """Receiver: row (s, r) of the received (n, C) blocks (grouped by local expert inside each
    block, ``recv`` (n, El) rows each) -> row of the expert-major buffer (expert, source, rank),
    and back. ``align``: every expert's group starts at a multiple of ``align`` rows and spans a
    multiple of them (FP8: the grouped weight gradient reads 16-row aligned groups in place);
    the padding rows come from no block (zero) and go back to none; the buffer has the one-device
    dispatch's rows for ``n C`` pairs (``permutation.buffer_rows``, rounded to ``align``).
    Returns (take (buffer rows,), give (n C,), group sizes (El,), padded); ``n * C`` in take and
    the buffer's rows in give = none."""
    n, El = recv.shape
    tot = jnp.sum(recv, axis=0)
    a = max(align, 1)
    size = (tot + a - 1) // a * a  # as plan_dispatch pads each expert's group
    rows = buffer_rows(n * C, El, align, round_rows=True)
    start = exclusive_cumsum(size)[None, :] + exclusive_cumsum(recv, axis=0) - exclusive_cumsum(recv, axis=1)
    r = jnp.arange(C, dtype=jnp.int32)
    e = jnp.sum(r[None, :, None] >= jnp.cumsum(recv, axis=1)[:, None, :], axis=2)  # (n, C); El: none
    at = jnp.take_along_axis(start, jnp.minimum(e, El - 1), axis=1) + r[None, :]
    give = jnp.where(e < El, at, rows).reshape(-1).astype(jnp.int32)
    take = jnp.full((rows,), n * C, jnp.int32).at[give].set(jnp.arange(n * C, dtype=jnp.int32), mode="drop")
    return take, give, size.astype(jnp.int32)


__all__ = [
    "decode_counts",
    "encode_counts",
    "meta_rows",
    "move_rows",
    "receive_maps",
    "send_slots",
]
