"""FFI calls of the quantization family (csrc/ffi/quantize.cc): quantize (+ dbias), dequantize,
grouped quantize; and the FP8 outputs and attributes that the fused kernels (norm, activation)
share with it. Arrays in, arrays out; the op layer (lowbit.ops.quantize) checks the arguments
and builds the ScaledTensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native, abi
from lowbit._native import NO_RESULT_F32, NO_RESULT_U8
from lowbit.quantization.scaling_modes import ScalingMode, dtype_code, fp8_block_scale_shape

# Bits of the `flags` attribute.
ROWWISE, COLWISE, DBIAS = abi.QUANTIZE_ROWWISE, abi.QUANTIZE_COLWISE, abi.QUANTIZE_DBIAS
STOCHASTIC, RHT, POW2 = abi.QUANTIZE_STOCHASTIC, abi.QUANTIZE_RHT, abi.QUANTIZE_POW2
RHT_SIGN_MASK_BITS = abi.RHT_SIGN_MASK_BITS  # the `rht_sign_mask` attribute's 16 signs
MAX_PARTS = abi.MAX_QUANTIZE_PARTS  # x and at most two further column parts

_F32, _U8 = jnp.float32, jnp.uint8


def _copy_types(mode: ScalingMode, q, x_dtype, r: int, c: int, wanted: bool):
    """Result types of one copy (data, scale_inv) of an (r, c) tensor; (0,) when not wanted."""
    if not wanted:
        return jax.ShapeDtypeStruct((0,), _U8), jax.ShapeDtypeStruct((0,), _F32)
    if mode == ScalingMode.NO_SCALING:
        return jax.ShapeDtypeStruct((r, c), x_dtype), jax.ShapeDtypeStruct((0,), _F32)
    if mode.is_tensor_scaling:
        s = jax.ShapeDtypeStruct((1,), _F32)
    elif mode == ScalingMode.MXFP8_1D_SCALING:
        s = jax.ShapeDtypeStruct((r, c // 32), jnp.float8_e8m0fnu)
    elif mode.is_fp8_block:
        s = jax.ShapeDtypeStruct(fp8_block_scale_shape(mode, r, c), _F32)
    else:  # NVFP4: two E2M1 codes per byte, one E4M3 scale per 16
        return jax.ShapeDtypeStruct((r, c // 2), _U8), jax.ShapeDtypeStruct((r, c // 16), jnp.float8_e4m3fn)
    return jax.ShapeDtypeStruct((r, c), q), s


def quantize(
    x, extra_parts, scale, seed, *, mode: ScalingMode, q, flags: int, rht_sign_mask: int, amax_epsilon
):
    """One quantize call on ``x`` (R, C) and its further column parts ``extra_parts`` (at most
    two arrays like x: the tensor is their concatenation). ``scale`` (encode scale) and ``seed``
    (stochastic rounding) may be None. Returns ``(data, scale_inv, colwise_data, colwise_scale_inv, amax,
    global_scale_inv, dbias)`` as the kernel writes them (2-D; NVFP4 data packed), each (0,)
    where ``flags`` did not ask for it."""
    n_parts = 1 + len(extra_parts)
    rows, cols = x.shape[0], x.shape[1] * n_parts
    row_d, row_s = _copy_types(mode, q, x.dtype, rows, cols, bool(flags & ROWWISE))
    col_d, col_s = _copy_types(mode, q, x.dtype, cols, rows, bool(flags & COLWISE))
    out_types = (
        row_d,
        row_s,
        col_d,
        col_s,
        jax.ShapeDtypeStruct((1,), _F32),
        jax.ShapeDtypeStruct((2,) if mode.is_nvfp4 else (0,), _F32),
        jax.ShapeDtypeStruct((cols,) if flags & DBIAS else (0,), x.dtype),
    )
    parts = tuple(extra_parts[i] if i < len(extra_parts) else _native.EMPTY_F32 for i in range(MAX_PARTS - 1))
    return _native.ffi_call(
        "quantize",
        out_types,
        x,
        *parts,
        _native.EMPTY_F32 if scale is None else scale,
        _native.EMPTY_U32 if seed is None else seed,
        workspace=(int(mode), dtype_code(q), flags, dtype_code(x.dtype), rows, cols),
        mode=np.int32(int(mode)),
        q_dtype=np.int32(dtype_code(q)),
        flags=np.int32(flags),
        rht_sign_mask=np.int32(rht_sign_mask),
        amax_epsilon=np.float32(amax_epsilon),
    )


def dequantize(
    data, scale_inv, global_scale_inv, *, mode: ScalingMode, q, out_dtype, rht: bool, rht_sign_mask: int
):
    """Decodes ``data`` (2-D, NVFP4 packed) with its scales to ``out_dtype`` (rows, cols of the
    unpacked data); ``global_scale_inv`` is NVFP4's (1,) tensor decode scale, else None."""
    r, c = data.shape[0], data.shape[1] * (2 if mode.is_nvfp4 else 1)
    return _native.ffi_call(
        "dequantize",
        jax.ShapeDtypeStruct((r, c), out_dtype),
        data,
        scale_inv,
        _native.EMPTY_F32 if global_scale_inv is None else global_scale_inv,
        mode=np.int32(int(mode)),
        q_dtype=np.int32(dtype_code(q)),
        flags=np.int32(RHT if rht else 0),
        rht_sign_mask=np.int32(rht_sign_mask),
    )


