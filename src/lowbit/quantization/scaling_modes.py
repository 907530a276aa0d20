"""Scaling modes and the dtype codes shared with the C++ kernels (their values: lowbit.abi)."""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np

from lowbit import abi


class ScalingMode(enum.IntEnum):
    """How a quantized tensor's scales are chosen and laid out (docs/numerics.md)."""

    NO_SCALING = abi.MODE_NO_SCALING
    DELAYED_TENSOR_SCALING = abi.MODE_DELAYED_TENSOR_SCALING
    CURRENT_TENSOR_SCALING = abi.MODE_CURRENT_TENSOR_SCALING
    MXFP8_1D_SCALING = abi.MODE_MXFP8_1D_SCALING
    NVFP4_1D_SCALING = abi.MODE_NVFP4_1D_SCALING
    NVFP4_2D_SCALING = abi.MODE_NVFP4_2D_SCALING
    BLOCK_1D_SCALING = abi.MODE_BLOCK_1D_SCALING
    BLOCK_2D_SCALING = abi.MODE_BLOCK_2D_SCALING

    @property
    def is_tensor_scaling(self) -> bool:
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    @property
    def is_nvfp4(self) -> bool:
        return self in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING)

    @property
    def is_fp8_block(self) -> bool:
        """FP8 with float32 scales per 1x128 block or 128x128 tile (Float8BlockScaling)."""
        return self in (ScalingMode.BLOCK_1D_SCALING, ScalingMode.BLOCK_2D_SCALING)

    @property
    def block_size(self) -> int:
        """Elements per scale along a copy's last axis (1 for tensor scaling)."""
        if self.is_fp8_block:
            return 128
        if self == ScalingMode.MXFP8_1D_SCALING:
            return 32
        if self.is_nvfp4:
            return 16
        return 1

    @property
    def default_q_dtype(self):
        if self.is_nvfp4:
            return jnp.float4_e2m1fn
        return jnp.float8_e4m3fn


def fp8_block_scale_shape(mode: ScalingMode, rows: int, cols: int) -> tuple:
    """The float32 scale_inv shape of a (rows, cols) copy under FP8 block scaling.

    The layout is the one cuBLASLt's block-scaled FP8 GEMM reads on Hopper (TransformerEngine's
    "GEMM_READY"), so the GEMM takes the scales as they are:

    * ``BLOCK_1D_SCALING`` (1x128 blocks along cols, cuBLASLt ``VEC128_32F``):
      ``(ceil(cols/128), round_up(rows, 4))``, entry ``[j, r]`` = block ``(r, j)``: the rows
      (the GEMM's M or N) are contiguous, padded to a multiple of 4 (16 bytes).
    * ``BLOCK_2D_SCALING`` (128x128 tiles, cuBLASLt ``BLK128x128_32F``):
      ``(ceil(rows/128), round_up(ceil(cols/128), 4))``, entry ``[i, j]`` = tile ``(i, j)``.

    Partial blocks at the ends of a row (cols not a multiple of 128) or of the tile rows are
    blocks of their own; padding entries hold 1.0.
    """
    nc = -(-cols // 128)
    if mode == ScalingMode.BLOCK_1D_SCALING:
        return (nc, -(-rows // 4) * 4)
    return (-(-rows // 128), -(-nc // 4) * 4)


_DTYPE_CODES = {
    np.dtype(jnp.float32): abi.DTYPE_F32,
    np.dtype(jnp.bfloat16): abi.DTYPE_BF16,
    np.dtype(jnp.float16): abi.DTYPE_F16,
    np.dtype(jnp.float8_e4m3fn): abi.DTYPE_E4M3,
    np.dtype(jnp.float8_e5m2): abi.DTYPE_E5M2,
    np.dtype(jnp.float4_e2m1fn): abi.DTYPE_E2M1,
    np.dtype(jnp.float8_e8m0fnu): abi.DTYPE_E8M0,
}

INPUT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def dtype_code(dtype) -> int:
    return _DTYPE_CODES[np.dtype(dtype)]


#: The copies a ``layout`` argument asks for, as the quantize family's flag bits.
LAYOUT_FLAGS = {
    "rowwise": abi.QUANTIZE_ROWWISE,
    "colwise": abi.QUANTIZE_COLWISE,
    "both": abi.QUANTIZE_ROWWISE | abi.QUANTIZE_COLWISE,
}
DEFAULT_RHT_SIGN_MASK = abi.DEFAULT_RHT_SIGN_MASK
