"""``transformer_engine.jax.permutation`` on lowbit (plain JAX gathers; no Triton).

``token_dispatch`` / ``token_combine`` take TE's (T, E) routing map. Their ``row_id_map`` (T,
2E + 1) has TE's layout: per token, the rows of its n routed experts (before alignment padding;
-1 after them), then those experts' ids (ascending; -1 after), then n. ``pure_jax_token_*``
take (T, k) expert ids and run on :mod:`lowbit.moe.permutation`'s plan. The ragged all-to-all
helpers compute the same offsets and sizes as TE's.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from lowbit.moe import permutation as _perm
from lowbit.ops.fused.permutation import combine_pairs, exclusive_cumsum

__all__ = [
    "token_dispatch",
    "token_combine",
    "sort_chunks_by_index",
    "routing_map_to_selected_experts",
    "PureJaxPermState",
    "pure_jax_token_dispatch",
    "pure_jax_token_combine",
    "compute_ragged_all_to_all_params",
    "compute_reverse_ragged_all_to_all_params",
    "local_permute_after_a2a",
    "local_unpermute_before_a2a",
]


def _flat(a, name):
    if a.ndim not in (2, 3):
        raise ValueError(f"{name} must be 2-D or 3-D, got shape {tuple(a.shape)}")
    return a.reshape(-1, a.shape[-1])


def _rows_from_map(routing_map, align_size):
    """dest (T, E) unpadded rows, pad_offsets (E,) or None, counts (E,), sizes (E,)."""
    mask = routing_map != 0
    m32 = mask.astype(jnp.int32)
    counts = jnp.sum(m32, axis=0)
    dest = exclusive_cumsum(counts)[None, :] + exclusive_cumsum(m32, axis=0)
    if align_size is None:
        return jnp.where(mask, dest, -1), None, counts, counts
    sizes = (counts + align_size - 1) // align_size * align_size
    return jnp.where(mask, dest, -1), exclusive_cumsum(sizes - counts), counts, sizes


def token_dispatch(
    inp: jnp.ndarray,
    routing_map: jnp.ndarray,
    num_out_tokens: int,
    probs: Optional[jnp.ndarray] = None,
    align_size: Optional[int] = None,
):
    """Returns ``(output, permuted_probs, row_id_map, pad_offsets, tokens_per_expert)`` as TE's."""
    x, rmap = _flat(inp, "token_dispatch: inp"), _flat(routing_map, "token_dispatch: routing_map")
    T, E = rmap.shape
    if x.shape[0] != T:
        raise ValueError(f"token_dispatch: inp has {x.shape[0]} tokens, routing_map {T}")
    if not isinstance(num_out_tokens, int) or num_out_tokens <= 0:
        raise ValueError(f"token_dispatch: num_out_tokens must be a Python int > 0, got {num_out_tokens!r}")
    if align_size is not None and (not isinstance(align_size, int) or align_size < 1):
        raise ValueError(f"token_dispatch: align_size must be None or an int >= 1, got {align_size!r}")
    dest, pad, counts, sizes = _rows_from_map(rmap, align_size)
    if align_size is None:
        rows, padded = num_out_tokens, dest
    else:
        rows = (num_out_tokens + E * (align_size - 1)) // align_size * align_size
        padded = jnp.where(dest >= 0, dest + pad[None, :], -1)
    # The token (and its expert) in each row: an int scatter, then gathers only.
    ok = (padded >= 0) & (padded < rows)
    tgt = jnp.where(ok, padded, rows).reshape(-1)
    tok = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, E)).reshape(-1)
    src = jnp.full((rows,), T, jnp.int32).at[tgt].set(tok, mode="drop")
    out = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src]
    pprobs = None
    if probs is not None:
        p = _flat(probs, "token_dispatch: probs")
        flat_p = jnp.concatenate([p.reshape(-1), jnp.zeros((1,), p.dtype)])
        eid = (
            jnp.full((rows,), 0, jnp.int32)
            .at[tgt]
            .set(jnp.tile(jnp.arange(E, dtype=jnp.int32), T), mode="drop")
        )
        pprobs = flat_p[jnp.where(src < T, src * E + eid, T * E)]
    # TE's row_id_map: each token's routed rows, compacted in expert order.
    order = jnp.argsort(~(rmap != 0), axis=1, stable=True).astype(jnp.int32)
    n = jnp.sum(rmap != 0, axis=1).astype(jnp.int32)
    live = jnp.arange(E)[None, :] < n[:, None]
    rows_c = jnp.where(live, jnp.take_along_axis(dest, order, 1), -1)
    row_id_map = jnp.concatenate([rows_c, jnp.where(live, order, -1), n[:, None]], axis=1).astype(jnp.int32)
    return out.reshape(-1, x.shape[1]), pprobs, row_id_map, pad, sizes.astype(jnp.int32)