def grouped_quantize(x, group_sizes, scale, *, mode: ScalingMode, q, flags: int, amax_epsilon):
    """One grouped quantize call on ``x`` (M, K) with ``group_sizes`` int32 (G,); ``scale`` (G,)
    or None. Returns ``(data, scale_inv, colwise_data, colwise_scale_inv, amax)``, the copies
    (0,) where ``flags`` did not ask for them; scale layouts as lowbit.grouped_quantize says."""
    (M, K), G = x.shape, group_sizes.shape[0]
    empty = jax.ShapeDtypeStruct((0,), _U8)
    col_s = jax.ShapeDtypeStruct((G,), _F32)
    if mode == ScalingMode.MXFP8_1D_SCALING:
        row_s = jax.ShapeDtypeStruct((M, K // 32), jnp.float8_e8m0fnu)
    elif mode == ScalingMode.BLOCK_1D_SCALING:
        row_s = jax.ShapeDtypeStruct((M * (-(-K // 128)),), _F32)
        col_s = jax.ShapeDtypeStruct((M // 128 + G, K), _F32)
    else:
        row_s = jax.ShapeDtypeStruct((G,), _F32)
    rowwise, colwise = flags & ROWWISE, flags & COLWISE
    out_types = (
        jax.ShapeDtypeStruct((M, K), q) if rowwise else empty,
        row_s if rowwise else jax.ShapeDtypeStruct((0,), _F32),
        jax.ShapeDtypeStruct((K, M), q) if colwise else empty,
        col_s if colwise else jax.ShapeDtypeStruct((0,), _F32),
        jax.ShapeDtypeStruct((G,), _F32),
    )
    return _native.ffi_call(
        "grouped_quantize",
        out_types,
        x,
        group_sizes,
        _native.EMPTY_F32 if scale is None else scale,
        workspace=(int(mode), dtype_code(q), flags, dtype_code(x.dtype), M, K, G),
        mode=np.int32(int(mode)),
        q_dtype=np.int32(dtype_code(q)),
        flags=np.int32(flags),
        amax_epsilon=np.float32(amax_epsilon),
    )


def fused_results(q, flags: int, rows: int, cols: int, mode: ScalingMode = None) -> tuple:
    """Result types of a fused kernel's FP8 outputs of an (rows, cols) tensor: data, scale_inv,
    colwise data, colwise scale_inv, amax; ``q`` None (not fused): all zero-length. FP8 block
    scaling (``mode``): each wanted copy's block scales as lowbit.quantize lays them out."""
    if q is None:
        return (NO_RESULT_U8, NO_RESULT_F32, NO_RESULT_U8, NO_RESULT_F32, NO_RESULT_F32)
    one = jax.ShapeDtypeStruct((1,), _F32)
    row_s = col_s = one
    if mode is not None and mode.is_fp8_block:
        row_s = _copy_types(mode, q, None, rows, cols, bool(flags & ROWWISE))[1]
        col_s = _copy_types(mode, q, None, cols, rows, bool(flags & COLWISE))[1]
    return (
        jax.ShapeDtypeStruct((rows, cols), q) if flags & ROWWISE else NO_RESULT_U8,
        row_s,
        jax.ShapeDtypeStruct((cols, rows), q) if flags & COLWISE else NO_RESULT_U8,
        col_s,
        one,
    )


def fused_attrs(mode: ScalingMode, q, pow2: bool = False, eps: float = 0.0) -> dict:
    """The ``mode`` / ``q_dtype`` / FP8 block scaling attributes of a fused kernel (NO_SCALING
    when ``q`` is None)."""
    block = dict(power_2_scale=np.int32(bool(pow2)), amax_epsilon=np.float32(eps))
    if q is None:
        return dict(mode=np.int32(int(ScalingMode.NO_SCALING)), q_dtype=np.int32(0), **block)
    return dict(mode=np.int32(int(mode)), q_dtype=np.int32(dtype_code(q)), **block)
