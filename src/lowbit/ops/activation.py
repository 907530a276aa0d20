"""Activations, plain and gated, optionally writing the output straight to FP8.

``activations`` follows TransformerEngine: ``("gelu",)`` is one activation; a pair whose second
entry is ``"linear"`` is gated: ``x``'s last axis holds ``(a, b)`` halves and the output is
``act(a) * b`` (``("gelu", "linear")`` = GeGLU, ``("silu", "linear")`` = SwiGLU, ...). The names
``geglu``, ``swiglu``, ``reglu``, ``qgeglu`` and ``sreglu`` are accepted as shorthands.
``"gelu"`` is the tanh approximation (as in TransformerEngine and flax.linen.gelu);
``"gelu_exact"`` uses erf.

Numerics (csrc/include/lowbit/activation.h): float32 math, the result rounded once to ``x``'s
dtype; fused FP8 outputs equal ``lowbit.quantize`` of that rounded result bit for bit; the fused dbias
is the float32 column sum of it, rounded once (``lowbit.quantize_dbias``'s bits on the CPU; on
the GPU another fixed order: per 64- or 128-row tile, then over the tiles). Tensor scaling and FP8
block scaling (whole 16x16 tiles) are fused into the kernel; other modes run the activation,
then ``lowbit.quantize``.

Building blocks for fused modules: :func:`act_lu` (forward) and :func:`dact_dbias` (backward
with optional dbias and quantization of the gradient).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lowbit.ops._ffi import activation as ffi
from lowbit.ops.fused_quantize import (
    QuantizeArg,
    QuantizeSpec,
    block_dbias_fusion_enabled,
    finish_output,
    fused_scaled_tensor,
    is_fused,
    kernel_quant,
    parse_quantize_spec,
    quantize_output,
    scales_only,
    straight_through_grad,
)
from lowbit.quantization.checks import check_input
from lowbit.quantization.tensor import ScaledTensor, prod
from lowbit.sharding import plan_rows, shard_map

# The kernel's activations by name.
_ACTS = {
    "linear": ffi.LINEAR,
    "gelu": ffi.GELU_TANH,
    "gelu_tanh": ffi.GELU_TANH,
    "gelu_exact": ffi.GELU_EXACT,
    "relu": ffi.RELU,
    "silu": ffi.SILU,
    "swish": ffi.SILU,
    "quick_gelu": ffi.QUICK_GELU,
    "squared_relu": ffi.SQUARED_RELU,
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
        raise TypeError(
            f"activations must be a tuple of names such as ('gelu',) or ('silu', 'linear'), "
            f"got {activations!r}"
        ) from None
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
    raise ValueError(
        f"activations must be one activation or an (activation, 'linear') gated pair, got {activations!r}"
    )


def _check_x(x, gated):
    x = check_input(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., W), got a rank-0 array (shape ())")
    if gated and x.shape[-1] % 2:
        raise ValueError(
            f"x: a gated activation needs an even last axis holding (act, linear) halves, "
            f"got shape {tuple(x.shape)}"
        )
    return x


def act_lu(x, activations=("gelu",), quantize=None, return_hp: bool = False):
    """Forward building block: ``act(x)`` (gated: ``act(a) * b``), an array of x's dtype or a
    ScaledTensor when ``quantize`` is given; with ``return_hp`` also the unquantized output."""
    act, gated = parse_activations(activations)
    x = _check_x(x, gated)
    spec = parse_quantize_spec(quantize, x.dtype)
    return act_forward(x, act, gated, spec, return_hp)


def act_forward(x, act: int, gated: bool, spec, return_hp: bool):
    """:func:`act_lu` of checked arguments (``act``, ``gated`` as :func:`parse_activations`
    returns them, ``spec`` a parsed QuantizeSpec or None)."""
    shape = tuple(x.shape)
    W = shape[-1]
    H = W // 2 if gated else W
    R = prod(shape[:-1])
    out_shape = shape[:-1] + (H,)
    fused = is_fused(spec, R, H)
    want_y = not fused or return_hp
    y, *fp8 = ffi.act_fwd(x.reshape(R, W), act=act, gated=gated, want_y=want_y, **kernel_quant(spec, fused))
    y = y.reshape(out_shape) if want_y else None
    out = finish_output(spec, fused, y, tuple(fp8), out_shape, x.dtype)
    return (out, y) if return_hp else out


def dact_dbias(dy, x, activations=("gelu",), quantize=None, with_dbias: bool = False):
    """Backward building block: returns ``(dx, dbias)``.

    ``dx`` (x's shape and dtype) is the gradient through the activation, or its ScaledTensor when
    ``quantize`` is given; ``dbias`` (x.shape[-1],) in x's dtype is the sum of dx over all leading
    axes when ``with_dbias``, else None. Fused into one kernel under tensor scaling."""
    act, gated = parse_activations(activations)
    x = _check_x(x, gated)
    dy = check_input(dy, "dy")
    W = x.shape[-1]
    H = W // 2 if gated else W
    want = tuple(x.shape[:-1]) + (H,)
    if tuple(dy.shape) != want or dy.dtype != x.dtype:
        raise TypeError(
            f"dy must be {x.dtype} of shape {want} (the activation's output), "
            f"got {dy.dtype} {tuple(dy.shape)}"
        )
    spec = parse_quantize_spec(quantize, x.dtype)
    return act_backward(dy, x, act, gated, spec, with_dbias)


def act_backward(dy, x, act: int, gated: bool, spec, with_dbias: bool):
    """:func:`dact_dbias` of checked arguments (as :func:`act_forward`)."""
    shape = tuple(x.shape)
    W = shape[-1]
    H = W // 2 if gated else W
    R = prod(shape[:-1])
    # Block scaling with a bias gradient: the block cast sums dbias per 128-row tile (fixed order,
    # float32; not quantize_dbias's order, so equal within accumulation bounds, not bit for bit).
    # LOWBIT_BLOCK_DBIAS_FUSION=0 keeps this case unfused (kernel, then quantize_dbias).
    block_dbias = with_dbias and spec is not None and spec.scaling_mode.is_fp8_block
    fused = is_fused(spec, R, W) and not (block_dbias and not block_dbias_fusion_enabled())
    kernel_dbias = with_dbias and (spec is None or fused)
    dx, *fp8, db = ffi.act_bwd(
        dy.reshape(R, H),
        x.reshape(R, W),
        act=act,
        gated=gated,
        want_dbias=kernel_dbias,
        **kernel_quant(spec, fused),
    )
    if spec is None:
        return dx.reshape(shape), (db if with_dbias else None)
    if fused:
        return fused_scaled_tensor(spec, shape, x.dtype, *fp8), (db if with_dbias else None)
    if with_dbias:
        return quantize_output(spec, dx.reshape(shape), dbias=True)
    return quantize_output(spec, dx.reshape(shape)), None


def activation(
    x: ArrayLike, activations: Union[str, Sequence[str]] = ("gelu",), quantize: Optional[QuantizeArg] = None
) -> Union[jax.Array, ScaledTensor]:
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
    cfg = _ActConfig(act, gated, None if spec is None else spec._replace(scale=None))
    # Under a MeshResource: per batch shard, and per tp shard of the last axis when not gated.
    plan = None if spec is not None else plan_rows(x.shape, split_last=not gated)
    if plan is not None:
        return _activation_sharded(cfg, plan, x)
    return _activation(cfg, x, scale)


@dataclasses.dataclass(frozen=True)
class _ActConfig:
    act: int
    gated: bool
    spec: Optional[QuantizeSpec] = None  # the output's quantization, its scale None


def _forward(cfg: _ActConfig, x, scale):
    spec = None if cfg.spec is None else cfg.spec._replace(scale=scale)
    return act_forward(x, cfg.act, cfg.gated, spec, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _activation(cfg: _ActConfig, x, scale):
    return _forward(cfg, x, scale)


def _activation_fwd(cfg: _ActConfig, x, scale):
    out = _forward(cfg, x, scale)
    return out, (x, scales_only(out) if isinstance(out, ScaledTensor) else None, scale)


def _activation_bwd(cfg: _ActConfig, res, ct):
    x, res_q, scale = res
    dy = ct if res_q is None else straight_through_grad(ct, res_q)
    dx, _ = act_backward(dy.astype(x.dtype), x, cfg.act, cfg.gated, None, False)
    return dx, (None if scale is None else jnp.zeros_like(scale))


_activation.defvjp(_activation_fwd, _activation_bwd)


def _activation_sharded(cfg: _ActConfig, plan, x):
    """The op per shard (the FFI call has no partitioning rule, so XLA would gather x); an
    elementwise op needs no collective, forward or backward."""
    mesh, xs = plan
    return shard_map(lambda x: _activation(cfg, x, None), mesh, (xs,), xs)(x)


__all__ = ["act_lu", "activation", "dact_dbias", "parse_activations"]