def token_combine(
    inp: jnp.ndarray,
    row_id_map: jnp.ndarray,
    merging_probs: Optional[jnp.ndarray] = None,
    pad_offsets: Optional[jnp.ndarray] = None,
) -> jnp.ndarray:
    """out[t] = sum over t's routed experts e of ``merging_probs[t, e] * inp[row(t, e)]`` (float32
    sum, inp's dtype); rows past ``inp`` add zero."""
    T, E = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
    rows_c, eids = row_id_map[:, :E], row_id_map[:, E : 2 * E]
    if pad_offsets is not None:
        rows_c = jnp.where(rows_c >= 0, rows_c + pad_offsets[jnp.maximum(eids, 0)], -1)
    R = inp.shape[0]
    ok = (rows_c >= 0) & (rows_c < R)
    tgt = jnp.where(ok, rows_c, R).reshape(-1)
    tok = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, E)).reshape(-1)
    src = jnp.full((R,), T, jnp.int32).at[tgt].set(tok, mode="drop")
    y = inp.astype(jnp.float32)
    if merging_probs is not None:
        p = _flat(merging_probs, "token_combine: merging_probs").astype(jnp.float32)
        eid = jnp.zeros((R,), jnp.int32).at[tgt].set(jnp.maximum(eids, 0).reshape(-1), mode="drop")
        w = jnp.concatenate([p.reshape(-1), jnp.zeros((1,), jnp.float32)])[
            jnp.where(src < T, src * E + eid, T * E)
        ]
        y = y * w[:, None]
    out = jnp.zeros((T + 1, inp.shape[1]), jnp.float32).at[src].add(y)[:T]
    return out.astype(inp.dtype)


def sort_chunks_by_index(inp: jnp.ndarray, split_sizes: jnp.ndarray, sorted_indices: jnp.ndarray):
    """``(output, row_id_map)``: chunks of rows (sizes ``split_sizes``) in ``sorted_indices``' order."""
    x = _flat(inp, "sort_chunks_by_index: inp")
    return _perm.sort_chunks(x, split_sizes, sorted_indices)


def routing_map_to_selected_experts(sparse_probs, routing_map, topk: int):
    """(T, E) probs and routing map -> ``(selected_experts, weights)`` (T, topk)."""
    selected = jnp.argsort(routing_map, axis=-1)[..., -topk:]
    return selected, jnp.take_along_axis(sparse_probs, selected, axis=-1)


class PureJaxPermState(NamedTuple):
    """State from :func:`pure_jax_token_dispatch`: ``sorted_indices`` (rows,) is the pair
    (token * k + slot) in each row (``num_real_tokens`` for padding)."""

    sorted_indices: jax.Array
    num_real_tokens: int
    padding_size: int


