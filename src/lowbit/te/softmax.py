"""``transformer_engine.jax.softmax``: TE's ``softmax`` and ``SoftmaxFusionType`` over
:func:`lowbit.softmax`. ``SoftmaxType`` (the name before TE 2.10) is a deprecated alias."""

from __future__ import annotations

import enum
import warnings
from typing import Optional

import jax
import jax.numpy as jnp

import lowbit


class SoftmaxFusionType(enum.Enum):
    """Which fused softmax: plain scaled, with a mask, or causal (upper triangle masked)."""

    SCALED = "scaled"
    SCALED_MASKED = "scaled_masked"
    SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang_masked"


def _fusion_kind(value, name: str) -> str:
    try:
        return SoftmaxFusionType(getattr(value, "value", value)).value
    except ValueError:
        raise ValueError(
            f"{name} must be a SoftmaxFusionType or one of "
            f"{[m.value for m in SoftmaxFusionType]}, got {value!r}"
        ) from None


def softmax(
    logits: jax.Array,
    mask: Optional[jax.Array] = None,
    scale_factor: Optional[float] = 1.0,
    softmax_fusion_type: Optional[SoftmaxFusionType] = SoftmaxFusionType.SCALED,
    *,
    softmax_type: Optional[SoftmaxFusionType] = None,
) -> jax.Array:
    """``softmax(scale_factor * logits)`` over the last axis; mask: nonzero/True = masked out,
    used by SCALED_MASKED only (ignored with the other types, as in TE). ``softmax_type`` is the
    deprecated (pre-2.10) name of ``softmax_fusion_type``."""
    if softmax_type is not None:
        warnings.warn(
            "softmax(softmax_type=...) is deprecated; use softmax_fusion_type",
            DeprecationWarning,
            stacklevel=2,
        )
        softmax_fusion_type = softmax_type
    kind = _fusion_kind(softmax_fusion_type, "softmax_fusion_type")
    if mask is not None and kind == "scaled_masked":
        mask = jnp.asarray(mask).astype(bool)  # TE passes 0/1 integer masks
    else:
        mask = None
    return lowbit.softmax(logits, 1.0 if scale_factor is None else float(scale_factor), mask, kind)


def __getattr__(name: str):
    if name == "SoftmaxType":
        warnings.warn(
            "lowbit.te.softmax.SoftmaxType is deprecated (TE 2.10 renamed it); use SoftmaxFusionType",
            DeprecationWarning,
            stacklevel=2,
        )
        return SoftmaxFusionType
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SoftmaxFusionType", "softmax"]
