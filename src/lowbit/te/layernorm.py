"""``transformer_engine.jax.layernorm``: LayerNorm / RMSNorm over :func:`lowbit.layernorm`."""

from __future__ import annotations

from typing import Optional

import jax

import lowbit
from lowbit.te._common import canonical_norm_type, fake_quantize


def canonicalize_norm_type(x: str) -> str:
    """'layernorm' or 'rmsnorm' from TE's spellings ('LayerNorm', 'rms_norm', ...)."""
    return canonical_norm_type(x)


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer=None,
) -> jax.Array:
    """Normalises x over its last axis; ``norm_type`` 'layernorm' or 'rmsnorm' (beta None). With
    a ``quantizer`` the output holds the dequantized values of its quantized form, as in TE."""
    y = lowbit.layernorm(
        x,
        gamma,
        beta,
        norm_type=canonical_norm_type(norm_type),
        zero_centered_gamma=zero_centered_gamma,
        epsilon=epsilon,
    )
    return y if quantizer is None else fake_quantize(y, quantizer)


__all__ = ["canonicalize_norm_type", "layernorm"]
