"""``transformer_engine.jax.flax``: lowbit's Flax modules under TE's names, with TE's submodules
``module`` (dense, norm, MLP, softmax, ``TransformerEngineBase``, state-module wrappers) and
``transformer`` (attention, relative positions, the layer)."""

from lowbit.flax import make_ragged_dot_cls
from lowbit.te.flax import module, transformer
from lowbit.te.flax.module import (
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    Softmax,
    TransformerEngineBase,
    make_dot_general_cls,
    make_grouped_dense_cls,
    wrap_function_in_te_state_module,
)
from lowbit.te.flax.transformer import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
    extend_logical_axis_rules,
)
from lowbit.te.grouped_dense import _MoEBlock  # noqa: F401 (TE's name)

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
    "TransformerEngineBase",
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "make_ragged_dot_cls",
    "wrap_function_in_te_state_module",
    "extend_logical_axis_rules",
    "module",
    "transformer",
]
