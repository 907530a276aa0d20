"""FFI calls of the activations (csrc/ffi/activation.cc): forward, optionally writing FP8
copies of its output, and backward, optionally with the bias gradient and FP8 copies of dx
(tensor and FP8 block scaling; ``pow2`` / ``eps``: the block scales' options)."""

from __future__ import annotations

import jax
import numpy as np

from lowbit import _native, abi
from lowbit._native import EMPTY_F32, NO_RESULT_U8
from lowbit.ops._ffi.quantize import fused_attrs, fused_results

# The `act` attribute.
LINEAR, GELU_TANH, GELU_EXACT, RELU = abi.ACT_LINEAR, abi.ACT_GELU_TANH, abi.ACT_GELU_EXACT, abi.ACT_RELU
SILU, QUICK_GELU, SQUARED_RELU = abi.ACT_SILU, abi.ACT_QUICK_GELU, abi.ACT_SQUARED_RELU


def act_fwd(x, scale, *, act: int, gated: bool, want_y: bool, mode, q, flags, pow2=False, eps=0.0):
    """x (R, W) with W = 2H gated, else H. ``q`` None or the FP8 dtype the kernel writes
    (``mode``, layout ``flags``, encode ``scale`` (1,) or None). Returns ``(y, data,
    scale_inv, colwise data, colwise scale_inv, amax)`` of the (R, H) output; y (0,) unless
    ``want_y``."""
    R, W = x.shape
    H = W // 2 if gated else W
    out_types = (
        jax.ShapeDtypeStruct((R, H), x.dtype) if want_y else NO_RESULT_U8,
        *fused_results(q, flags, R, H, mode),
    )
    return _native.ffi_call(
        "act_fwd",
        out_types,
        x,
        EMPTY_F32 if scale is None else scale,
        act=np.int32(act),
        gated=np.int32(bool(gated)),
        **fused_attrs(mode, q, pow2, eps),
    )


def act_bwd(dy, x, scale, *, act: int, gated: bool, want_dbias: bool, mode, q, flags, pow2=False, eps=0.0):
    """dy (R, H), x (R, W). Returns ``(dx, data, scale_inv, colwise data, colwise scale_inv,
    amax, dbias)``: dx (R, W) unless the kernel writes FP8 copies of it (``q``), dbias (W,) when
    ``want_dbias``; the others zero-length."""
    (R, H), W = dy.shape, x.shape[1]
    out_types = (
        NO_RESULT_U8 if q is not None else jax.ShapeDtypeStruct((R, W), x.dtype),
        *fused_results(q, flags, R, W, mode),
        jax.ShapeDtypeStruct((W,), x.dtype) if want_dbias else NO_RESULT_U8,
    )
    return _native.ffi_call(
        "act_bwd",
        out_types,
        dy,
        x,
        EMPTY_F32 if scale is None else scale,
        workspace=(R, H, int(gated), int(want_dbias)),
        act=np.int32(act),
        gated=np.int32(bool(gated)),
        **fused_attrs(mode, q, pow2, eps),
    )
