"""``transformer_engine.jax.flax.transformer``: attention, relative positions and the layer."""

from lowbit.flax import DotProductAttention, MultiHeadAttention, TransformerLayer, TransformerLayerType
from lowbit.flax.positions import RelativePositionBiases, rotary_pos_emb
from lowbit.te.sharding import extend_logical_axis_rules

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "extend_logical_axis_rules",
    "rotary_pos_emb",
]
