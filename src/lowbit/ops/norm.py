"""LayerNorm / RMSNorm over the last axis, optionally writing the output straight to FP8.

Numerics (csrc/include/lowbit/norm.h): statistics and the affine map in float32, the output
rounded once to ``x``'s dtype. With ``quantize`` under tensor scaling the kernel writes the FP8
copies itself, and they equal ``lowbit.quantize(layernorm(x, ...), mode, q_dtype, scale=...,
layout=...)`` bit for bit: the quantized values are the norm output *after* its rounding to
``x``'s dtype. Other scaling modes (MXFP8, NVFP4, NO_SCALING) run the norm, then
``lowbit.quantize`` on its output.

Building blocks for fused modules: :func:`layernorm_fwd` (also returns the statistics the
backward needs) and :func:`layernorm_bwd` (dx, dgamma, dbeta).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native
from lowbit.ops.quantize import _EMPTY_F32, _LAYOUTS, _check_input, _check_mode, _check_q_dtype
from lowbit.ops.quantize import quantize as _quantize
from lowbit.quantize.scaling_modes import INPUT_DTYPES, ScalingMode, dtype_code
from lowbit.quantize.tensor import ScaledTensor, _prod

_native.register_ops("norm_fwd", "norm_bwd")

_NORM_TYPES = {"layernorm": 0, "rmsnorm": 1}
_U8_EMPTY = jax.ShapeDtypeStruct((0,), jnp.uint8)
_F32_EMPTY = jax.ShapeDtypeStruct((0,), jnp.float32)


# ------------------------------------------------------------------------------------------------
# quantize specs and fused ScaledTensors (shared with lowbit.ops.activation)
# ------------------------------------------------------------------------------------------------
class QuantizeSpec(NamedTuple):
    """What a fused op quantizes its output to: ``(scaling_mode, q_dtype, scale[, layout])``.

    ``scale`` is the float32 encode scale for DELAYED_TENSOR_SCALING and None otherwise;
    ``layout`` is "rowwise", "colwise" or "both" (default: both, the copies a GEMM's forward and
    backward need)."""

    scaling_mode: Any
    q_dtype: Any = None
    scale: Any = None
    layout: str = "both"


def parse_quantize_spec(quantize, x_dtype, name: str = "quantize") -> Optional[QuantizeSpec]:
    """Validates a quantize spec; returns a QuantizeSpec with checked mode, dtype and scale."""
    if quantize is None:
        return None
    if isinstance(quantize, ScalingMode):
        quantize = (quantize,)
    if not isinstance(quantize, (tuple, list)) or not 1 <= len(quantize) <= 4:
        raise TypeError(f"{name} must be None or a (scaling_mode, q_dtype, scale[, layout]) tuple, got {quantize!r}")
    spec = QuantizeSpec(*quantize)
    mode = _check_mode(spec.scaling_mode)
    q = _check_q_dtype(mode, spec.q_dtype, x_dtype)
    if spec.layout not in _LAYOUTS:
        raise ValueError(f"{name}: layout must be one of {sorted(_LAYOUTS)}, got {spec.layout!r}")
    scale = spec.scale
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        if scale is None:
            raise ValueError(f"{name}: DELAYED_TENSOR_SCALING needs a scale (float32 scalar)")
        scale = jnp.asarray(scale)
        if scale.size != 1 or np.dtype(scale.dtype) != np.float32:
            raise TypeError(f"{name}: scale must be a float32 scalar or shape (1,), got {scale.dtype} {scale.shape}")
        scale = scale.reshape(1)
    elif scale is not None:
        raise ValueError(f"{name}: scale is only used with DELAYED_TENSOR_SCALING, not {mode.name}")
    return QuantizeSpec(mode, q, scale, spec.layout)


def fused_outputs(spec: QuantizeSpec, rows: int, cols: int):
    """Result types of the FP8 outputs of a fused kernel: data, scale_inv, colwise data,
    colwise scale_inv, amax (empty where not requested)."""
    row = spec.layout in ("rowwise", "both")
    col = spec.layout in ("colwise", "both")
    one = jax.ShapeDtypeStruct((1,), jnp.float32)
    return (
        jax.ShapeDtypeStruct((rows, cols), spec.q_dtype) if row else _U8_EMPTY,
        one,
        jax.ShapeDtypeStruct((cols, rows), spec.q_dtype) if col else _U8_EMPTY,
        one,
        one,
    )


def fused_scaled_tensor(spec: QuantizeSpec, shape, dq_dtype, data, s_inv, cw, cw_s_inv, amax) -> ScaledTensor:
    """The ScaledTensor lowbit.quantize(..., flatten_axis=-1) would build from these outputs."""
    shape = tuple(shape)
    axis = len(shape) - 1
    row = spec.layout in ("rowwise", "both")
    col = spec.layout in ("colwise", "both")
    return ScaledTensor(
        data=data.reshape(shape) if row else None,
        scale_inv=s_inv if row else None,
        colwise_data=cw.reshape(shape[axis:] + shape[:axis]) if col else None,
        colwise_scale_inv=cw_s_inv if col else None,
        amax=amax,
        global_scale_inv=None,
        scaling_mode=spec.scaling_mode,
        q_dtype=np.dtype(spec.q_dtype),
        dq_dtype=np.dtype(dq_dtype),
        shape=shape,
        flatten_axis=axis,
    )


def _decode_scale(s_inv, gsi, mode: ScalingMode, rows: int, cols: int):
    """Per-element decode scale of one copy, (rows, cols) float32 (or a scalar)."""
    if mode == ScalingMode.NO_SCALING:
        return jnp.float32(1.0)
    if mode.is_tensor_scaling:
        return s_inv[0]
    s = jnp.repeat(s_inv.astype(jnp.float32), mode.block_size, axis=1)
    return s * gsi if mode.is_nvfp4 else s


def straight_through_grad(ct: ScaledTensor, res: ScaledTensor):
    """Cotangent of the value a ScaledTensor stands for, from the cotangent of its arrays.

    Quantization is taken as the identity on the dequantized value (straight-through), so the
    cotangent of a copy's data is divided by that copy's decode scale (the inverse of the chain
    rule through ``decode(data) * scale_inv``); both copies' contributions are summed. ``res``
    holds the primal's scales (its data fields may be None)."""
    mode, rows, cols = res.scaling_mode, res.rows, res.cols
    g = jnp.zeros((rows, cols), jnp.float32)
    gsi = res.global_scale_inv

    def part(d, s_inv, k, r, c):
        if d is None:
            return None
        scale = _decode_scale(s_inv, None if gsi is None else gsi[k], mode, r, c)
        d = d.astype(jnp.float32).reshape(r, c)
        return jnp.where(scale == 0, 0.0, d / jnp.where(scale == 0, 1.0, scale))

    row = part(ct.data, res.scale_inv, 0, rows, cols)
    col = part(ct.colwise_data, res.colwise_scale_inv, 1, cols, rows)
    if row is not None:
        g = g + row
    if col is not None:
        g = g + col.T
    return g.reshape(res.shape)


