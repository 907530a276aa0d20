"""``transformer_engine.jax.layernorm_dense``: a norm followed by a (quantized) dense."""

from __future__ import annotations

from typing import Optional, Tuple

import jax

from lowbit.te._common import constrain, deprecated_batch_first
from lowbit.te.dense import dense
from lowbit.te.layernorm import layernorm
from lowbit.te.quantize import QuantizerSet, noop_quantizer_set


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    bias: Optional[jax.Array] = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    layernorm_input_axes: Optional[Tuple[str, ...]] = None,
    dot_input_axes: Optional[Tuple[str, ...]] = None,
    kernel_axes: Optional[Tuple[str, ...]] = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    *,
    batch_first: Optional[bool] = None,
) -> jax.Array:
    """``dense(norm(x), kernel) + bias``; x (..., H), kernel (H, N...). The math is per token,
    so ``transpose_batch_sequence`` (and ``batch_first``, its pre-2.10 name, deprecated) change
    nothing."""
    deprecated_batch_first(batch_first)
    del transpose_batch_sequence
    x = constrain(x, layernorm_input_axes)
    y = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    return dense(
        y,
        kernel,
        bias,
        contracting_dims=((x.ndim - 1,), (0,)),
        input_axes=dot_input_axes,
        kernel_axes=kernel_axes,
        quantizer_set=quantizer_set,
    )
