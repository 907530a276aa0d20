"""Fused softmax over the last axis: scaled, scaled + masked, scaled + causal (upper triangle).

Numerics (csrc/include/lowbit/softmax.h): ``softmax(scale_factor * x)`` in float32 over the
entries that are not masked out, rounded once to ``x``'s dtype. Masked-out entries get exactly 0;
a row with every entry masked out is all zeros (as ``jax.nn.softmax`` with ``where=``). A
``-inf`` entry counts as masked out (an additive mask), so an all ``-inf`` row is zeros too
(``jax.nn.softmax`` gives NaN there). NaN in a kept entry (or ``+inf``: ``inf - inf``) makes the
row's kept entries NaN, as ``jax.nn.softmax``; its gradient is NaN too. A NaN in a masked-out
entry is ignored. See docs/numerics.md "Softmax". The mask follows TransformerEngine:
``True`` (nonzero) means *masked out*. The causal type masks key ``j > i`` for query ``i``
(top-left aligned). With ``Sq != Sk`` the causal type takes TransformerEngine's fallback: the
same top-left triangle (key ``j`` masked for query ``i`` when ``j > i``) through the masked kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from lowbit.ops._ffi import softmax as ffi
from lowbit.quantization.checks import as_array, check_input
from lowbit.quantization.tensor import prod
from lowbit.sharding import plan_heads, shard_map

_TYPES = {
    "scaled": ffi.SCALED,
    "scaled_masked": ffi.SCALED_MASKED,
    "scaled_upper_triang_masked": ffi.SCALED_UPPER_TRIANG_MASKED,
}


def _check_scale(scale_factor):
    if isinstance(scale_factor, (bool, np.bool_)) or not isinstance(
        scale_factor, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"scale_factor must be a Python float (a static value), got {type(scale_factor).__name__}"
        )
    scale = float(scale_factor)
    if not np.isfinite(scale):
        raise ValueError(f"scale_factor must be finite, got {scale}")
    return scale


def _check_mask(mask, shape4):
    mask = as_array(mask, "mask")
    dt = np.dtype(mask.dtype)
    if not (dt == np.bool_ or np.issubdtype(dt, np.integer)):
        raise TypeError(
            f"mask must be boolean (True = masked out) or integer (nonzero = masked out), got {dt.name}"
        )
    if mask.ndim > 4:
        raise ValueError(f"mask must broadcast to x's shape, got a mask of rank {mask.ndim}")
    m4 = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if any(m not in (1, d) for m, d in zip(m4, shape4)):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {shape4} "
            f"(each axis must be 1 or equal to x's)"
        )
    return (mask != 0).astype(jnp.uint8).reshape(m4)


def softmax(
    x: ArrayLike, scale_factor: float = 1.0, mask: Optional[ArrayLike] = None, softmax_type: str = "scaled"
) -> jax.Array:
    """``softmax(scale_factor * x)`` over the last axis, differentiable (custom VJP).

    Args:
      x: float32/bfloat16/float16 array. "scaled": any rank; "scaled_masked": rank <= 4
        (B, H, Sq, Sk); "scaled_upper_triang_masked": rank >= 2 (Sq, Sk); when ``Sq != Sk`` it
        masks key ``j > i`` of query ``i`` (top-left, TransformerEngine's fallback).
      scale_factor: a static Python float multiplying x before the softmax.
      mask: "scaled_masked" only: boolean, broadcastable to x's shape, True = masked out.
      softmax_type: "scaled", "scaled_masked" or "scaled_upper_triang_masked".
    """
    if softmax_type not in _TYPES:
        raise ValueError(f"softmax_type must be one of {sorted(_TYPES)}, got {softmax_type!r}")
    scale = _check_scale(scale_factor)
    x = check_input(x, "x")
    shape = tuple(x.shape)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., Sk), got a rank-0 array (shape ())")
    Sk = shape[-1]
    if softmax_type == "scaled_masked":
        if mask is None:
            raise ValueError("mask is required for softmax_type='scaled_masked'")
        if x.ndim > 4:
            raise ValueError(f"x must have rank <= 4 (B, H, Sq, Sk) for scaled_masked, got shape {shape}")
        shape4 = (1,) * (4 - x.ndim) + shape
        mask4 = _check_mask(mask, shape4)
    else:
        if mask is not None:
            raise ValueError(f"mask is only used with softmax_type='scaled_masked', not {softmax_type!r}")
        mask4 = None
        if softmax_type == "scaled_upper_triang_masked":
            if x.ndim < 2:
                raise ValueError(f"x must end in (Sq, Sk) axes for the causal softmax, got shape {shape}")
            shape4 = (prod(shape[:-2]), 1, shape[-2], Sk)
            if shape[-2] != Sk:
                # TransformerEngine's fallback for a non-square causal softmax: the top-left
                # triangle as an explicit mask (the causal kernel needs Sq == Sk).
                Sq = shape[-2]
                tri = np.arange(Sk)[None, :] > np.arange(Sq)[:, None]
                mask4 = jnp.asarray(tri.reshape(1, 1, Sq, Sk), jnp.uint8)
                softmax_type = "scaled_masked"
        else:
            shape4 = (1, 1, prod(shape[:-1]), Sk)
    if x.ndim == 4 and (plan := plan_heads(shape[0], shape[1])) is not None:
        return _softmax_sharded(plan, x, scale, mask4, softmax_type)
    return _softmax(_SoftmaxConfig(_TYPES[softmax_type], scale, shape4), x, mask4)


def _softmax_sharded(plan, x, scale, mask4, softmax_type):
    """softmax of x (b, h, sq, sk) per shard under a mesh: batch over dp/fsdp, heads over tp (the
    FFI call has no partitioning rule: XLA would gather x). Its backward needs no collective."""
    mesh, b, h = plan
    xs = P(b, h)
    if mask4 is None:
        return shard_map(lambda x: softmax(x, scale, None, softmax_type), mesh, (xs,), xs)(x)
    ms = P(b if mask4.shape[0] > 1 else None, h if mask4.shape[1] > 1 else None)
    return shard_map(lambda x, m: softmax(x, scale, m, softmax_type), mesh, (xs, ms), xs)(x, mask4)


@dataclasses.dataclass(frozen=True)
class _SoftmaxConfig:
    softmax_type: int
    scale_factor: float
    shape4: tuple  # x viewed as (B, H, Sq, Sk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(cfg: _SoftmaxConfig, x, mask4):
    """``mask4``: uint8 (4-D, broadcast to x's view) for the masked type, else None."""
    y = ffi.softmax_fwd(
        x.reshape(cfg.shape4), mask4, softmax_type=cfg.softmax_type, scale_factor=cfg.scale_factor
    )
    return y.reshape(x.shape)


def _softmax_fwd(cfg: _SoftmaxConfig, x, mask4):
    y = _softmax(cfg, x, mask4)
    return y, y


def _softmax_bwd(cfg: _SoftmaxConfig, y, dy):
    rows, Sk = prod(y.shape[:-1]), y.shape[-1]
    dx = ffi.softmax_bwd(
        dy.astype(y.dtype).reshape(rows, Sk), y.reshape(rows, Sk), scale_factor=cfg.scale_factor
    )
    return dx.reshape(y.shape), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


__all__ = ["softmax"]
