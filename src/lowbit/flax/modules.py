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

import warnings
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.flax.compat import check_attn_softmax_type
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


_FUSION_TYPES = ("scaled", "scaled_masked", "scaled_upper_triang_masked")


def softmax_fusion_name(value, name: str = "softmax_fusion_type") -> str:
    """'scaled', 'scaled_masked' or 'scaled_upper_triang_masked' from a string or TE's
    SoftmaxFusionType (whose ``.name`` is SCALED, ...)."""
    st = getattr(value, "name", value)
    st = st.lower() if isinstance(st, str) else st
    if st not in _FUSION_TYPES:
        raise ValueError(f"{name} must be one of {list(_FUSION_TYPES)}, got {value!r}")
    return st


class Softmax(nn.Module):
    """``softmax(scale_factor * (x + bias))`` over the last axis (``lowbit.softmax``), with
    TransformerEngine 2.10+'s fields.

    ``softmax_fusion_type``: "scaled", "scaled_masked" (needs ``mask``, True = masked out) or
    "scaled_upper_triang_masked" (causal); TE's SoftmaxFusionType members are accepted too. A
    mask given with the other two types is ignored, as in TE. ``softmax_type`` is the attention
    softmax variant (TE's AttnSoftmaxType: only "vanilla" here); a fusion type given as
    ``softmax_type`` (its meaning before TE 2.10) is taken as ``softmax_fusion_type`` with a
    DeprecationWarning."""

    scale_factor: float = 1.0
    softmax_fusion_type: Any = "scaled"
    softmax_type: Any = "vanilla"

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        mask: Optional[jax.Array] = None,
        bias: Optional[jax.Array] = None,
        softmax_offset: Optional[jax.Array] = None,
    ) -> jax.Array:
        fusion = self.softmax_fusion_type
        old = getattr(self.softmax_type, "name", self.softmax_type)
        if isinstance(old, str) and old.lower() in _FUSION_TYPES:
            warnings.warn(
                "Softmax(softmax_type=<fusion type>) is deprecated (TE 2.10 renamed it); use "
                "softmax_fusion_type. softmax_type now names the attention softmax variant",
                DeprecationWarning,
                stacklevel=2,
            )
            fusion = self.softmax_type
        else:
            check_attn_softmax_type(self.softmax_type)
        if softmax_offset is not None:
            raise NotImplementedError(
                "Softmax(softmax_offset=...): softmax sinks are not supported by lowbit"
            )
        st = softmax_fusion_name(fusion)
        if bias is not None:
            inputs = (inputs + bias).astype(inputs.dtype)
        return _softmax(inputs, float(self.scale_factor), mask if st == "scaled_masked" else None, st)


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
    "softmax_fusion_name",
    "fused_mlp_activation",
    "normalize_mlp_activations",
]
