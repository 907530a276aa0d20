"""``transformer_engine.jax.activation``: TE's (..., len(activation_type), K) layout over
:func:`lowbit.activation`."""

from __future__ import annotations

from typing import Sequence, Union

import jax

import lowbit
from lowbit.te._common import fake_quantize, refuse


def activation(
    x: jax.Array, activation_type: Sequence[Union[str, object]], quantizer=None, act_params=None
) -> jax.Array:
    """``act(x[..., 0, :])`` or, gated (``(act, 'linear')``), ``act(x[..., 0, :]) * x[..., 1, :]``.

    x has TE's layout ``(..., len(activation_type), K)``; the output is ``(..., K)``. With a
    ``quantizer`` it holds the dequantized values of its quantized form, as in TE.
    """
    refuse("act_params", act_params, None, "clamped SwiGLU is not implemented")
    names = tuple(activation_type)
    if not all(isinstance(n, str) for n in names):
        raise NotImplementedError("activation_type: lowbit takes activation names, not callables")
    if x.ndim < 2 or x.shape[-2] != len(names):
        raise ValueError(
            f"activation: x must have shape (..., {len(names)}, K) for {names}, got {tuple(x.shape)}"
        )
    # (..., A, K) -> (..., A*K): the gated halves (a, b) side by side, as lowbit takes them.
    y = lowbit.activation(x.reshape(x.shape[:-2] + (len(names) * x.shape[-1],)), names)
    return y if quantizer is None else fake_quantize(y, quantizer)
