"""The fused-kernel path of :mod:`lowbit.ops.fused.permutation` (csrc/kernels/*/moe.*): the
dispatch plan as one counting sort, the permutation as one gather (optionally quantizing the
rows to FP8 with per-expert tensor scales and writing the transposed copy the weight gradient
reads, in the same pass), and the weighted combine with its backward.

Which path runs is chosen at trace time: ``impl="xla"`` (default) or ``"fused"`` on each
function, or :func:`kernels` for everything traced inside it (so one process can time both).

Numerics against the XLA path: the plan and the permutation are equal bit for bit; the FP8
permutation equals ``grouped_quantize(permute(x), plan.group_sizes)``; the combine sums each
token's k rows in order in float32 (XLA's einsum may sum in another order: equal up to float32
rounding of the sum, then rounded to the output dtype); its backward's ``dy`` is bit-equal, its
``dw`` a float32 dot in another order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._ffi import moe as ffi
from lowbit.ops.nonfinite import poison_nonfinite
from lowbit.quantization.scaling_modes import ScalingMode
from lowbit.quantization.tensor import ScaledTensor

IMPLS = ("xla", "fused")
_IMPL = contextvars.ContextVar("lowbit_moe_impl", default="xla")


@contextlib.contextmanager
def kernels(impl: str):
    """Traces the MoE router / dispatch / combine inside the block with ``impl`` ("xla" or
    "fused") where a call does not name one. Read at trace time: enter it inside the function
    that jax.jit traces (jit's cache does not see it), or around the first call of a new jit."""
    token = _IMPL.set(check_impl("kernels", impl))
    try:
        yield
    finally:
        _IMPL.reset(token)


def check_impl(name, impl):
    impl = _IMPL.get() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {IMPLS} (or None: the current default), got {impl!r}")
    return impl


def plan_fused(experts, num_experts, rows, align, capacity):
    """(dest, src, sizes, offsets, counts) of the plan, one kernel sequence, no host sync."""
    return ffi.plan(
        jax.lax.stop_gradient(experts).astype(jnp.int32),
        num_experts=num_experts,
        rows=rows,
        align=align,
        capacity=capacity,
    )


# ---------------------------------------------------------------------------------------------
# permute: gather forward; backward = the unweighted combine (each token's rows summed)
# ---------------------------------------------------------------------------------------------
def _sum_rows(g, dest, dtype):
    return ffi.combine_fwd(g, jnp.ones(dest.shape, jnp.float32), dest, np.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def permute_fused(k, x, dest, src):
    return ffi.permute(x, src, jnp.zeros((x.shape[0], k), jnp.int32), rows=src.shape[0])


def _permute_fwd(k, x, dest, src):
    return permute_fused(k, x, dest, src), (dest, src)


def _permute_bwd(k, res, g):
    dest, _ = res
    return _sum_rows(g, dest, g.dtype), None, None


permute_fused.defvjp(_permute_fwd, _permute_bwd)


# ---------------------------------------------------------------------------------------------
# combine: out[t] = sum_j w[t, j] * y[dest[t, j]]
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_fused(out_dtype, y, w, dest, src):
    return ffi.combine_fwd(y, w.astype(jnp.float32), dest, out_dtype)


def _combine_fwd(out_dtype, y, w, dest, src):
    return combine_fused(out_dtype, y, w, dest, src), (y, w, dest, src)


def _combine_bwd(out_dtype, res, g):
    y, w, dest, src = res
    dy, dw = ffi.combine_bwd(g, y, w.astype(jnp.float32), dest, src)
    return dy, dw.astype(w.dtype), None, None


combine_fused.defvjp(_combine_fwd, _combine_bwd)


# ---------------------------------------------------------------------------------------------
# permute + FP8 quantization (per-expert tensor scales), one pass over the rows
# ---------------------------------------------------------------------------------------------
def permute_quantize(x, plan, experts, scaling_mode, q_dtype=jnp.float8_e4m3fn, *, scale=None, layout="both"):
    """The rows of ``permute(x, plan)`` quantized per expert group, as
    ``grouped_quantize(permute(x, plan), plan.group_sizes, scaling_mode, q_dtype, scale=scale,
    layout=layout)`` gives them (bit for bit), without writing the bf16 rows: one read of x for
    the per-expert amaxes, one gather-cast that writes the rowwise copy and the (d, rows)
    colwise copy. ``scaling_mode``: DELAYED_TENSOR_SCALING (``scale`` (E,) float32) or
    CURRENT_TENSOR_SCALING. ``experts``: the (T, k) routing the plan was made from. No gradient
    (the grouped GEMM's custom VJP owns the backward)."""
    mode = ScalingMode(scaling_mode)
    if mode not in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING):
        raise ValueError(
            "permute_quantize: scaling_mode must be DELAYED_TENSOR_SCALING or "
            f"CURRENT_TENSOR_SCALING, got {mode.name}"
        )
    if layout not in ("rowwise", "colwise", "both"):
        raise ValueError(f"permute_quantize: layout must be 'rowwise', 'colwise' or 'both', got {layout!r}")
    T, k = plan.dest.shape
    if jnp.ndim(x) != 2 or x.shape[0] != T:
        raise ValueError(
            f"permute_quantize: x must be (tokens, hidden) with tokens = {T}, got {tuple(jnp.shape(x))}"
        )
    if tuple(jnp.shape(experts)) != (T, k):
        raise ValueError(
            f"permute_quantize: experts must have shape ({T}, {k}), got {tuple(jnp.shape(experts))}"
        )
    E = plan.group_sizes.shape[0]
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        if scale is None or tuple(jnp.shape(scale)) != (E,):
            raise ValueError(f"permute_quantize: DELAYED_TENSOR_SCALING needs scale of shape ({E},)")
        scale = jnp.asarray(scale, jnp.float32)
    elif scale is not None:
        raise ValueError("permute_quantize: scale is only used with DELAYED_TENSOR_SCALING")
    rowwise, colwise = layout in ("rowwise", "both"), layout in ("colwise", "both")
    # All of them: under jax.grad the routing's integer arrays carry (float0) tangents too, and
    # an FFI call refuses any tangent.
    x, scale, src, experts = jax.lax.stop_gradient((x, scale, plan.src, experts))
    data, col, s_inv, amax = ffi.permute_fp8(
        x, src, experts.astype(jnp.int32), scale, num_experts=E, mode=int(mode), q_dtype=q_dtype,
        rowwise=rowwise, colwise=colwise,
    )  # fmt: skip
    return poison_nonfinite(
        ScaledTensor(
            data=data,
            scale_inv=s_inv if rowwise else None,
            colwise_data=col,
            colwise_scale_inv=s_inv if colwise else None,
            amax=amax,
            global_scale_inv=None,
            scaling_mode=mode,
            q_dtype=np.dtype(q_dtype),
            dq_dtype=np.dtype(x.dtype),
            shape=(plan.src.shape[0], x.shape[1]),
            flatten_axis=1,
        )
    )


__all__ = ["IMPLS", "combine_fused", "kernels", "permute_fused", "permute_quantize", "plan_fused"]
