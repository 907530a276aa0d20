"""``transformer_engine.jax.flax.transformer``: attention, relative positions and the layer."""

from lowbit.flax import DotProductAttention, MultiHeadAttention, TransformerLayer, TransformerLayerType
from lowbit.flax.positions import RelativePositionBiases, rotary_pos_emb
from lowbit.te.sharding import extend_logical_axis_rules


class LoRAScope:  # noqa: D101 - TE's small value class
    """Which projections get LoRA adapters (TE's parsed ``low_rank_adaptation_scope``)."""

    def __init__(self, qkv_proj=False, output_proj=False, mlp=False):
        self.qkv_proj = qkv_proj
        self.output_proj = output_proj
        self.mlp = mlp

    def __eq__(self, other):
        if not isinstance(other, LoRAScope):
            return NotImplemented
        return (self.qkv_proj, self.output_proj, self.mlp) == (other.qkv_proj, other.output_proj, other.mlp)

    def __repr__(self):
        return f"LoRAScope(qkv_proj={self.qkv_proj}, output_proj={self.output_proj}, mlp={self.mlp})"


__all__ = [
    "DotProductAttention",
    "LoRAScope",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "extend_logical_axis_rules",
    "rotary_pos_emb",
]
