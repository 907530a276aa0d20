"""Quantized outputs of fused kernels (LayerNorm, activations): the quantize spec an op takes,
the FP8 results and attributes the kernels share, the ScaledTensor built from them, and the
straight-through gradient of such an output."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops.quantize import quantize, quantize_dbias
from lowbit.quantization.checks import check_layout, check_q_dtype, check_scaling_mode, check_tensor_scale
from lowbit.quantization.scaling_modes import LAYOUT_FLAGS, ScalingMode
from lowbit.quantization.tensor import ScaledTensor


class QuantizeSpec(NamedTuple):
    """What a fused op quantizes its output to: ``(scaling_mode, q_dtype, scale[, layout])``.

    ``scale`` is the float32 encode scale for DELAYED_TENSOR_SCALING and None otherwise;
    ``layout`` is "rowwise", "colwise" or "both" (default: both, the copies a GEMM's forward and
    backward need); ``power_2_scale`` / ``amax_epsilon``: FP8 block scaling's options (the kernel
    quantizes with them itself, as lowbit.quantize would)."""

    scaling_mode: Any
    q_dtype: Any = None
    scale: Any = None
    layout: str = "both"
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


#: What a ``quantize`` argument may be: a spec tuple, or a bare ScalingMode (no scale needed).
QuantizeArg = Union[QuantizeSpec, ScalingMode, tuple]


def parse_quantize_spec(
    quantize: Optional[QuantizeArg], x_dtype, name: str = "quantize"
) -> Optional[QuantizeSpec]:
    """Validates a quantize spec; returns a QuantizeSpec with checked mode, dtype and scale."""
    if quantize is None:
        return None
    if isinstance(quantize, ScalingMode):
        quantize = (quantize,)
    if not isinstance(quantize, (tuple, list)) or not 1 <= len(quantize) <= 6:
        raise TypeError(
            f"{name} must be None or a (scaling_mode, q_dtype, scale[, layout[, power_2_scale[, "
            f"amax_epsilon]]]) tuple, got {quantize!r}"
        )
    spec = QuantizeSpec(*quantize)
    mode = check_scaling_mode(spec.scaling_mode)
    q = check_q_dtype(mode, spec.q_dtype, x_dtype)
    check_layout(spec.layout, f"{name}: ")
    scale = check_tensor_scale(mode, spec.scale, f"{name}: ")
    if not mode.is_fp8_block and (spec.power_2_scale or spec.amax_epsilon):
        raise ValueError(f"{name}: power_2_scale and amax_epsilon are only used with BLOCK_1D/2D_SCALING")
    return QuantizeSpec(mode, q, scale, spec.layout, bool(spec.power_2_scale), float(spec.amax_epsilon))


def _env_switch(name: str, default: bool = True) -> bool:
    """An on/off environment switch, ``default`` when unset (read at trace time)."""
    v = os.environ.get(name, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return default if v == "" else v == "1"


def block_fusion_enabled() -> bool:
    """Whether the norm and activation kernels quantize FP8 block scaling (Float8BlockScaling)
    themselves: on unless the environment sets ``LOWBIT_BLOCK_FUSION=0`` (read at trace time;
    the unfused path, kernel then lowbit.quantize, for before/after measurements)."""
    return _env_switch("LOWBIT_BLOCK_FUSION")


def block_dbias_fusion_enabled() -> bool:
    """Whether the activation gradient kernel also sums dbias when it writes the block-scaled
    copies (per 128-row tile inside the block cast): on unless ``LOWBIT_BLOCK_DBIAS_FUSION=0``
    (then that one case runs the kernel, then lowbit.quantize_dbias; the forwards stay fused).
    Checked on an H200 in session 12: 2x faster than the unfused pair. Implies nothing when
    :func:`block_fusion_enabled` is off."""
    return _env_switch("LOWBIT_BLOCK_DBIAS_FUSION")


def is_fused(spec: Optional[QuantizeSpec], rows: int, cols: int) -> bool:
    """Whether the kernel quantizes its (rows, cols) output itself: tensor scaling always; FP8
    block scaling for whole 16x16 tiles (the CUDA block cast's condition; the CPU kernel takes
    the same), unless turned off (:func:`block_fusion_enabled`). Other modes quantize its output."""
    if spec is None:
        return False
    mode = spec.scaling_mode
    if mode.is_tensor_scaling:
        return True
    return mode.is_fp8_block and rows % 16 == 0 and cols % 16 == 0 and block_fusion_enabled()


def kernel_quant(spec: Optional[QuantizeSpec], fused: bool) -> dict:
    """What a fused kernel's FFI call (lowbit.ops._ffi.norm / activation) writes: the encode
    ``scale`` (None for current scaling), ``mode``, ``q`` (the FP8 dtype; None when not
    ``fused``: see :func:`is_fused`), the layout ``flags`` and the block scales' ``pow2`` /
    ``eps``."""
    if not fused:
        return dict(scale=None, mode=ScalingMode.NO_SCALING, q=None, flags=0)
    return dict(
        scale=spec.scale,
        mode=spec.scaling_mode,
        q=spec.q_dtype,
        flags=LAYOUT_FLAGS[spec.layout],
        pow2=spec.power_2_scale,
        eps=spec.amax_epsilon,
    )


def quantize_output(spec: QuantizeSpec, y: jax.Array, dbias: bool = False):
    """``lowbit.quantize`` (``quantize_dbias``) of an unfused kernel's output, as ``spec`` says."""
    fn = quantize_dbias if dbias else quantize
    kw = {}
    if spec.scaling_mode.is_fp8_block:
        kw = dict(power_2_scale=spec.power_2_scale, amax_epsilon=spec.amax_epsilon)
    return fn(y, spec.scaling_mode, spec.q_dtype, scale=spec.scale, layout=spec.layout, **kw)


def finish_output(spec: Optional[QuantizeSpec], fused: bool, y, fp8: tuple, shape, dq_dtype):
    """A fused op's output: ``y`` unquantized, the kernel's own FP8 copies (``fp8``: data,
    scale_inv, colwise data, colwise scale_inv, amax) when ``fused``, else y quantized."""
    if spec is None:
        return y
    if fused:
        return fused_scaled_tensor(spec, shape, dq_dtype, *fp8)
    return quantize_output(spec, y)


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


__all__ = [
    "QuantizeArg",
    "QuantizeSpec",
    "block_dbias_fusion_enabled",
    "block_fusion_enabled",
    "finish_output",
    "fused_scaled_tensor",
    "is_fused",
    "kernel_quant",
    "parse_quantize_spec",
    "quantize_output",
    "scales_only",
    "straight_through_grad",
]
