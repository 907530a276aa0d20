"""TransformerLayer and TransformerLayerType with TransformerEngine's fields, defaults and order.

Encoder (``TransformerLayerType.ENCODER``): relative position bias (T5 style, on by default as in
TransformerEngine), self-attention block (submodule ``attention``), MLP block (``mlp``).
Decoder (``DECODER``): self-attention (``self_attention``, mask type ``self_attn_mask_type`` as
given), cross-attention on ``encoded`` (``encoder_decoder_attention``, padding mask
``encoder_decoder_mask``, its own pre-norm), MLP. Each block: ``x + drop(block(x))`` with the
block's input norm, or the norm output as the residual with
``apply_residual_connection_post_layernorm``. ``output_layernorm=True`` drops the self-attention's
input norm and normalises the layer's output instead (``output_layernorm``), as TransformerEngine
does. Heads have ``hidden_size // num_attention_heads`` dims; ``hidden_size`` need not equal the
input width (the projections map back to it).

The attention blocks are :class:`lowbit.flax.MultiHeadAttention` with TransformerEngine's
MultiHeadAttention fields, passed as TransformerEngine's TransformerLayer passes them; the relative
position bias is :class:`lowbit.flax.positions.RelativePositionBiases`. docs/te_modules_layer.md
lists every field.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.attention import MultiHeadAttention, lora_scope
from lowbit.flax.layernorm_mlp import LayerNormMLP
from lowbit.flax.modules import LayerNorm
from lowbit.flax.params import Initializer
from lowbit.flax.positions import RelativePositionBiases
from lowbit.sharding import (
    W_FSDP_AXES,
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    W_TP_AXES,
    bias_layout,
    constrain_sequence,
)


class TransformerLayerType(enum.Enum):
    """TransformerEngine's layer types: an encoder layer, or a decoder layer with cross-attention."""

    ENCODER = "encoder"
    DECODER = "decoder"


def _layer_type(v) -> TransformerLayerType:
    if isinstance(v, TransformerLayerType):
        return v
    name = getattr(v, "value", v)  # another TransformerLayerType-like enum
    if isinstance(name, str) and name.lower() in ("encoder", "decoder"):
        return TransformerLayerType(name.lower())
    raise ValueError(
        f"TransformerLayer: layer_type must be TransformerLayerType.ENCODER or .DECODER "
        f"(or 'encoder' / 'decoder'), got {v!r}"
    )


