"""Small helpers shared by the lowbit.te adapters."""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import flax.linen as nn
import jax

import lowbit


def refuse(name: str, value, default, why: str) -> None:
    """An argument lowbit cannot honour, set to something other than its default: say so."""
    if value is not default and value != default:
        raise NotImplementedError(f"{name}={value!r} is not supported by lowbit.te ({why})")


def constrain(x, axes: Optional[Sequence[Optional[str]]]):
    """TE's logical-axis sharding constraint: applied when Flax logical axis rules are active."""
    if not axes or not nn.get_logical_axis_rules():
        return x
    return nn.with_logical_constraint(x, tuple(axes))


def canonical_norm_type(norm_type: str) -> str:
    """TE accepts 'LayerNorm', 'rms_norm' ...: compare without case, '-' or '_'."""
    t = str(norm_type).lower().strip().replace("-", "").replace("_", "")
    if t not in ("layernorm", "rmsnorm"):
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return t


def deprecated_batch_first(batch_first) -> None:
    """``batch_first``: TE's name before 2.10 for ``not transpose_batch_sequence``."""
    if batch_first is not None:
        warnings.warn(
            "batch_first is deprecated; use transpose_batch_sequence", DeprecationWarning, stacklevel=3
        )


def fake_quantize(y: jax.Array, quantizer) -> jax.Array:
    """``dequantize(quantize(y))`` as ``quantizer`` (a :class:`lowbit.te.quantize.Quantizer`)
    says, with a straight-through gradient: TE's normalisation and activation outputs under a
    quantizer (TE dequantizes them in the forward and differentiates as if unquantized)."""
    if not all(hasattr(quantizer, a) for a in ("scaling_mode", "q_dtype", "scale")):
        raise TypeError(f"quantizer must be a lowbit.te.quantize.Quantizer or None, got {quantizer!r}")
    kw = {}
    if quantizer.scale is not None:  # delayed scaling: the quantizer's encode scale
        kw["scale"] = quantizer.scale
    q = lowbit.quantize(jax.lax.stop_gradient(y), quantizer.scaling_mode, quantizer.q_dtype, **kw)
    deq = lowbit.dequantize(q, dtype=y.dtype)
    return y + jax.lax.stop_gradient(deq - y)
