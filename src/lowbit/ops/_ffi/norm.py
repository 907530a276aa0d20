"""FFI calls of LayerNorm / RMSNorm (csrc/ffi/norm.cc): forward, optionally writing FP8 copies
of its output (tensor scaling), and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native, abi
from lowbit._native import EMPTY_F32, NO_RESULT_F32, NO_RESULT_U8
from lowbit.ops._ffi.quantize import fused_attrs, fused_results

LAYERNORM, RMSNORM = abi.NORM_LAYERNORM, abi.NORM_RMSNORM  # the `norm_type` attribute


def norm_fwd(
    x,
    gamma,
    beta,
    scale,
    *,
    norm_type: int,
    zero_centered: bool,
    epsilon,
    want_y: bool,
    mode,
    q,
    flags,
    pow2: bool = False,
    eps: float = 0.0,
):
    """x (R, C), gamma (C,), beta (C,) or None; ``q`` None or the FP8 dtype the kernel writes
    (``mode``, layout ``flags``, encode ``scale`` (1,) or None). Returns ``(y, data, scale_inv,
    colwise data, colwise scale_inv, amax, mean, rsigma)``: y (0,) unless ``want_y``, mean (0,)
    for RMSNorm. FP8 block scaling: ``pow2`` / ``eps`` are lowbit.quantize's power_2_scale and
    amax_epsilon."""
    R, C = x.shape
    ln = norm_type == LAYERNORM
    out_types = (
        jax.ShapeDtypeStruct((R, C), x.dtype) if want_y else NO_RESULT_U8,
        *fused_results(q, flags, R, C, mode),
        jax.ShapeDtypeStruct((R,), jnp.float32) if ln else NO_RESULT_F32,
        jax.ShapeDtypeStruct((R,), jnp.float32),
    )
    return _native.ffi_call(
        "norm_fwd",
        out_types,
        x,
        gamma.astype(jnp.float32),
        EMPTY_F32 if beta is None else beta.astype(jnp.float32),
        EMPTY_F32 if scale is None else scale,
        norm_type=np.int32(norm_type),
        zero_centered_gamma=np.int32(bool(zero_centered)),
        epsilon=np.float32(epsilon),
        **fused_attrs(mode, q, pow2, eps),
    )


def norm_bwd(dy, x, mean, rsigma, gamma, *, norm_type: int, zero_centered: bool):
    """dy, x (R, C); mean (LayerNorm) and rsigma of R entries. Returns ``(dx, dgamma, dbeta)``,
    dgamma/dbeta float32, dbeta None for RMSNorm."""
    R, C = x.shape
    ln = norm_type == LAYERNORM
    out_types = (
        jax.ShapeDtypeStruct((R, C), x.dtype),
        jax.ShapeDtypeStruct((C,), jnp.float32),
        jax.ShapeDtypeStruct((C,), jnp.float32) if ln else NO_RESULT_F32,
    )
    dx, dg, db = _native.ffi_call(
        "norm_bwd",
        out_types,
        dy,
        x,
        mean.reshape(R) if ln else EMPTY_F32,
        rsigma.reshape(R),
        gamma.astype(jnp.float32),
        workspace=(R, C),
        norm_type=np.int32(norm_type),
        zero_centered_gamma=np.int32(bool(zero_centered)),
    )
    return dx, dg, (db if ln else None)
