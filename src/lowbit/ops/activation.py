"""Activations, plain and gated, optionally writing the output straight to FP8.

``activations`` follows TransformerEngine: ``("gelu",)`` is one activation; a pair whose second
entry is ``"linear"`` is gated: ``x``'s last axis holds ``(a, b)`` halves and the output is
``act(a) * b`` (``("gelu", "linear")`` = GeGLU, ``("silu", "linear")`` = SwiGLU, ...). The names
``geglu``, ``swiglu``, ``reglu``, ``qgeglu`` and ``sreglu`` are accepted as shorthands.
``"gelu"`` is the tanh approximation (as in TransformerEngine and flax.linen.gelu);
``"gelu_exact"`` uses erf.

Numerics (csrc/include/lowbit/activation.h): float32 math, the result rounded once to ``x``'s
dtype; fused FP8 outputs equal ``lowbit.quantize`` of that rounded result bit for bit (and the
fused dbias equals ``lowbit.quantize_dbias``'s). Tensor scaling is fused into the kernel; other
modes run the activation, then ``lowbit.quantize``.

Building blocks for fused modules: :func:`act_lu` (forward) and :func:`dact_dbias` (backward
with optional dbias and quantization of the gradient).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native
from lowbit.ops.norm import (
    _F32_EMPTY,
    _U8_EMPTY,
    fused_outputs,
    fused_scaled_tensor,
    parse_quantize_spec,
    scales_only,
    straight_through_grad,
)
from lowbit.ops.quantize import _EMPTY_F32, _check_input
from lowbit.ops.quantize import quantize as _quantize
from lowbit.ops.quantize import quantize_dbias as _quantize_dbias
from lowbit.quantize.scaling_modes import ScalingMode, dtype_code
from lowbit.quantize.tensor import ScaledTensor, _prod

_native.register_ops("act_fwd", "act_bwd")

# ActKind codes of csrc/include/lowbit/activation.h.
_ACTS = {
    "linear": 0,
    "gelu": 1,
    "gelu_tanh": 1,
    "gelu_exact": 2,
    "relu": 3,
    "silu": 4,
    "swish": 4,
    "quick_gelu": 5,
    "squared_relu": 6,
}
_GATED = {
    "geglu": ("gelu", "linear"),
    "swiglu": ("silu", "linear"),
    "reglu": ("relu", "linear"),
    "qgeglu": ("quick_gelu", "linear"),
    "sreglu": ("squared_relu", "linear"),
}


def parse_activations(activations):
    """Returns (act code, gated) for a TransformerEngine-style activations tuple."""
    if isinstance(activations, str):
        activations = (activations,)
    try:
        names = tuple(activations)
    except TypeError:
        raise TypeError(f"activations must be a tuple of names such as ('gelu',) or ('silu', 'linear'), "
                        f"got {activations!r}") from None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"activations must be a non-empty tuple of strings, got {activations!r}")
    names = tuple(n.lower() for n in names)
    if len(names) == 1 and names[0] in _GATED:
        names = _GATED[names[0]]
    known = sorted(set(_ACTS) | set(_GATED))
    if len(names) == 1:
        if names[0] not in _ACTS:
            raise ValueError(f"activations: unknown activation {names[0]!r}; choose from {known}")
        return _ACTS[names[0]], False
    if len(names) == 2 and names[1] == "linear":
        if names[0] not in _ACTS:
            raise ValueError(f"activations: unknown activation {names[0]!r}; choose from {known}")
        return _ACTS[names[0]], True
    raise ValueError(f"activations must be one activation or an (activation, 'linear') gated pair, got {activations!r}")


def _check_x(x, gated):
    x = _check_input(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension")
    if gated and x.shape[-1] % 2:
        raise ValueError(f"x: a gated activation needs an even last axis holding (act, linear) halves, "
                         f"got shape {tuple(x.shape)}")
    return x


def _fp8_or_empty(spec, rows, cols):
    fused = spec is not None and spec.scaling_mode.is_tensor_scaling
    if fused:
        return fused_outputs(spec, rows, cols), True
    return (_U8_EMPTY, _F32_EMPTY, _U8_EMPTY, _F32_EMPTY, _F32_EMPTY), False


def _attrs(act, gated, spec, fused):
    return dict(act=np.int32(act), gated=np.int32(bool(gated)),
                mode=np.int32(int(spec.scaling_mode) if fused else int(ScalingMode.NO_SCALING)),
                q_dtype=np.int32(dtype_code(spec.q_dtype) if fused else 0))


def _scale_arg(spec, fused):
    return spec.scale if (fused and spec.scale is not None) else _EMPTY_F32


def act_lu(x, activations=("gelu",), quantize=None, return_hp: bool = False):
    """Forward building block: ``act(x)`` (gated: ``act(a) * b``), an array of x's dtype or a
    ScaledTensor when ``quantize`` is given; with ``return_hp`` also the unquantized output."""
    act, gated = parse_activations(activations)
    x = _check_x(x, gated)
    spec = parse_quantize_spec(quantize, x.dtype)
    return _act_lu(x, act, gated, spec, return_hp)


def _act_lu(x, act, gated, spec, return_hp):
    shape = tuple(x.shape)
    W = shape[-1]
    H = W // 2 if gated else W
    R = _prod(shape[:-1])
    out_shape = shape[:-1] + (H,)
    fp8, fused = _fp8_or_empty(spec, R, H)
    want_y = not fused or return_hp
    _native.ensure_loaded()
    out_types = (jax.ShapeDtypeStruct((R, H), x.dtype) if want_y else _U8_EMPTY, *fp8)
    call = jax.ffi.ffi_call("lowbit_act_fwd", out_types, vmap_method="sequential")
    y, data, s_inv, cw, cw_s_inv, amax = call(x.reshape(R, W), _scale_arg(spec, fused), **_attrs(act, gated, spec, fused))
    y = y.reshape(out_shape) if want_y else None
    if spec is None:
        out = y
    elif fused:
        out = fused_scaled_tensor(spec, out_shape, x.dtype, data, s_inv, cw, cw_s_inv, amax)
    else:
        out = _quantize(y, spec.scaling_mode, spec.q_dtype, scale=spec.scale, layout=spec.layout)
    return (out, y) if return_hp else out


def dact_dbias(dy, x, activations=("gelu",), quantize=None, with_dbias: bool = False):
    """Backward building block: returns ``(dx, dbias)``.

    ``dx`` (x's shape and dtype) is the gradient through the activation, or its ScaledTensor when
    ``quantize`` is given; ``dbias`` (x.shape[-1],) in x's dtype is the sum of dx over all leading
    axes when ``with_dbias``, else None. Fused into one kernel under tensor scaling."""
    act, gated = parse_activations(activations)
    x = _check_x(x, gated)
    dy = _check_input(dy, "dy")
    W = x.shape[-1]
    H = W // 2 if gated else W
    want = tuple(x.shape[:-1]) + (H,)
    if tuple(dy.shape) != want or dy.dtype != x.dtype:
        raise TypeError(f"dy must be {x.dtype} of shape {want} (the activation's output), got {dy.dtype} {tuple(dy.shape)}")
    spec = parse_quantize_spec(quantize, x.dtype)
    return _dact(dy, x, act, gated, spec, with_dbias)


def _dact(dy, x, act, gated, spec, with_dbias):
    shape = tuple(x.shape)
    W = shape[-1]
    H = W // 2 if gated else W
    R = _prod(shape[:-1])
    fp8, fused = _fp8_or_empty(spec, R, W)
    want_dx = not fused
    kernel_dbias = with_dbias and (spec is None or fused)
    ws = _native.workspace_bytes("lowbit_act_bwd_workspace_bytes", R, H, int(gated), int(kernel_dbias))
    _native.ensure_loaded()
    out_types = (
        jax.ShapeDtypeStruct((R, W), x.dtype) if want_dx else _U8_EMPTY,
        *fp8,
        jax.ShapeDtypeStruct((W,), x.dtype) if kernel_dbias else _U8_EMPTY,
        jax.ShapeDtypeStruct((ws,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("lowbit_act_bwd", out_types, vmap_method="sequential")
    dx, data, s_inv, cw, cw_s_inv, amax, db, _ = call(
        dy.reshape(R, H), x.reshape(R, W), _scale_arg(spec, fused), **_attrs(act, gated, spec, fused))
    if spec is None:
        return dx.reshape(shape), (db if with_dbias else None)
    if fused:
        return fused_scaled_tensor(spec, shape, x.dtype, data, s_inv, cw, cw_s_inv, amax), (db if with_dbias else None)
    dx = dx.reshape(shape)
    if with_dbias:
        return _quantize_dbias(dx, spec.scaling_mode, spec.q_dtype, scale=spec.scale, layout=spec.layout)
    return _quantize(dx, spec.scaling_mode, spec.q_dtype, scale=spec.scale, layout=spec.layout), None


def activation(x, activations=("gelu",), quantize=None):
    """``act(x)`` or, gated, ``act(a) * b`` over the last axis; differentiable (custom VJP).

    Args:
      x: float32/bfloat16/float16 array (..., W); gated activations need W even, output (..., W/2).
      activations: ``("gelu",)``, ``("relu",)``, ``("silu",)``, ``("quick_gelu",)``,
        ``("squared_relu",)``, ``("gelu_exact",)``, ``("linear",)``, or a gated pair
        ``(name, "linear")`` / shorthand (``"geglu"``, ``"swiglu"``, ``"reglu"``, ``"qgeglu"``,
        ``"sreglu"``).
      quantize: None, or ``(scaling_mode, q_dtype, scale[, layout])``: returns a
        :class:`lowbit.ScaledTensor` equal to ``lowbit.quantize`` of the unquantized output. Its
        cotangent is taken straight through the quantization.
    """
    act, gated = parse_activations(activations)
    x = _check_x(x, gated)
    spec = parse_quantize_spec(quantize, x.dtype)
    scale = None if spec is None else spec.scale

    @jax.custom_vjp
    def f(x, scale):
        return _act_lu(x, act, gated, None if spec is None else spec._replace(scale=scale), False)

    def f_fwd(x, scale):
        out = f(x, scale)
        return out, (x, scales_only(out) if isinstance(out, ScaledTensor) else None, scale)

    def f_bwd(res, ct):
        x, res_q, scale = res
        dy = ct if res_q is None else straight_through_grad(ct, res_q)
        dx, _ = _dact(dy.astype(x.dtype), x, act, gated, None, False)
        return dx, (None if scale is None else jnp.zeros_like(scale))

    f.defvjp(f_fwd, f_bwd)
    return f(x, scale)


__all__ = ["act_lu", "activation", "dact_dbias", "parse_activations"]
