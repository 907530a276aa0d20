"""Trace-time checks: of a ScaledTensor's fields against its scaling mode, and of the arguments
of the ops that quantize (quantize, the fused norm and activation outputs, dense, ...).

The kernels trust the buffers they are given: a scale array that is too small would be read past
its end. Every op that takes a ScaledTensor calls :func:`validate` (shapes and dtypes are static,
so this costs nothing under jit) and gets an error naming the field and what it should be.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.quantization.scaling_modes import (
    FP8_DTYPES,
    INPUT_DTYPES,
    LAYOUT_FLAGS,
    ScalingMode,
    fp8_block_scale_shape,
)
from lowbit.quantization.tensor import ScaledTensor, prod

_F32 = np.dtype(jnp.float32)
_E2M1 = np.dtype(jnp.float4_e2m1fn)
_SCALE_DTYPES = {
    ScalingMode.MXFP8_1D_SCALING: np.dtype(jnp.float8_e8m0fnu),
    ScalingMode.NVFP4_1D_SCALING: np.dtype(jnp.float8_e4m3fn),
    ScalingMode.NVFP4_2D_SCALING: np.dtype(jnp.float8_e4m3fn),
}


def _desc(a) -> str:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        return type(a).__name__
    return f"{np.dtype(a.dtype).name} {tuple(a.shape)}"


def _expect(op: str, field: str, a, shape: tuple, dtype: np.dtype, why: str) -> None:
    if a is None:
        raise ValueError(f"{op}: {field} is None; {why} needs {dtype.name} of shape {shape}")
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{op}: {field} must be an array ({dtype.name} {shape}), got {type(a).__name__}")
    if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != dtype:
        raise ValueError(f"{op}: {field} must be {dtype.name} of shape {shape} ({why}), got {_desc(a)}")


def _check_static(op: str, name: str, qt: ScaledTensor) -> ScalingMode:
    if not isinstance(qt, ScaledTensor):
        raise TypeError(f"{op}: {name} must be a lowbit.ScaledTensor, got {type(qt).__name__}")
    try:
        mode = ScalingMode(qt.scaling_mode)
    except ValueError:
        raise ValueError(
            f"{op}: {name}.scaling_mode must be a lowbit.ScalingMode, got {qt.scaling_mode!r}"
        ) from None
    shape = qt.shape
    if not isinstance(shape, tuple) or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        raise ValueError(f"{op}: {name}.shape must be a tuple of non-negative ints, got {shape!r}")
    ax = qt.flatten_axis
    if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)) or not 0 <= ax < len(shape):
        raise ValueError(
            f"{op}: {name}.flatten_axis must be an int in [0, {len(shape)}) for shape {shape}, got {ax!r}"
        )
    return mode


def _q_dtype(op: str, name: str, qt: ScaledTensor, mode: ScalingMode) -> np.dtype:
    try:
        q = np.dtype(qt.q_dtype)
    except TypeError:
        raise TypeError(f"{op}: {name}.q_dtype must be a dtype, got {qt.q_dtype!r}") from None
    ok = (
        q in INPUT_DTYPES
        if mode == ScalingMode.NO_SCALING
        else q == _E2M1
        if mode.is_nvfp4
        else q in FP8_DTYPES
    )
    if not ok:
        raise TypeError(f"{op}: {name}.q_dtype {q.name} does not fit {mode.name}")
    return q


def validate(qt: ScaledTensor, layout: str, op: str, name: str = "qt", num_groups: int | None = None) -> None:
    """Checks the ``layout`` copy of ``qt`` (data, scale_inv, global_scale_inv) against its mode.

    ``num_groups``: a grouped_quantize result, whose tensor-scaling scales are ``(G,)`` (BLOCK_1D:
    the grouped layouts of :func:`lowbit.grouped_quantize`).
    Raises TypeError/ValueError naming ``op``, the field and the expected shape and dtype.
    """
    mode = _check_static(op, name, qt)
    q = _q_dtype(op, name, qt, mode)
    colwise = layout == "colwise"
    shape, ax = qt.shape, qt.flatten_axis
    rows, cols = prod(shape[:ax]), prod(shape[ax:])
    r, c = (cols, rows) if colwise else (rows, cols)
    prefix = "colwise_" if colwise else ""
    data_field, scale_field = f"{name}.{prefix}data", f"{name}.{prefix}scale_inv"
    data = qt.colwise_data if colwise else qt.data
    s_inv = qt.colwise_scale_inv if colwise else qt.scale_inv
    if data is None:
        raise ValueError(
            f"{op}: {data_field} is None: {name} has no {layout} copy; "
            f"quantize with layout='{layout}' or 'both'"
        )
    data_shape = shape[ax:] + shape[:ax] if colwise else shape
    _expect(
        op, data_field, data, data_shape, q, f"the {layout} copy of a {mode.name} tensor of shape {shape}"
    )
    if mode == ScalingMode.NO_SCALING:
        return
    b = mode.block_size
    if mode.is_tensor_scaling:
        s_shape = (num_groups,) if num_groups is not None else (1,)
        why = "the decode scales, one per group" if num_groups is not None else "the decode scale"
        _expect(op, scale_field, s_inv, s_shape, _F32, why)
        return
    if mode.is_fp8_block and num_groups is not None:  # grouped_quantize's BLOCK_1D layouts
        s_shape = (rows // 128 + num_groups, cols) if colwise else (rows * -(-cols // 128),)
        _expect(op, scale_field, s_inv, s_shape, _F32, f"the grouped 1x128 block scales of the {layout} copy")
        return
    if mode.is_fp8_block:
        blk = "1x128 block" if mode == ScalingMode.BLOCK_1D_SCALING else "128x128 tile"
        _expect(
            op,
            scale_field,
            s_inv,
            fp8_block_scale_shape(mode, r, c),
            _F32,
            f"one scale per {blk} of the ({r}, {c}) {layout} copy, in cuBLASLt's layout",
        )
        return
    if c % b:
        raise ValueError(
            f"{op}: {name}'s {layout} copy has {c} columns, not a multiple of {mode.name}'s block of {b}"
        )
    _expect(
        op,
        scale_field,
        s_inv,
        (r, c // b),
        _SCALE_DTYPES[mode],
        f"one scale per {b} elements of the ({r}, {c}) {layout} copy",
    )
    if mode.is_nvfp4:
        _expect(
            op,
            f"{name}.global_scale_inv",
            qt.global_scale_inv,
            (2,),
            _F32,
            "NVFP4's rowwise and colwise tensor decode scales",
        )


def check_scale_value(scale, name: str):
    """An encode scale that is 0, negative, NaN or Inf makes every code 0 or NaN. A concrete
    value is refused here; a traced one (unknown until run) is replaced by 1, the initial
    DelayedScaling scale, so the step stays finite and records its amax (docs/numerics.md)."""
    scale = jnp.asarray(scale)
    if not isinstance(scale, jax.core.Tracer):
        v = np.asarray(scale, np.float64)
        bad = ~np.isfinite(v) | (v <= 0)
        if bad.any():
            raise ValueError(
                f"{name} must be positive and finite (an encode scale), got "
                f"{v.reshape(-1)[bad.reshape(-1)][:4].tolist()}"
            )
        return scale
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, jnp.ones_like(scale))


def as_array(a, name: str):
    """``a`` as a JAX array; anything that is not one (None, a string) is refused naming ``name``."""
    if hasattr(a, "dtype") and hasattr(a, "shape"):
        return a
    try:
        if a is None or isinstance(a, (str, bytes)):
            raise TypeError
        return jnp.asarray(a)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array, got {type(a).__name__} {a!r:.40}") from None


def as_dtype(d, name: str) -> np.dtype:
    """``np.dtype(d)``, refused naming ``name`` when ``d`` is no dtype."""
    try:
        if d is None:
            raise TypeError
        return np.dtype(d)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a dtype such as jnp.float8_e4m3fn, got {d!r:.40}") from None


def as_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r:.40}")
    return int(v)


# Argument checks of the ops that quantize.


def check_input(x, name: str = "x") -> jax.Array:
    """x as an array of an input dtype (float32, bfloat16, float16); ``name`` prefixes the error."""
    x = as_array(x, name)
    if np.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {np.dtype(x.dtype).name}")
    return x


def check_scaling_mode(scaling_mode) -> ScalingMode:
    try:
        return ScalingMode(scaling_mode)
    except ValueError:
        raise ValueError(
            f"scaling_mode must be a lowbit.ScalingMode, got {scaling_mode!r}; "
            f"choose one of {[m.name for m in ScalingMode]}"
        ) from None


def check_q_dtype(mode: ScalingMode, q_dtype, x_dtype) -> np.dtype:
    """The quantized dtype (mode's default when None); x's dtype for NO_SCALING."""
    if mode == ScalingMode.NO_SCALING:
        return np.dtype(x_dtype)
    q = as_dtype(q_dtype if q_dtype is not None else mode.default_q_dtype, "q_dtype")
    if mode.is_nvfp4:
        if q != np.dtype(jnp.float4_e2m1fn):
            raise TypeError(f"q_dtype must be float4_e2m1fn for {mode.name}, got {q.name}")
    elif q not in FP8_DTYPES:
        raise TypeError(f"q_dtype must be float8_e4m3fn or float8_e5m2 for {mode.name}, got {q.name}")
    return q


def check_layout(layout: str, prefix: str = "") -> int:
    """The FFI flag bits of a layout name."""
    if layout not in LAYOUT_FLAGS:
        raise ValueError(f"{prefix}layout must be one of {sorted(LAYOUT_FLAGS)}, got {layout!r}")
    return LAYOUT_FLAGS[layout]


def check_tensor_scale(mode: ScalingMode, scale, prefix: str = "") -> Optional[jax.Array]:
    """The encode scale as float32 (1,): required for DELAYED_TENSOR_SCALING, refused otherwise."""
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        if scale is None:
            raise ValueError(f"{prefix}scale is required for DELAYED_TENSOR_SCALING (a float32 scalar)")
        scale = as_array(scale, f"{prefix}scale")
        if scale.size != 1 or np.dtype(scale.dtype) != np.float32:
            raise TypeError(
                f"{prefix}scale must be a float32 scalar or shape (1,), got {scale.dtype} {scale.shape}"
            )
        return check_scale_value(scale.reshape(1), f"{prefix}scale")
    if scale is not None:
        raise ValueError(f"{prefix}scale is only used with DELAYED_TENSOR_SCALING, not {mode.name}")
    return None


def check_flatten_axis(flatten_axis: int, ndim: int) -> int:
    flatten_axis = as_int(flatten_axis, "flatten_axis")
    if ndim < 1:
        raise ValueError("x must have at least one dimension, got a rank-0 array (shape ())")
    axis = flatten_axis + ndim if flatten_axis < 0 else flatten_axis
    if not 0 <= axis < ndim:
        raise ValueError(f"flatten_axis={flatten_axis} is out of range for an array of rank {ndim}")
    return axis


def check_block_multiple(mode: ScalingMode, shape, axis: int, rowwise: bool, colwise: bool) -> None:
    if mode.is_fp8_block:
        return  # any shape: the last block of a row (or tile) may be partial
    b = mode.block_size
    rows, cols = prod(shape[:axis]), prod(shape[axis:])
    if rowwise and cols % b:
        raise ValueError(
            f"x: the contraction axis (dims {tuple(range(axis, len(shape)))} of shape {tuple(shape)}, "
            f"size {cols}) must be a multiple of {b} for {mode.name}"
        )
    if (colwise or mode == ScalingMode.NVFP4_2D_SCALING) and rows % (16 if mode.is_nvfp4 else b):
        raise ValueError(
            f"x: the leading axes (dims {tuple(range(axis))} of shape {tuple(shape)}, size {rows}) "
            f"must be a multiple of {16 if mode.is_nvfp4 else b} for the colwise copy of {mode.name}"
        )
    if mode == ScalingMode.NVFP4_2D_SCALING and cols % 16:
        raise ValueError(
            f"x: size {cols} of the contraction axis must be a multiple of 16 for NVFP4_2D_SCALING"
        )


def check_block_options(mode: ScalingMode, power_2_scale, amax_epsilon) -> float:
    """power_2_scale / amax_epsilon: FP8 block scaling's options; the epsilon as a float."""
    if not isinstance(power_2_scale, (bool, np.bool_)):
        raise TypeError(f"power_2_scale must be a bool, got {power_2_scale!r}")
    if isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float, np.floating, np.integer)):
        raise TypeError(f"amax_epsilon must be a Python float, got {type(amax_epsilon).__name__}")
    eps = float(np.float32(amax_epsilon))
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon!r}")
    if not mode.is_fp8_block and (power_2_scale or eps != 0.0):
        raise ValueError(
            f"power_2_scale and amax_epsilon are only used with BLOCK_1D/2D_SCALING, not {mode.name}"
        )
    return eps
