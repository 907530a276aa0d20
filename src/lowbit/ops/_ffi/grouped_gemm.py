"""FFI call of the grouped GEMM (csrc/ffi/grouped_gemm.cc) in one of the two shapes of
csrc/include/lowbit/grouped_gemm.h: ragged M (row groups of A, one B per group) or ragged K
(contraction over each group's rows, one output per group)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native, abi
from lowbit._native import EMPTY_F32
from lowbit.quantization.scaling_modes import dtype_code

RAGGED_M, RAGGED_K = abi.GROUPED_RAGGED_M, abi.GROUPED_RAGGED_K  # the `mode` attribute


def grouped_gemm(
    mode: int,
    a,
    b,
    group_sizes,
    a_scale_inv,
    b_scale_inv,
    *,
    m: int,
    n: int,
    k: int,
    lda: int,
    ldb: int,
    bgs: int = 0,
    a_kmajor: bool,
    b_kmajor: bool,
    fast_accum: bool = False,
    b_block_n: int = 0,
):
    """One grouped GEMM, BF16 output: (m, n) for RAGGED_M, (G, m, n) for RAGGED_K. ``lda`` /
    ``ldb``: row strides, ``bgs``: B's group stride (elements). ``b_block_n``: 0 = per-group
    scales (None for BF16); 1 / 128 = FP8 block scales, B's blocks 1x128 / 128x128."""
    G = group_sizes.shape[0]
    flags = (
        (abi.GROUPED_A_KMAJOR if a_kmajor else 0)
        | (abi.GROUPED_B_KMAJOR if b_kmajor else 0)
        | (abi.GROUPED_FAST_ACCUM if fast_accum else 0)
        | (abi.GROUPED_BLOCK_SCALED if b_block_n else 0)
        | (abi.GROUPED_BLOCK_N128 if b_block_n == 128 else 0)
    )
    out_shape = (m, n) if mode == RAGGED_M else (G, m, n)
    return _native.ffi_call(
        "grouped_gemm",
        jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
        a,
        b,
        group_sizes,
        EMPTY_F32 if a_scale_inv is None else a_scale_inv,
        EMPTY_F32 if b_scale_inv is None else b_scale_inv,
        workspace=(mode, dtype_code(a.dtype), dtype_code(b.dtype), flags, m, n, k, G),
        mode=np.int32(mode),
        m=np.int64(m),
        n=np.int64(n),
        k=np.int64(k),
        lda=np.int64(lda),
        ldb=np.int64(ldb),
        b_group_stride=np.int64(bgs),
        flags=np.int32(flags),
    )
