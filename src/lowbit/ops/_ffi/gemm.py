"""FFI call of the GEMM family (csrc/ffi/gemm.cc): out (M, N) = a (M, K) . b (N, K)^T."""

from __future__ import annotations

import jax
import numpy as np

from lowbit import _native, abi
from lowbit._native import EMPTY_F32
from lowbit.quantization.scaling_modes import dtype_code

# Bits of the `flags` attribute: fast accumulation, and each operand's FP8 block scaling (none,
# 1x128 blocks, 128x128 tiles) as a field at its shift.
FAST_ACCUM, A_BLOCK_SHIFT, B_BLOCK_SHIFT = abi.GEMM_FAST_ACCUM, abi.GEMM_A_BLOCK_SHIFT, abi.GEMM_B_BLOCK_SHIFT
BLOCK_1D, BLOCK_2D = abi.GEMM_BLOCK_1D, abi.GEMM_BLOCK_2D


def gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, *, fast_accum: bool, blocks=(0, 0), parts: int = 1):
    """One GEMM call: a (M, K), b (N, K) -> (M, N), or with ``parts`` > 1 the tuple of its
    ``parts`` column blocks (M, N / parts), each computed in place. Scales and bias may be None.
    ``blocks``: the operands' FP8 block scaling (0 per-tensor, BLOCK_1D or BLOCK_2D)."""
    M, N = a.shape[0], b.shape[0]
    flags = (FAST_ACCUM if fast_accum else 0) | (blocks[0] << A_BLOCK_SHIFT) | (blocks[1] << B_BLOCK_SHIFT)
    out = jax.ShapeDtypeStruct((M, N // parts), out_dtype)
    return _native.ffi_call(
        "gemm",
        out if parts == 1 else (out,) * parts,
        a,
        b,
        EMPTY_F32 if a_scale_inv is None else a_scale_inv,
        EMPTY_F32 if b_scale_inv is None else b_scale_inv,
        EMPTY_F32 if bias is None else bias,
        workspace=(),
        flags=np.int32(flags),
    )


def block_bias_fused(a_dtype, b_dtype, blocks, out_dtype) -> bool:
    """Whether the block-scaled GEMM of these dtypes and ``blocks`` adds a bias in its epilogue
    (rounding once), so the caller passes it instead of adding it to an F32 product: the CPU kernel
    always; on CUDA lowbit's CUTLASS kernels where one exists (csrc/ffi/gemm.cc)."""
    libs = _native.ensure_loaded()
    fn = getattr(libs["cuda"] or libs["cpu"], "lowbit_gemm_block_bias", None)
    codes = (dtype_code(a_dtype), dtype_code(b_dtype), blocks[0], blocks[1], dtype_code(out_dtype))
    return fn is not None and bool(fn(*codes))
