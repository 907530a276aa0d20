"""``transformer_engine.jax.softmax``: TE's signature and SoftmaxType over :func:`lowbit.softmax`."""

from __future__ import annotations

import enum
from typing import Optional

import jax
import jax.numpy as jnp

import lowbit


class SoftmaxType(enum.Enum):
    """Which fused softmax: plain scaled, with a mask, or causal (upper triangle masked)."""

    SCALED = "scaled"
    SCALED_MASKED = "scaled_masked"
    SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang_masked"


def softmax(
    logits: jax.Array,
    mask: Optional[jax.Array] = None,
    scale_factor: Optional[float] = 1.0,
    softmax_type: Optional[SoftmaxType] = SoftmaxType.SCALED,
) -> jax.Array:
    """``softmax(scale_factor * logits)`` over the last axis; mask: nonzero/True = masked out."""
    kind = SoftmaxType(softmax_type).value
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)  # TE passes 0/1 integer masks
    return lowbit.softmax(logits, 1.0 if scale_factor is None else float(scale_factor), mask, kind)
