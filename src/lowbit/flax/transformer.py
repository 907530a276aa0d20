"""TransformerLayer with TransformerEngine's names: attention block then MLP block."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.attention import _LAYER_TYPES, _MASK_TYPES, MultiHeadAttention, _enum_name
from lowbit.flax.modules import DEFAULT_KERNEL_INIT, Initializer, LayerNorm, LayerNormMLP


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + drop(MHA(norm(x)))``, then ``x + drop(MLP(norm(x)))``.

    ``layer_type`` "encoder" uses ``self_attn_mask_type`` as given; "decoder" is a causal
    self-attention layer (causal is added to the mask type; no cross-attention). Heads have
    ``hidden_size / num_attention_heads`` dims. ``attention_mask``: True = masked out,
    ``(batch, 1, seq, seq)``, required for the padding mask types."""

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.1
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Initializer = DEFAULT_KERNEL_INIT
    mlp_kernel_init: Initializer = DEFAULT_KERNEL_INIT
    mlp_activations: Sequence[str] = ("relu",)
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    layer_type: Any = "encoder"
    self_attn_mask_type: Any = "causal"
    output_layernorm: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        encoded: Optional[jax.Array] = None,
        attention_mask: Optional[jax.Array] = None,
        encoder_decoder_mask: Optional[jax.Array] = None,
        deterministic: bool = False,
    ) -> jax.Array:
        layer_type = _enum_name(self.layer_type, "layer_type", _LAYER_TYPES)
        mask_type = _enum_name(self.self_attn_mask_type, "self_attn_mask_type", _MASK_TYPES)
        if encoded is not None or encoder_decoder_mask is not None:
            raise NotImplementedError(
                "TransformerLayer: cross-attention (encoded / encoder_decoder_mask) is not "
                "supported; layer_type='decoder' is a causal self-attention layer"
            )
        if layer_type == "decoder" and "causal" not in mask_type:
            mask_type = "causal" if mask_type == "no_mask" else "padding_causal"
        H, heads = self.hidden_size, self.num_attention_heads
        if not isinstance(heads, (int, np.integer)) or heads < 1 or H % heads:
            raise ValueError(f"num_attention_heads ({heads}) must divide hidden_size ({H})")
        if inputs.shape[-1] != H:
            raise ValueError(f"inputs' last axis ({inputs.shape[-1]}) must equal hidden_size ({H})")
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        norm = dict(layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma)
        x, _ = MultiHeadAttention(
            head_dim=H // heads,
            num_attention_heads=heads,
            num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout,
            dropout_rng_name=self.dropout_rng_name,
            layernorm_epsilon=self.layernorm_epsilon,
            kernel_init=self.mha_kernel_init,
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            attn_mask_type=mask_type,
            dtype=self.dtype,
            name="attention",
            **norm,
        )(inputs, inputs, attention_mask, deterministic=deterministic)
        x = self._dropout(x, self.hidden_dropout_dims, deterministic) + inputs
        y, _ = LayerNormMLP(
            intermediate_dim=self.mlp_hidden_size,
            epsilon=self.layernorm_epsilon,
            kernel_init=self.mlp_kernel_init,
            kernel_axes_1=("embed", "mlp"),
            kernel_axes_2=("mlp", "embed"),
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            bias_axes_1=("mlp",),
            bias_axes_2=("embed",),
            activations=tuple(self.mlp_activations),
            intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            dtype=self.dtype,
            name="mlp",
            **norm,
        )(x, deterministic=deterministic)
        out = self._dropout(y, self.hidden_dropout_dims, deterministic) + x
        if self.output_layernorm:
            out = LayerNorm(
                epsilon=self.layernorm_epsilon, dtype=self.dtype, name="output_layernorm", **norm
            )(out)
        return out

    def _dropout(self, x, dims, deterministic):
        if self.hidden_dropout == 0 or deterministic:
            return x
        return nn.Dropout(
            self.hidden_dropout, broadcast_dims=tuple(dims), rng_collection=self.dropout_rng_name
        )(x, deterministic=False)


__all__ = ["TransformerLayer"]
