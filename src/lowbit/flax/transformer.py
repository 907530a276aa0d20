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

The attention fields go to :class:`lowbit.flax.MultiHeadAttention` under its (TransformerEngine's)
field names. Until that module has all of them, :func:`_mha_kwargs` drops a missing field whose
value matches what the module already does and refuses the others, naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.attention import MultiHeadAttention
from lowbit.flax.modules import Initializer, LayerNorm, LayerNormMLP


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


_LORA_SCOPES = (
    "none",
    "all",
    "qkv_proj",
    "output_proj",
    "mlp",
    "exclude_qkv_proj",
    "exclude_output_proj",
    "exclude_mlp",
)


def lora_scope(scope) -> Tuple[bool, bool, bool]:
    """TransformerEngine's ``low_rank_adaptation_scope`` -> (qkv_proj, output_proj, mlp)."""
    s = "none" if scope is None else scope
    if not isinstance(s, str) or s.lower() not in _LORA_SCOPES:
        raise ValueError(f"low_rank_adaptation_scope must be one of {list(_LORA_SCOPES)}, got {scope!r}")
    s = s.lower()
    if s == "none":
        return False, False, False
    if s == "all":
        return True, True, True
    if s.startswith("exclude_"):
        ex = s[len("exclude_") :]
        return ex != "qkv_proj", ex != "output_proj", ex != "mlp"
    return s == "qkv_proj", s == "output_proj", s == "mlp"


def _relative_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's bucket of each (query, key) distance, as TransformerEngine's RelativePositionBiases:
    exact buckets for small distances, logarithmic ones up to ``max_distance``."""
    n = np.arange(q_len, dtype=np.int64)[:, None] - np.arange(k_len, dtype=np.int64)[None, :]
    bucket = np.zeros_like(n)
    nb = num_buckets
    if bidirectional:
        nb //= 2
        bucket += (n < 0).astype(np.int64) * nb
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    exact = nb // 2
    with np.errstate(divide="ignore"):
        log_part = np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps) / np.log(
            max_distance / exact
        )
    large = np.minimum(exact + (log_part * (nb - exact)).astype(np.int64), nb - 1)
    return bucket + np.where(n < exact, n, large)


class _RelativePositionBiases(nn.Module):
    """Stand-in for the attention module's RelativePositionBiases until that lands on this
    branch: same parameter (``rel_embedding``, (heads, num_buckets)), same buckets, output
    ``(1, heads, q_seqlen, k_seqlen)``."""

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    embedding_axes: Tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen, k_seqlen, bidirectional=True):
        buckets = _relative_buckets(q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional)
        table = self.param(
            "rel_embedding",
            nn.with_logical_partitioning(self.embedding_init, self.embedding_axes),
            (self.num_attention_heads, self.num_buckets),
            self.dtype,
        )
        return jnp.asarray(table, self.dtype)[:, buckets][None]


def _relative_position_biases_cls():
    import lowbit.flax as lf  # lowbit.flax imports this module: look the class up at call time

    return getattr(lf, "RelativePositionBiases", _RelativePositionBiases)


def _norm_name(v):
    s = getattr(v, "name", v)
    return s.lower() if isinstance(s, str) else s


def _mask_type(v):
    """TransformerEngine accepts 'causal_padding' for 'padding_causal'; other values go to the
    attention module as given (it validates them)."""
    s = _norm_name(v)
    return "padding_causal" if s in ("causal_padding", "causal_padding_mask") else v


# ---- pre-merge shim: TransformerEngine's MultiHeadAttention fields lowbit's module may lack ----
def _mha_kwargs(kw: dict, head_dim: int, has_bias: bool) -> Tuple[dict, bool]:
    """``kw`` (TransformerEngine's MultiHeadAttention field names) filtered to the fields lowbit's
    MultiHeadAttention has. A missing field whose value is what the module does anyway is
    dropped; ``scale_attn_logits`` becomes ``scale_factor`` and ``low_rank_adaptation_scope``
    ``enable_low_rank_adaptation`` where those are the module's fields; other missing fields
    raise, naming the field. Returns (kwargs, whether the caller must transpose (seq, batch)
    inputs to batch-first itself)."""
    fields = {f.name for f in dataclasses.fields(MultiHeadAttention)}
    out, transpose = {}, False
    rotary = kw.get("enable_rotary_pos_emb", False)
    for name, value in kw.items():
        if name in fields:
            out[name] = value
            continue
        if name == "transpose_batch_sequence":
            transpose = bool(value)
        elif name == "scale_attn_logits" and "scale_factor" in fields:
            out["scale_factor"] = 1.0 / math.sqrt(head_dim) if value else 1.0
        elif name == "low_rank_adaptation_scope" and "enable_low_rank_adaptation" in fields:
            qkv, proj, _ = lora_scope(value)
            if qkv != proj:
                raise NotImplementedError(
                    f"TransformerLayer: low_rank_adaptation_scope={value!r} needs "
                    "MultiHeadAttention.low_rank_adaptation_scope (LoRA on only some attention projections)"
                )
            out["enable_low_rank_adaptation"] = qkv
        elif name in ("rotary_pos_emb_windows", "rotary_pos_emb_group_method") and not rotary:
            pass  # unused without rotary embedding
        elif name == "attn_bias_type" and (
            value is None
            or _norm_name(value) == "post_scale_bias"
            or (_norm_name(value) == "no_bias" and not has_bias)
        ):
            pass  # the module adds a bias after scaling, as post_scale_bias does
        elif name == "scaled_query_init":
            pass  # an initialiser choice: the module's query init is unscaled until it has the field
        elif value != _MHA_PRE_MERGE.get(name, object()):
            raise NotImplementedError(
                f"TransformerLayer: {name}={value!r} needs MultiHeadAttention.{name}, which lowbit's "
                "MultiHeadAttention does not have yet"
            )
    return out, transpose


#: What lowbit's MultiHeadAttention did before it had these fields.
_MHA_PRE_MERGE = {
    "enable_sequence_parallel": False,
    "float32_logits": False,
    "enable_rotary_pos_emb": False,
    "fuse_qkv_params": True,
    "window_size": None,
}


class TransformerLayer(nn.Module):
    """TransformerEngine's TransformerLayer (fields, defaults, positional order, parameter names).

    Refused with an error naming the field or argument: ``decode=True`` (autoregressive cache),
    ``mlp_activation_params`` (clamped SwiGLU). ``transpose_batch_sequence=True`` takes
    ``(seq, batch, hidden)`` inputs. ``enable_sequence_parallel`` and TransformerEngine's
    activation sharding constraints are not applied by the layer itself (parameters carry
    TransformerEngine's logical axis names)."""

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
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[Any] = ("relu",)
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
        from lowbit.te.sharding import W_FSDP_AXES, W_JOINED_AXES, W_NO_SHARD_AXES, W_TP_AXES

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
        if decode:
            raise NotImplementedError(
                "TransformerLayer: decode=True (the autoregressive key/value cache) is not "
                "supported by lowbit"
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
        qkv_lora, out_lora, mlp_lora = lora_scope(self.low_rank_adaptation_scope)
        del qkv_lora, out_lora  # the attention module reads the scope itself
        head_dim = H // heads
        seq_dim = 0 if self.transpose_batch_sequence else 1
        batch_dim = 1 - seq_dim
        seq = inputs.shape[seq_dim]

        attn_bias = None
        if self.enable_relative_embedding:
            rel_emb = self.relative_embedding
            if rel_emb is None:
                rel_emb = _relative_position_biases_cls()(
                    num_buckets=32,
                    max_distance=128,
                    num_attention_heads=heads,
                    dtype=self.dtype,
                    embedding_init=nn.initializers.variance_scaling(
                        1.0, "fan_avg", "uniform", dtype=self.dtype
                    ),
                    name="relpos_bias",
                )
            attn_bias = rel_emb(seq, seq, not decoder)

        mha_init = self.mha_kernel_init or nn.initializers.variance_scaling(
            1.0, "fan_in", "normal", dtype=self.dtype
        )
        common = dict(
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
        )

        def attention(name, q, kv, mask, bias, **fields):
            kw, transpose = _mha_kwargs({**common, **fields}, head_dim, bias is not None)
            mha = MultiHeadAttention(name=name, **kw)
            if transpose:  # the module is batch-first until it has transpose_batch_sequence
                t = lambda a: None if a is None else jnp.swapaxes(a, 0, 1)
                q_t = t(q)
                y, ln = mha(q_t, q_t if kv is q else t(kv), mask, bias, deterministic=deterministic)
                return t(y), t(ln)
            return mha(q, kv, mask, bias, deterministic=deterministic)

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

        x, ln_out = attention(
            "self_attention" if decoder else "attention",
            inputs,
            inputs,
            attention_mask,
            attn_bias,
            input_layernorm=not self.output_layernorm,
            attn_mask_type=_mask_type(self.self_attn_mask_type),
            attn_bias_type=self.self_attn_bias_type,
        )
        x = drop_path(hidden_dropout(x)) + residual_of(inputs, ln_out)

        mlp_input = x
        if decoder:
            y, ln_out = attention(
                "encoder_decoder_attention",
                x,
                encoded,
                encoder_decoder_mask,
                None,
                input_layernorm=True,
                attn_mask_type="padding",
                attn_bias_type="no_bias",
            )
            mlp_input = hidden_dropout(y) + residual_of(x, ln_out)

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
        z = drop_path(hidden_dropout(z)) + residual_of(mlp_input, ln_out)

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
