"""Flax (linen) integration: a drop-in quantized ``dot_general`` and state-owning wrappers."""

from lowbit.flax.attention import DotProductAttention, MultiHeadAttention
from lowbit.flax.dot_general import layer_dot_general_cls, make_dot_general_cls
from lowbit.flax.fp8_weights import FP8_WEIGHTS, apply_updates_with_fp8_weights, refresh_fp8_weights
from lowbit.flax.modules import DenseGeneral, DenseOp, LayerNorm, LayerNormDenseGeneral, LayerNormMLP, Softmax
from lowbit.flax.moe import MoEBlock
from lowbit.flax.positions import RelativePositionBiases
from lowbit.flax.ragged_dot import make_ragged_dot_cls
from lowbit.flax.state_module import (
    OVERWRITE_WITH_GRADIENT,
    SR_RNG,
    QuantizeContext,
    wrap_function_in_state_module,
    wrap_function_in_te_state_module,
)
from lowbit.flax.transformer import TransformerLayer, TransformerLayerType

__all__ = [
    "make_ragged_dot_cls",
    "MoEBlock",
    "FP8_WEIGHTS",
    "refresh_fp8_weights",
    "apply_updates_with_fp8_weights",
    "OVERWRITE_WITH_GRADIENT",
    "SR_RNG",
    "QuantizeContext",
    "make_dot_general_cls",
    "layer_dot_general_cls",
    "wrap_function_in_state_module",
    "wrap_function_in_te_state_module",
    "DenseGeneral",
    "DenseOp",
    "DotProductAttention",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "Softmax",
    "TransformerLayer",
    "TransformerLayerType",
]
