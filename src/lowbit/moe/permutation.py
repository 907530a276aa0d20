"""Token dispatch / combine (lowbit's names); the implementation lives with the expert-parallel
engine in :mod:`lowbit.ops.fused.permutation`, which this module re-exports."""

from lowbit.ops.fused.permutation import (
    DispatchPlan,
    buffer_rows,
    permute,
    permute_probs,
    plan_dispatch,
    row_experts,
    sort_chunks,
    unpermute,
)

__all__ = [
    "DispatchPlan",
    "buffer_rows",
    "permute",
    "permute_probs",
    "plan_dispatch",
    "row_experts",
    "sort_chunks",
    "unpermute",
]
