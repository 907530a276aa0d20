"""``transformer_engine.jax.layernorm``: LayerNorm / RMSNorm over :func:`lowbit.layernorm`."""

from __future__ import annotations

from typing import Optional

import jax

import lowbit
from lowbit.te._common import canonical_norm_type, refuse


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer=None,
) -> jax.Array:
    """Normalises x over its last axis; ``norm_type`` 'layernorm' or 'rmsnorm' (beta None)."""
    refuse("quantizer", quantizer, None, "use lowbit.layernorm(quantize=...) for an FP8 output")
    return lowbit.layernorm(
        x,
        gamma,
        beta,
        norm_type=canonical_norm_type(norm_type),
        zero_centered_gamma=zero_centered_gamma,
        epsilon=epsilon,
    )