def scales_only(qt: ScaledTensor) -> ScaledTensor:
    """The residual the straight-through backward keeps: scales, no data."""
    return dataclasses.replace(qt, data=None, colwise_data=None)


# ------------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------------
def _check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon):
    x = _check_input(x, "x")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last axis to normalize over, got shape {tuple(x.shape)}")
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    C = x.shape[-1]
    gamma = _check_input(gamma, "gamma")
    if tuple(gamma.shape) != (C,):
        raise ValueError(f"gamma must have shape ({C},) (x's last axis), got {tuple(gamma.shape)}")
    if beta is not None:
        if norm_type == "rmsnorm":
            raise ValueError("beta must be None for norm_type='rmsnorm' (RMSNorm has no bias)")
        beta = _check_input(beta, "beta")
        if tuple(beta.shape) != (C,):
            raise ValueError(f"beta must have shape ({C},) (x's last axis), got {tuple(beta.shape)}")
    if not isinstance(zero_centered_gamma, (bool, np.bool_)):
        raise TypeError(f"zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
    if isinstance(epsilon, jax.Array) or not isinstance(epsilon, (int, float, np.floating)) or not epsilon >= 0:
        raise ValueError(f"epsilon must be a non-negative Python float, got {epsilon!r}")
    return x, gamma, beta


# ------------------------------------------------------------------------------------------------
# FFI calls
# ------------------------------------------------------------------------------------------------
def _fwd_call(x2, gamma, beta, spec, norm_type, zc, eps, want_y):
    R, C = x2.shape
    fused = spec is not None and spec.scaling_mode.is_tensor_scaling
    ln = norm_type == "layernorm"
    fp8 = fused_outputs(spec, R, C) if fused else (_U8_EMPTY, _F32_EMPTY, _U8_EMPTY, _F32_EMPTY, _F32_EMPTY)
    out_types = (
        jax.ShapeDtypeStruct((R, C), x2.dtype) if want_y else _U8_EMPTY,
        *fp8,
        jax.ShapeDtypeStruct((R,), jnp.float32) if ln else _F32_EMPTY,
        jax.ShapeDtypeStruct((R,), jnp.float32),
    )
    _native.ensure_loaded()
    call = jax.ffi.ffi_call("lowbit_norm_fwd", out_types, vmap_method="sequential")
    scale = spec.scale if (fused and spec.scale is not None) else _EMPTY_F32
    mode = int(spec.scaling_mode) if fused else int(ScalingMode.NO_SCALING)
    q = dtype_code(spec.q_dtype) if fused else 0
    return call(
        x2, gamma.astype(jnp.float32), _EMPTY_F32 if beta is None else beta.astype(jnp.float32), scale,
        norm_type=np.int32(_NORM_TYPES[norm_type]), zero_centered_gamma=np.int32(bool(zc)),
        epsilon=np.float32(eps), mode=np.int32(mode), q_dtype=np.int32(q))


def _bwd_call(dy2, x2, mean, rsigma, gamma, norm_type, zc):
    R, C = x2.shape
    ln = norm_type == "layernorm"
    ws = _native.workspace_bytes("lowbit_norm_bwd_workspace_bytes", R, C)
    _native.ensure_loaded()
    out_types = (
        jax.ShapeDtypeStruct((R, C), x2.dtype),
        jax.ShapeDtypeStruct((C,), jnp.float32),
        jax.ShapeDtypeStruct((C,), jnp.float32) if ln else _F32_EMPTY,
        jax.ShapeDtypeStruct((ws,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("lowbit_norm_bwd", out_types, vmap_method="sequential")
    dx, dg, db, _ = call(
        dy2, x2, mean.reshape(R) if ln else _EMPTY_F32, rsigma.reshape(R), gamma.astype(jnp.float32),
        norm_type=np.int32(_NORM_TYPES[norm_type]), zero_centered_gamma=np.int32(bool(zc)))
    return dx, dg, (db if ln else None)


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def layernorm_fwd(x, gamma, beta=None, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                  epsilon: float = 1e-6, quantize=None, return_norm_output: bool = False):
    """Forward building block: returns ``(out, norm_output, mean, rsigma)``.

    ``out`` is the normalized ``x`` in its dtype, or a ScaledTensor when ``quantize`` is given;
    ``norm_output`` is the unquantized output when ``return_norm_output`` (else None); ``mean``
    (None for rmsnorm) and ``rsigma`` are float32 of shape ``x.shape[:-1]``."""
    x, gamma, beta = _check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    spec = parse_quantize_spec(quantize, x.dtype)
    return _fwd(x, gamma, beta, spec, norm_type, zero_centered_gamma, epsilon, return_norm_output)


def _fwd(x, gamma, beta, spec, norm_type, zc, eps, return_norm_output):
    shape = tuple(x.shape)
    C = shape[-1]
    x2 = x.reshape(_prod(shape[:-1]), C)
    fused = spec is not None and spec.scaling_mode.is_tensor_scaling
    want_y = spec is None or not fused or return_norm_output
    y, data, s_inv, cw, cw_s_inv, amax, mean, rsigma = _fwd_call(x2, gamma, beta, spec, norm_type, zc, eps, want_y)
    y = y.reshape(shape) if want_y else None
    mean = mean.reshape(shape[:-1]) if norm_type == "layernorm" else None
    rsigma = rsigma.reshape(shape[:-1])
    if spec is None:
        out = y
    elif fused:
        out = fused_scaled_tensor(spec, shape, x.dtype, data, s_inv, cw, cw_s_inv, amax)
    else:
        out = _quantize(y, spec.scaling_mode, spec.q_dtype, scale=spec.scale, layout=spec.layout)
    return out, (y if return_norm_output else None), mean, rsigma


def layernorm_bwd(dy, x, mean, rsigma, gamma, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False):
    """Backward building block: returns ``(dx, dgamma, dbeta)`` (dbeta None for rmsnorm);
    ``dy`` and ``dx`` have ``x``'s dtype, dgamma/dbeta ``gamma``'s."""
    x = _check_input(x, "x")
    dy = _check_input(dy, "dy")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise TypeError(f"dy must match x ({x.dtype} {tuple(x.shape)}), got {dy.dtype} {tuple(dy.shape)}")
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    gamma = _check_input(gamma, "gamma")
    if tuple(gamma.shape) != (x.shape[-1],):
        raise ValueError(f"gamma must have shape ({x.shape[-1]},) (x's last axis), got {tuple(gamma.shape)}")
    R = _prod(x.shape[:-1])
    if norm_type == "layernorm" and (mean is None or _prod(jnp.shape(mean)) != R):
        raise ValueError(f"mean must have {R} entries (x.shape[:-1]) for layernorm")
    if _prod(jnp.shape(rsigma)) != R:
        raise ValueError(f"rsigma must have {R} entries (x.shape[:-1])")
    C = x.shape[-1]
    dx, dg, db = _bwd_call(dy.reshape(R, C), x.reshape(R, C), mean, rsigma, gamma, norm_type, zero_centered_gamma)
    return dx.reshape(x.shape), dg.astype(gamma.dtype), (None if db is None else db.astype(gamma.dtype))


def layernorm(x, gamma, beta=None, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False,
              epsilon: float = 1e-6, quantize=None):
    """LayerNorm or RMSNorm of ``x`` over its last axis, differentiable (custom VJP).

    Args:
      x: float32/bfloat16/float16 array (..., C).
      gamma: scale, shape (C,); with ``zero_centered_gamma`` the scale applied is ``gamma + 1``.
      beta: bias, shape (C,), or None; must be None for rmsnorm.
      norm_type: "layernorm" or "rmsnorm".
      epsilon: added to the variance (mean square for rmsnorm) before the square root.
      quantize: None (returns an array of x's dtype), or ``(scaling_mode, q_dtype, scale[,
        layout])``: returns a :class:`lowbit.ScaledTensor` of the output, equal to
        ``lowbit.quantize`` of the unquantized output (fused into the kernel for tensor
        scaling). Its cotangent is taken straight through the quantization.
    """
    x, gamma, beta = _check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    spec = parse_quantize_spec(quantize, x.dtype)
    scale = None if spec is None else spec.scale
    has_beta = beta is not None
    beta_arg = beta if has_beta else jnp.zeros((0,), gamma.dtype)

    def run(x, gamma, beta_arg, scale):
        s = None if spec is None else spec._replace(scale=scale)
        return _fwd(x, gamma, beta_arg if has_beta else None, s, norm_type, zero_centered_gamma, epsilon, False)

    @jax.custom_vjp
    def f(x, gamma, beta_arg, scale):
        return run(x, gamma, beta_arg, scale)[0]

    def f_fwd(x, gamma, beta_arg, scale):
        out, _, mean, rsigma = run(x, gamma, beta_arg, scale)
        res_q = scales_only(out) if isinstance(out, ScaledTensor) else None
        return out, (x, gamma, mean, rsigma, res_q, scale)

    def f_bwd(res, ct):
        x, gamma, mean, rsigma, res_q, scale = res
        dy = ct if res_q is None else straight_through_grad(ct, res_q)
        dx, dg, db = layernorm_bwd(dy.astype(x.dtype), x, mean, rsigma, gamma, norm_type=norm_type,
                                   zero_centered_gamma=zero_centered_gamma)
        db = db.astype(gamma.dtype) if has_beta else jnp.zeros((0,), gamma.dtype)
        return dx, dg, db, (None if scale is None else jnp.zeros_like(scale))

    f.defvjp(f_fwd, f_bwd)
    return f(x, gamma, beta_arg, scale)


__all__ = ["QuantizeSpec", "layernorm", "layernorm_bwd", "layernorm_fwd"]
