"""FFI calls of the MoE kernels (csrc/ffi/moe.cc): router forward/backward, dispatch plan,
permute (plain or FP8 tensor-scaled), combine forward/backward. Shapes are checked by the
callers (lowbit.moe, lowbit.ops.fused.permutation_fused)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native, abi

SCORES = {
    "softmax": abi.MOE_SCORE_SOFTMAX,
    "sigmoid": abi.MOE_SCORE_SIGMOID,
    "sqrtsoftplus": abi.MOE_SCORE_SQRTSOFTPLUS,
}
ROWWISE, COLWISE = abi.MOE_PERMUTE_ROWWISE, abi.MOE_PERMUTE_COLWISE
PLAN_CHUNK = 1024  # kMoePlanChunk (moe.h)

_I32, _F32 = jnp.int32, jnp.float32


def router_fwd(logits, bias, *, topk, score, pre_softmax, num_groups, group_topk, scaling):
    """logits (T, E) float32, bias (E,) float32 or None -> (weights (T, k) f32, experts (T, k) i32)."""
    T = logits.shape[0]
    out = (jax.ShapeDtypeStruct((T, topk), _F32), jax.ShapeDtypeStruct((T, topk), _I32))
    return _native.ffi_call(
        "moe_router_fwd", out, logits, _native.EMPTY_F32 if bias is None else bias,
        topk=np.int32(topk), score=np.int32(SCORES[score]), pre_softmax=bool(pre_softmax),
        num_groups=np.int32(num_groups or 0), group_topk=np.int32(group_topk or 0),
        scaling=np.float32(scaling),
    )  # fmt: skip


def router_bwd(logits, experts, dweights, *, score, pre_softmax, scaling):
    """-> dlogits (T, E) float32."""
    return _native.ffi_call(
        "moe_router_bwd", jax.ShapeDtypeStruct(logits.shape, _F32), logits, experts, dweights,
        score=np.int32(SCORES[score]), pre_softmax=bool(pre_softmax), scaling=np.float32(scaling),
    )  # fmt: skip


def plan(experts, *, num_experts, rows, align, capacity):
    """experts (T, k) int32 -> (dest (T, k), src (rows,), sizes, offsets, counts (E,)), int32."""
    T, k = experts.shape
    chunks = max(-(-(T * k) // PLAN_CHUNK), 1)
    scratch = chunks * num_experts + 1 if _native.cuda_library() is not None else 0
    E = num_experts
    out = (
        jax.ShapeDtypeStruct((T, k), _I32),
        jax.ShapeDtypeStruct((rows,), _I32),
        *(jax.ShapeDtypeStruct((E,), _I32) for _ in range(3)),
        jax.ShapeDtypeStruct((scratch,), _I32),
    )
    res = _native.ffi_call(
        "moe_plan", out, experts, num_experts=np.int64(E), align=np.int64(max(align, 1)),
        capacity=np.int64(-1 if capacity is None else capacity),
    )  # fmt: skip
    return tuple(res[:5])


def permute(x, src, experts, *, rows):
    """Plain gather: (rows, d) in x's dtype."""
    T, d = x.shape
    out = (
        jax.ShapeDtypeStruct((rows, d), x.dtype),
        *(jax.ShapeDtypeStruct((0,), t) for t in (jnp.uint8, _F32, _F32, _F32)),
    )
    res = _native.ffi_call(
        "moe_permute", out, x, src, experts, _native.EMPTY_F32,
        mode=np.int32(abi.MODE_NO_SCALING), q=np.int32(0), flags=np.int32(ROWWISE),
    )  # fmt: skip
    return res[0]


def permute_fp8(x, src, experts, delayed, *, num_experts, mode, q_dtype, rowwise, colwise):
    """FP8 gather-cast: (data (rows, d) or None, colwise (d, rows) or None, scale_inv (E,),
    amax (E,))."""
    T, d = x.shape
    rows, E = src.shape[0], num_experts
    q = np.dtype(q_dtype)
    code = abi.DTYPE_E4M3 if q == np.dtype(jnp.float8_e4m3fn) else abi.DTYPE_E5M2
    out = (
        jax.ShapeDtypeStruct((rows, d) if rowwise else (0,), q),
        jax.ShapeDtypeStruct((d, rows) if colwise else (0,), q),
        jax.ShapeDtypeStruct((E,), _F32),
        jax.ShapeDtypeStruct((E,), _F32),
        jax.ShapeDtypeStruct((T,), _F32),
    )
    flags = (ROWWISE if rowwise else 0) | (COLWISE if colwise else 0)
    data, col, s_inv, amax, _ = _native.ffi_call(
        "moe_permute", out, x, src, experts, _native.EMPTY_F32 if delayed is None else delayed,
        mode=np.int32(mode), q=np.int32(code), flags=np.int32(flags),
    )  # fmt: skip
    return (data if rowwise else None), (col if colwise else None), s_inv, amax


def combine_fwd(y, w, dest, out_dtype):
    T = dest.shape[0]
    return _native.ffi_call("moe_combine_fwd", jax.ShapeDtypeStruct((T, y.shape[1]), out_dtype), y, w, dest)


def combine_bwd(g, y, w, dest, src):
    """-> (dy like y, dw (T, k) float32)."""
    out = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(w.shape, _F32))
    return _native.ffi_call("moe_combine_bwd", out, g, y, w, dest, src)
