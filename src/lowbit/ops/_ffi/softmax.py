"""FFI calls of the fused softmax (csrc/ffi/softmax.cc): forward over 4-D (B, H, Sq, Sk) with an
optional broadcast mask, backward over rows."""

from __future__ import annotations

import jax
import numpy as np

from lowbit import _native, abi

# The `softmax_type` attribute.
SCALED, SCALED_MASKED = abi.SOFTMAX_SCALED, abi.SOFTMAX_SCALED_MASKED
SCALED_UPPER_TRIANG_MASKED = abi.SOFTMAX_SCALED_UPPER_TRIANG_MASKED


def softmax_fwd(x, mask, *, softmax_type: int, scale_factor: float):
    """x (B, H, Sq, Sk); mask uint8 4-D broadcastable to x (nonzero = masked out) or None."""
    return _native.ffi_call(
        "softmax_fwd",
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
        _native.EMPTY_U8 if mask is None else mask,
        softmax_type=np.int32(softmax_type),
        scale_factor=np.float32(scale_factor),
    )


def softmax_bwd(dy, y, *, scale_factor: float):
    """dy, y (rows, Sk) -> dx."""
    return _native.ffi_call(
        "softmax_bwd", jax.ShapeDtypeStruct(y.shape, y.dtype), dy, y, scale_factor=np.float32(scale_factor)
    )
