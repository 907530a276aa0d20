"""``transformer_engine.jax.cpp_extensions.gemm``: the collective-GEMM names a framework passes
to ``dense``. lowbit runs no collective GEMMs (its sharded dense does its own all-gather /
reduce-scatter under a MeshResource): the no-op set is accepted, the others are refused by
``dense``, and bootstrapping them raises."""

from __future__ import annotations

import dataclasses
import enum


class CollectiveOp(enum.Enum):
    """The collective fused into a GEMM: none, all-gather of the input, reduce-scatter of the output."""

    NONE = 0
    ALL_GATHER = 1
    REDUCE_SCATTER = 2

    @property
    def is_all_gather(self) -> bool:
        return self is CollectiveOp.ALL_GATHER

    @property
    def is_reduce_scatter(self) -> bool:
        return self is CollectiveOp.REDUCE_SCATTER

    @property
    def is_none(self) -> bool:
        return self is CollectiveOp.NONE


# The backward GEMM runs the dual collective of the forward one.
_DUAL = {
    CollectiveOp.NONE: CollectiveOp.NONE,
    CollectiveOp.ALL_GATHER: CollectiveOp.REDUCE_SCATTER,
    CollectiveOp.REDUCE_SCATTER: CollectiveOp.ALL_GATHER,
}


@dataclasses.dataclass(frozen=True)
class CollectiveOpSet:
    """The collectives of one dense layer's forward and backward GEMMs."""

    forward: CollectiveOp
    backward: CollectiveOp

    @staticmethod
    def create(forward_collective_op: CollectiveOp) -> CollectiveOpSet:
        op = CollectiveOp(forward_collective_op)
        return CollectiveOpSet(forward=op, backward=_DUAL[op])


noop_collective_op_set = CollectiveOpSet.create(forward_collective_op=CollectiveOp.NONE)


def is_noop_collective(op_set) -> bool:
    """None or a set with no collective in either direction."""
    return op_set is None or (op_set.forward.is_none and op_set.backward.is_none)


def collective_gemm_bootstrap(
    num_total_devices,
    num_devices_per_process,
    process_id,
    tensor_parallel_size,
    num_max_streams=3,
    compute_stream_priority=0,
    communication_stream_priority=0,
    num_sm_for_communication=2,
    use_ce=True,
    aggregate_all_gather=False,
    use_cublasmp=False,
):
    """TE's setup of its communication/GEMM-overlap library; lowbit has none."""
    raise NotImplementedError(
        "collective_gemm_bootstrap: collective GEMMs are not supported by lowbit.te; lowbit's dense "
        "shards itself under lowbit.te.sharding.MeshResource (no bootstrap needed)"
    )


__all__ = [
    "CollectiveOp",
    "CollectiveOpSet",
    "collective_gemm_bootstrap",
    "noop_collective_op_set",
]
