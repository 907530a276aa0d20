"""``transformer_engine.jax.cpp_extensions.gemm``: the collective-GEMM names a framework passes
to ``dense``, and ``gemm`` (TE's JAX-path semantics). lowbit runs no collective GEMMs (its
sharded dense does its own all-gather / reduce-scatter under a MeshResource): the no-op set is
accepted, the others are refused by ``dense``, and bootstrapping them raises."""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

import lowbit


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


def _dims(dims, ndim: int, what: str) -> tuple:
    dims = tuple(int(d) for d in (dims if isinstance(dims, (tuple, list)) else (dims,)))
    if any(not -ndim <= d < ndim for d in dims) or len({d % ndim for d in dims}) != len(dims):
        raise ValueError(f"gemm: contracting_dims {dims} are not distinct axes of the rank-{ndim} {what}")
    return tuple(d % ndim for d in dims)


def _contracted_last(x, dims, quantizer):
    # The operand with its contracted axes last (free axes in order), quantized and dequantized
    # as ``quantizer`` says: blocks run along the contraction, as in an FP8 GEMM.
    free = [d for d in range(x.ndim) if d not in dims]
    x = jnp.transpose(x, free + list(dims))
    if quantizer is None:
        return x
    if not all(hasattr(quantizer, a) for a in ("scaling_mode", "q_dtype", "scale")):
        raise TypeError(f"gemm: quantizers must be lowbit.te.quantize.Quantizer or None, got {quantizer!r}")
    kw = {} if quantizer.scale is None else {"scale": quantizer.scale}
    q = lowbit.quantize(x, quantizer.scaling_mode, quantizer.q_dtype, flatten_axis=x.ndim - len(dims), **kw)
    return lowbit.dequantize(q, dtype=x.dtype)


def gemm(
    lhs,
    rhs,
    bias=None,
    contracting_dims=((-1,), (0,)),
    lhs_quantizer=None,
    rhs_quantizer=None,
    transpose_batch_sequence: bool = False,
    collective_op: CollectiveOp = CollectiveOp.NONE,
    **kwargs,
):
    """TE's ``tex.gemm``: ``lhs . rhs (+ bias)`` over ``contracting_dims``, each operand quantized
    by its quantizer (or ``quantizer_set=``'s x / kernel) first. As TE's own JAX path
    (``NVTE_JAX_CUSTOM_CALLS`` off) it contracts the dequantized operands with float32
    accumulation: the values equal an FP8 GEMM's up to summation order. For FP8 GEMM kernels and
    their gradients use ``lowbit.te.dense.dense``. Output: lhs's free axes, then rhs's.
    ``transpose_batch_sequence`` only matters to collective GEMMs, which lowbit does not run."""
    del transpose_batch_sequence
    qset = kwargs.pop("quantizer_set", None)
    if kwargs:
        raise NotImplementedError(f"gemm: arguments {sorted(kwargs)} are not supported by lowbit.te")
    if not CollectiveOp(collective_op).is_none:
        raise NotImplementedError(
            f"gemm: collective_op={collective_op!r} is not supported by lowbit.te (no collective GEMMs)"
        )
    if qset is not None and (lhs_quantizer is None or rhs_quantizer is None):
        lhs_quantizer, rhs_quantizer = qset.x, qset.kernel
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lc, rc = (_dims(d, a.ndim, w) for d, a, w in zip(contracting_dims, (lhs, rhs), ("lhs", "rhs")))
    if len(lc) != len(rc) or any(lhs.shape[i] != rhs.shape[j] for i, j in zip(lc, rc)):
        raise ValueError(
            f"gemm: contracting_dims {contracting_dims} pair axes of different sizes: lhs {lhs.shape}, "
            f"rhs {rhs.shape}"
        )
    out_dtype = jnp.result_type(lhs, rhs)
    a, b = _contracted_last(lhs, lc, lhs_quantizer), _contracted_last(rhs, rc, rhs_quantizer)
    c = len(lc)
    dims = ((tuple(range(a.ndim - c, a.ndim)), tuple(range(b.ndim - c, b.ndim))), ((), ()))
    y = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32)
    return y.astype(out_dtype)


__all__ = [
    "CollectiveOp",
    "CollectiveOpSet",
    "collective_gemm_bootstrap",
    "gemm",
    "noop_collective_op_set",
]
