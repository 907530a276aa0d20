"""Flax Linen modules with TransformerEngine's names: LayerNorm, Softmax, DenseGeneral,
LayerNormDenseGeneral, LayerNormMLP (the last three live in lowbit.flax.dense_general and
lowbit.flax.layernorm_mlp and are re-exported here).

Every GEMM goes through :func:`lowbit.dense` inside a state module of
:func:`lowbit.flax.wrap_function_in_state_module`, so the recipe of the enclosing
:func:`lowbit.autocast` (read at trace time) applies, DelayedScaling keeps its state in the
``_overwrite_with_gradient`` collection and NVFP4 draws from the ``sr_rng`` stream. Without a
recipe the math runs in the input's dtype. ``dtype`` is the parameters' dtype (as in
TransformerEngine); outputs have the input's dtype. ``*_axes`` are logical axis names
(``nn.with_logical_partitioning``); empty means unannotated.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.flax.dense_general import (
    DEFAULT_KERNEL_INIT,
    DenseContext,
    DenseGeneral,
    DenseOp,
    LayerNormDenseGeneral,
    SplitDenseOp,
)
from lowbit.flax.layernorm_mlp import LayerNormMLP, fused_mlp_activation, normalize_mlp_activations
from lowbit.flax.params import Initializer, apply_norm, check_norm_type, norm_params
from lowbit.ops.softmax import softmax as _softmax


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis (``lowbit.layernorm``)."""

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ("embed",)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma, beta = norm_params(
            self,
            x.shape[-1],
            self.layernorm_type,
            self.zero_centered_gamma,
            self.scale_init,
            self.bias_init,
            self.scale_axes,
            self.bias_axes,
            self.dtype,
        )
        return apply_norm(x, gamma, beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)


_SOFTMAX_TYPES = {
    "scaled": "scaled",
    "scaled_masked": "scaled_masked",
    "scaled_upper_triang_masked": "scaled_upper_triang_masked",
}


class Softmax(nn.Module):
    """``softmax(scale_factor * (x + bias))`` over the last axis (``lowbit.softmax``).

    ``softmax_type``: "scaled", "scaled_masked" (needs ``mask``, True = masked out) or
    "scaled_upper_triang_masked" (causal). TransformerEngine's SoftmaxType enum values (whose
    ``.name`` is SCALED, ...) are accepted too."""

    scale_factor: float = 1.0
    softmax_type: Any = "scaled"

    @nn.compact
    def __call__(
        self, inputs: jax.Array, mask: Optional[jax.Array] = None, bias: Optional[jax.Array] = None
    ) -> jax.Array:
        st = getattr(self.softmax_type, "name", self.softmax_type)
        st = st.lower() if isinstance(st, str) else st
        if st not in _SOFTMAX_TYPES:
            raise ValueError(
                f"softmax_type must be one of {sorted(_SOFTMAX_TYPES)}, got {self.softmax_type!r}"
            )
        if bias is not None:
            inputs = (inputs + bias).astype(inputs.dtype)
        if mask is not None and st != "scaled_masked":
            raise ValueError(f"Softmax: mask is only used with softmax_type='scaled_masked', not {st!r}")
        return _softmax(inputs, float(self.scale_factor), mask=mask, softmax_type=st)


__all__ = [
    "DEFAULT_KERNEL_INIT",
    "DenseContext",
    "DenseGeneral",
    "DenseOp",
    "Initializer",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
    "SplitDenseOp",
    "check_norm_type",
    "fused_mlp_activation",
    "normalize_mlp_activations",
]