def pure_jax_token_dispatch(
    inputs: jnp.ndarray,
    selected_experts: jnp.ndarray,
    num_experts: int,
    num_experts_per_tok: int,
    align_size: int = 0,
    roll_to_expert_id: Optional[int] = None,
) -> Tuple[jnp.ndarray, PureJaxPermState, jnp.ndarray]:
    """Returns ``(sorted_inputs (T k + E (align - 1), H), perm_state, group_sizes (E,))``;
    ``roll_to_expert_id`` r renumbers expert e as (e - r) mod E first (group sizes in that order)."""
    if num_experts_per_tok != selected_experts.shape[-1]:
        raise ValueError(
            f"pure_jax_token_dispatch: num_experts_per_tok={num_experts_per_tok} must equal "
            f"selected_experts.shape[-1]={selected_experts.shape[-1]}"
        )
    x = inputs.reshape(-1, inputs.shape[-1])
    ex = selected_experts.reshape(-1, num_experts_per_tok).astype(jnp.int32)
    if roll_to_expert_id is not None:
        ex = (ex - roll_to_expert_id) % num_experts
    plan = _perm.plan_dispatch(ex, num_experts, align_size=align_size)
    P = ex.size
    state = PureJaxPermState(plan.src, P, plan.src.shape[0] - P)
    return _perm.permute(x, plan), state, plan.group_sizes


def pure_jax_token_combine(
    expert_outputs: jnp.ndarray,
    perm_state: PureJaxPermState,
    routing_weights: jnp.ndarray,
    num_experts_per_tok: int,
    batch_size: int,
    sequence_length: int,
) -> jnp.ndarray:
    """Unsorts, drops the padding rows, sums each token's k rows with its weights (float32 sum,
    expert_outputs' dtype): ``(batch_size, sequence_length, H)``."""
    src, P = perm_state.sorted_indices, perm_state.num_real_tokens
    rows = src.shape[0]
    dest = jnp.full((P,), rows, jnp.int32).at[src].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
    w = routing_weights.reshape(-1, num_experts_per_tok)
    y = combine_pairs(expert_outputs, w, dest.reshape(w.shape), src)
    return y.reshape(batch_size, sequence_length, -1)


def _owned(counts, shard_id, n):
    """(sends (n,), recvs (n,), matrix [src, dst]) from (n, E) per-shard per-expert counts."""
    S, E = counts.shape
    if S != n or E % n:
        raise ValueError(
            f"all_shards_tokens_per_expert must be (num_expert_shards, E) with E divisible by it; "
            f"got {tuple(counts.shape)} for num_expert_shards={n}"
        )
    m = jnp.sum(counts.reshape(n, n, E // n), axis=2)  # [src, dst]
    return m[shard_id], m[:, shard_id], m


def compute_ragged_all_to_all_params(all_shards_tokens_per_expert, shard_id, num_expert_shards: int):
    """``(input_offsets, send_sizes, output_offsets, recv_sizes)`` of the forward exchange."""
    send, recv, m = _owned(all_shards_tokens_per_expert, shard_id, num_expert_shards)
    return exclusive_cumsum(send), send, exclusive_cumsum(m, axis=0)[shard_id], recv


def compute_reverse_ragged_all_to_all_params(all_shards_tokens_per_expert, shard_id, num_expert_shards: int):
    """The same four arrays for sending the expert outputs back."""
    send, recv, m = _owned(all_shards_tokens_per_expert, shard_id, num_expert_shards)
    return exclusive_cumsum(recv), recv, exclusive_cumsum(m.T, axis=0)[shard_id], send


def local_permute_after_a2a(x_recv, all_shards_tokens_per_expert, shard_id, num_expert_shards: int):
    """Received rows (source-major, then local expert) -> expert-major: ``(sorted_x,
    local_group_sizes, state)``."""
    n, E = all_shards_tokens_per_expert.shape
    El = E // num_expert_shards
    cols = jax.lax.dynamic_slice(all_shards_tokens_per_expert, (0, shard_id * El), (n, El))
    split = cols.reshape(-1)
    order = jnp.arange(n * El, dtype=jnp.int32).reshape(n, El).T.reshape(-1)
    out, _ = _perm.sort_chunks(x_recv, split, order)
    state = {
        "sorted_split_sizes": split[order],
        "inverse_chunk_indices": jnp.argsort(order).astype(jnp.int32),
    }
    return out, jnp.sum(cols, axis=0), state


def local_unpermute_before_a2a(expert_outputs, state):
    """The inverse of :func:`local_permute_after_a2a`."""
    return _perm.sort_chunks(expert_outputs, state["sorted_split_sizes"], state["inverse_chunk_indices"])[0]
