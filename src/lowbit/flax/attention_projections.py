"""MultiHeadAttention's projections with TransformerEngine's parameter layout and logical axes:
the Q/K/V projections (fused ``qkv``, ``query`` + ``kv``, or ``query``/``key``/``value``) and the
output projection ``out`` (row-parallel under tensor parallelism: its input's heads are split
over tp). Called inside MultiHeadAttention's compact ``__call__``: the submodules are its own.
"""

from __future__ import annotations

from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowbit.flax.dense_general import DenseGeneral, LayerNormDenseGeneral
from lowbit.sharding import W_FSDP_AXES, W_JOINED_AXES, W_NO_SHARD_AXES, W_TP_AXES

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
    """``(qkv_proj, output_proj, mlp)`` of TransformerEngine's ``low_rank_adaptation_scope``."""
    s = "none" if scope is None else scope
    s = s.lower() if isinstance(s, str) else s
    if s not in _LORA_SCOPES:
        raise ValueError(f"low_rank_adaptation_scope must be one of {list(_LORA_SCOPES)}, got {scope!r}")
    qkv = s in ("all", "qkv_proj", "exclude_output_proj", "exclude_mlp")
    out = s in ("all", "output_proj", "exclude_qkv_proj", "exclude_mlp")
    mlp = s in ("all", "mlp", "exclude_qkv_proj", "exclude_output_proj")
    return qkv, out, mlp


def _kernel_init(m):
    """``m.kernel_init``, or TransformerEngine's default (its ``kernel_init=None``)."""
    if m.kernel_init is None:
        return nn.initializers.variance_scaling(1.0, "fan_in", "normal", dtype=m.dtype)
    return m.kernel_init


def _common(m) -> dict:
    """The fields every projection of ``m`` shares."""
    return dict(
        use_bias=m.use_bias,
        bias_init=m.bias_init,
        dtype=m.dtype,
        low_rank_adaptation_dim=m.low_rank_adaptation_dim,
        low_rank_adaptation_alpha=m.low_rank_adaptation_alpha,
    )


def _inits(m, d):
    """``(kernel init, query init, stacked_init(n, first))`` of MultiHeadAttention ``m``."""
    kinit = _kernel_init(m)
    scaled = m.scaled_query_init

    def query_init(key, shape, dtype):
        w = kinit(key, shape, dtype)
        return (w / jnp.sqrt(d).astype(dtype)) if scaled else w

    def stacked_init(n, first):
        # TransformerEngine's qkv_init / kv_init: one draw per slot, each with fan_in = hidden.
        def init(key, shape, dtype):
            if len(shape) != 3 or shape[-2] != n:
                return kinit(key, shape, dtype)
            keys = jax.random.split(key, n)
            parts = [(first if i == 0 else kinit)(keys[i], (shape[0], shape[-1]), dtype) for i in range(n)]
            return jnp.stack(parts, axis=-2).astype(dtype)

        return init

    return kinit, query_init, stacked_init


def _norm(m) -> dict:
    return dict(
        enable_layernorm=m.input_layernorm,
        layernorm_type=m.layernorm_type,
        epsilon=m.layernorm_epsilon,
        zero_centered_gamma=m.zero_centered_gamma,
        scale_axes=(W_NO_SHARD_AXES,),
        ln_bias_axes=(W_NO_SHARD_AXES,),
    )


def fused_qkv_module(m, h: int, d: int, lora_qkv: bool):
    """The fused ``qkv`` LayerNormDenseGeneral of MultiHeadAttention ``m`` (self-attention, g == h)."""
    _, query_init, stacked_init = _inits(m, d)
    return LayerNormDenseGeneral(
        features=(3, h * d),
        kernel_init=stacked_init(3, query_init),
        kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
        bias_axes=(W_JOINED_AXES, W_TP_AXES),
        return_layernorm_output=bool(m.return_layernorm_output),
        enable_low_rank_adaptation=lora_qkv,
        split_features=True,  # q, k, v as three arrays: no split or concat copies
        name="qkv",
        **_norm(m),
        **_common(m),
    )


def qkv_projections(m, inputs_q, inputs_kv, is_self: bool, h: int, g: int, d: int, lora_qkv: bool):
    """``(q, k, v, ln_out)`` of MultiHeadAttention ``m``: q ``(.., .., h*d)``, k and v
    ``(.., .., g*d)``, and the norm output (see MultiHeadAttention for when it is None)."""
    kinit, query_init, stacked_init = _inits(m, d)
    common, norm = _common(m), _norm(m)
    rlo = bool(m.return_layernorm_output)
    if m.fuse_qkv_params and is_self and g == h:
        qkv, ln_out = fused_qkv_module(m, h, d, lora_qkv)(inputs_q)
        if isinstance(qkv, tuple):
            q, k, v = (checkpoint_name(t, "combined_qkv_proj") for t in qkv)
        else:
            qkv = checkpoint_name(qkv, "combined_qkv_proj")
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        q, ln_out = LayerNormDenseGeneral(
            features=h * d,
            kernel_init=query_init,
            kernel_axes=(W_FSDP_AXES, W_TP_AXES),
            bias_axes=(W_TP_AXES,),
            return_layernorm_output=(rlo or is_self) if m.fuse_qkv_params else True,
            enable_low_rank_adaptation=lora_qkv,
            name="query",
            **norm,
            **common,
        )(inputs_q)
        if is_self:
            inputs_kv = ln_out
        if m.fuse_qkv_params:
            kv = DenseGeneral(
                features=(2, g * d),
                kernel_init=stacked_init(2, kinit),
                kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
                bias_axes=(W_JOINED_AXES, W_TP_AXES),
                enable_low_rank_adaptation=lora_qkv,
                name="kv",
                **common,
            )(inputs_kv)
            kv = checkpoint_name(kv, "combined_kv_proj")
            k, v = kv[..., 0, :], kv[..., 1, :]
        else:
            proj = dict(
                features=g * d,
                kernel_init=kinit,
                kernel_axes=(W_FSDP_AXES, W_TP_AXES),
                bias_axes=(W_TP_AXES,),
                enable_low_rank_adaptation=lora_qkv,
                **common,
            )
            k = DenseGeneral(name="key", **proj)(inputs_kv)
            v = DenseGeneral(name="value", **proj)(inputs_kv)
            q = checkpoint_name(q, "query_proj")
            k = checkpoint_name(k, "key_proj")
            v = checkpoint_name(v, "value_proj")
    return q, k, v, ln_out


def out_projection(m, x, features: int, lora_out: bool):
    """The output projection ``out`` of MultiHeadAttention ``m`` on x ``(.., .., h*d)``."""
    return out_module(m, features, lora_out)(x)


def out_module(m, features: int, lora_out: bool):
    """The output projection's DenseGeneral of MultiHeadAttention ``m``."""
    return DenseGeneral(
        features=features,
        kernel_init=_kernel_init(m),
        kernel_axes=(W_TP_AXES, W_FSDP_AXES),
        bias_axes=(W_NO_SHARD_AXES,),
        enable_low_rank_adaptation=lora_out,
        tp_layout="row",  # heads split over tp: the output projection is row-parallel
        name="out",
        **_common(m),
    )