class TransformerLayer(nn.Module):
    """TransformerEngine's TransformerLayer (fields, defaults, positional order, parameter names).

    ``decode=True`` (decoder layers) keeps the self-attention's key/value cache as
    :class:`MultiHeadAttention` does, with the relative position bias built for
    ``max_decode_length`` positions. Refused with an error naming the field or argument:
    ``mlp_activation_params`` (clamped SwiGLU). ``transpose_batch_sequence=True`` takes
    ``(seq, batch, hidden)`` inputs. Parameters carry TransformerEngine's logical axis names.

    Sequence parallelism: under ``MeshResource(tpsp_resource=...)`` lowbit's ops split the
    activations between blocks along the sequence over that axis (norms per shard, FP8 all-gather
    before the column-parallel GEMMs, reduce-scatter after the row-parallel ones, attention on
    whole sequences with its heads split). ``enable_sequence_parallel`` does what it does in
    TransformerEngine: the residual stream (the layer's input, each block's output and residual,
    the MLP's input, the output) is constrained to that sequence-split layout, TE's
    ``(BATCH_AXES, SEQLEN_TP_AXES, HIDDEN_AXES)`` (:func:`lowbit.sharding.constrain_sequence`),
    so the layer takes and returns it without resharding; without ``tpsp_resource`` it does
    nothing. The GEMM inputs are not constrained to whole sequences (TE's ``SEQLEN_AXES`` there):
    lowbit's dense gathers them itself, in FP8. With ``transpose_batch_sequence`` the split is
    still on axis 1 (the batch there) and axis 0 over the batch axes, as the ops lay it out."""

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
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[Any] = ("gelu",)
    mlp_activation_params: Optional[dict] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: Any = TransformerLayerType.ENCODER
    self_attn_mask_type: Any = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    relative_embedding: Optional[nn.Module] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"  # attention sinks: DotProductAttention.softmax_type
    score_mod: Optional[Callable] = None  # refused unless None, as DotProductAttention's
    score_mod_bprop: Optional[Callable] = None

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        encoded: Optional[jax.Array] = None,
        attention_mask: Optional[jax.Array] = None,
        encoder_decoder_mask: Optional[jax.Array] = None,
        deterministic: bool = False,
        decode: bool = False,
        max_decode_length: Optional[int] = None,
    ) -> jax.Array:
        layer_type = _layer_type(self.layer_type)
        decoder = layer_type is TransformerLayerType.DECODER
        H, heads = self.hidden_size, self.num_attention_heads
        if (
            not isinstance(heads, (int, np.integer))
            or heads < 1
            or not isinstance(H, (int, np.integer))
            or H % heads
        ):
            raise ValueError(
                f"TransformerLayer: hidden_size ({H!r}) must be a multiple of num_attention_heads ({heads!r})"
            )
        if decode and not decoder:
            raise ValueError(
                "TransformerLayer: decode=True needs layer_type=TransformerLayerType.DECODER "
                "(an encoder has no key/value cache, as in TransformerEngine)"
            )
        if inputs.ndim != 3:
            raise ValueError(
                f"TransformerLayer: inputs must be 3-D ((batch, seq, hidden), or (seq, batch, hidden) with "
                f"transpose_batch_sequence), got shape {tuple(inputs.shape)}"
            )
        # An encoder ignores encoded / encoder_decoder_mask, as TransformerEngine's does.
        if decoder and encoded is None:
            raise ValueError(
                "TransformerLayer: encoded is required when layer_type is TransformerLayerType.DECODER"
            )
        if self.mlp_activation_params is not None:
            raise NotImplementedError(
                "TransformerLayer: mlp_activation_params (clamped SwiGLU parameters) is not "
                "supported by lowbit"
            )
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TransformerLayer: {name} must be in [0, 1), got {getattr(self, name)!r}")
        mlp_lora = lora_scope(self.low_rank_adaptation_scope)[2]  # the attention reads the scope itself
        head_dim = H // heads
        seq_dim = 0 if self.transpose_batch_sequence else 1
        batch_dim = 1 - seq_dim
        seq = inputs.shape[seq_dim]

        attn_bias = None
        if self.enable_relative_embedding:
            rel_emb = self.relative_embedding
            if rel_emb is None:
                rel_emb = RelativePositionBiases(
                    num_buckets=32,
                    max_distance=128,
                    num_attention_heads=heads,
                    dtype=self.dtype,
                    embedding_init=nn.initializers.variance_scaling(
                        1.0, "fan_avg", "uniform", dtype=self.dtype
                    ),
                    name="relpos_bias",
                )
            # A decoding decoder: the bias for max_decode_length positions (the cache's length);
            # the attention takes the row of the cache position.
            n = max_decode_length if decoder and decode and max_decode_length else seq
            # Under a mesh the bias is built per attention shard (sharding.bias_layout): its
            # gradient then sums over the mesh on the table, not on (1, heads, n, n).
            groups = self.num_gqa_groups if self.num_gqa_groups is not None else heads
            layout = bias_layout(inputs.shape[batch_dim], heads, groups)
            if layout is not None and isinstance(rel_emb, RelativePositionBiases):
                attn_bias = rel_emb(n, n, not decoder, layout=layout)
            else:
                attn_bias = rel_emb(n, n, not decoder)

        mha_init = self.mha_kernel_init or nn.initializers.variance_scaling(
            1.0, "fan_in", "normal", dtype=self.dtype
        )

        def attention(name, input_layernorm, attn_mask_type, attn_bias_type):
            # TransformerEngine's TransformerLayer's MultiHeadAttention fields, under its names.
            return MultiHeadAttention(
                num_attention_heads=heads,
                dtype=self.dtype,
                head_dim=head_dim,
                num_gqa_groups=self.num_gqa_groups,
                transpose_batch_sequence=self.transpose_batch_sequence,
                enable_sequence_parallel=self.enable_sequence_parallel,
                attention_dropout=self.attention_dropout,
                dropout_rng_name=self.dropout_rng_name,
                float32_logits=self.float32_attention_logits,
                scale_attn_logits=self.scale_attn_logits,
                scaled_query_init=self.scaled_query_init,
                layernorm_type=self.layernorm_type,
                layernorm_epsilon=self.layernorm_epsilon,
                zero_centered_gamma=self.zero_centered_gamma,
                return_layernorm_output=self.apply_residual_connection_post_layernorm,
                input_layernorm=input_layernorm,
                attn_mask_type=attn_mask_type,
                attn_bias_type=attn_bias_type,
                enable_rotary_pos_emb=self.enable_rotary_pos_emb,
                rotary_pos_emb_windows=self.rotary_pos_emb_windows,
                rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
                low_rank_adaptation_scope=self.low_rank_adaptation_scope,
                low_rank_adaptation_dim=self.low_rank_adaptation_dim,
                low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
                fuse_qkv_params=self.fuse_qkv_params,
                kernel_init=mha_init,
                use_bias=self.use_bias,
                bias_init=self.bias_init,
                window_size=self.window_size,
                softmax_type=self.softmax_type,
                score_mod=self.score_mod,
                score_mod_bprop=self.score_mod_bprop,
                name=name,
            )

        def hidden_dropout(x):
            dims = tuple(self.hidden_dropout_dims)
            if any(not -x.ndim <= d < x.ndim for d in dims):
                raise ValueError(
                    f"TransformerLayer: hidden_dropout_dims {dims} out of range for rank {x.ndim}"
                )
            return nn.Dropout(self.hidden_dropout, broadcast_dims=dims, rng_collection=self.dropout_rng_name)(
                x, deterministic=deterministic
            )

        def drop_path(x):
            if self.drop_path <= 0.0:
                return x
            dims = tuple(d for d in range(x.ndim) if d != batch_dim)  # one draw per sample
            return nn.Dropout(self.drop_path, broadcast_dims=dims, rng_collection=self.dropout_rng_name)(
                x, deterministic=deterministic
            )

        def residual_of(block_input, ln_out):
            if self.apply_residual_connection_post_layernorm:
                return ln_out
            return block_input

        # The residual stream between blocks, split along the sequence (TE's constraints).
        sp = constrain_sequence if self.enable_sequence_parallel else (lambda a: a)
        inputs = sp(inputs)
        x, ln_out = attention(
            "self_attention" if decoder else "attention",
            not self.output_layernorm,
            self.self_attn_mask_type,
            self.self_attn_bias_type,
        )(inputs, inputs, attention_mask, attn_bias, deterministic=deterministic, decode=decode)
        x = drop_path(hidden_dropout(sp(x))) + sp(residual_of(inputs, ln_out))

        mlp_input = x
        if decoder:
            x = sp(x)
            y, ln_out = attention("encoder_decoder_attention", True, "padding", "no_bias")(
                x, encoded, encoder_decoder_mask, deterministic=deterministic
            )
            mlp_input = hidden_dropout(sp(y)) + sp(residual_of(x, ln_out))
        mlp_input = sp(mlp_input)

        z, ln_out = LayerNormMLP(
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.layernorm_epsilon,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            intermediate_dim=self.mlp_hidden_size,
            activations=self.mlp_activations,
            intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            dtype=self.dtype,
            scale_axes=(W_NO_SHARD_AXES,),
            ln_bias_axes=(W_NO_SHARD_AXES,),
            kernel_init=self.mlp_kernel_init,
            kernel_axes_1=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
            kernel_axes_2=(W_TP_AXES, W_FSDP_AXES),
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            bias_axes_1=(W_JOINED_AXES, W_TP_AXES),
            bias_axes_2=(W_NO_SHARD_AXES,),
            enable_low_rank_adaptation=mlp_lora,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            transpose_batch_sequence=self.transpose_batch_sequence,
            name="mlp",
        )(mlp_input, deterministic=deterministic)
        z = drop_path(hidden_dropout(sp(z))) + sp(residual_of(mlp_input, ln_out))

        if self.output_layernorm:
            z = LayerNorm(
                layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma,
                epsilon=self.layernorm_epsilon,
                scale_axes=(W_NO_SHARD_AXES,),
                bias_axes=(W_NO_SHARD_AXES,),
                dtype=self.dtype,
                name="output_layernorm",
            )(z)
        return z.astype(inputs.dtype)


__all__ = ["TransformerLayer", "TransformerLayerType"]
