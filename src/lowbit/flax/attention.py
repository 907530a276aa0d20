"""Attention with TransformerEngine's names: DotProductAttention, MultiHeadAttention.

Attention math is not quantized (as in TransformerEngine's FP8 recipes); its projections are
lowbit GEMMs (:mod:`lowbit.flax.modules`). Without attention dropout, attention runs
``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU when it accepts the shapes and
dtypes, XLA otherwise. With dropout it runs logits -> ``lowbit.softmax`` -> dropout -> values.

Masks follow TransformerEngine: ``True`` means *masked out*, shape ``(batch, 1 or heads, sq, sk)``.
``attn_mask_type``: "no_mask", "padding" (mask required), "causal" (top-left aligned, mask
ignored), "padding_causal" (mask required, causal added).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.modules import (
    DEFAULT_KERNEL_INIT,
    DenseGeneral,
    Initializer,
    LayerNormDenseGeneral,
    check_norm_type,
)
from lowbit.ops.softmax import softmax as _softmax
from lowbit.sharding import tensor_parallel_layout

_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal")
_LAYER_TYPES = ("encoder", "decoder")


def _enum_name(v, name, choices):
    """Accepts a string or an enum member (TransformerEngine's AttnMaskType etc.)."""
    s = getattr(v, "name", v)
    s = s.lower() if isinstance(s, str) else s
    s = {"padding_causal_mask": "padding_causal", "causal_mask": "causal", "padding_mask": "padding"}.get(
        s, s
    )
    if s not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {v!r}")
    return s


def _default_is_gpu() -> bool:
    """Whether attention will run on a GPU: the jax.default_device in effect, else the backend."""
    dev = getattr(jax.config, "jax_default_device", None)
    if dev is not None:
        return getattr(dev, "platform", str(dev)) in ("gpu", "cuda")
    return jax.default_backend() == "gpu"


def _check_mask(mask, mask_type, b, h, sq, sk):
    needs = mask_type in ("padding", "padding_causal")
    if mask is None:
        if needs:
            raise ValueError(
                f"mask is required for attn_mask_type={mask_type!r} (True = masked out, "
                f"shape (batch, 1, sq, sk))"
            )
        return None
    if not needs:
        return None  # TransformerEngine ignores the mask of no_mask/causal types
    mask = jnp.asarray(mask)
    want = (b, h, sq, sk)
    if mask.ndim != 4 or any(m not in (1, w) for m, w in zip(mask.shape, want)) or mask.shape[2:] != (sq, sk):
        raise ValueError(
            f"mask must have shape (batch, 1 or heads, sq, sk) = ({b}, 1 or {h}, {sq}, {sk}) "
            f"(True = masked out), got {tuple(mask.shape)}"
        )
    dt = np.dtype(mask.dtype)
    if not (dt == np.bool_ or np.issubdtype(dt, np.integer)):
        raise TypeError(f"mask must be boolean (True = masked out), got {dt.name}")
    return mask != 0


class DotProductAttention(nn.Module):
    """``softmax(q k^T * scale + bias, masked) v`` with GQA.

    Inputs ``query (b, sq, heads, head_dim)``, ``key``/``value (b, sk, groups, head_dim)``;
    ``num_gqa_groups`` (default: heads) must divide ``num_attention_heads``.
    ``scale_factor`` defaults to ``1/sqrt(head_dim)``."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: Any = "causal"
    dropout_rng_name: str = "dropout"
    scale_factor: Optional[float] = None
    #: None: cuDNN on a GPU where it applies, else XLA; or force "cudnn" / "xla".
    implementation: Optional[str] = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        mask: Optional[jax.Array] = None,
        bias: Optional[jax.Array] = None,
        *,
        deterministic: bool = False,
    ) -> jax.Array:
        mask_type = _enum_name(self.attn_mask_type, "attn_mask_type", _MASK_TYPES)
        h, d = self.num_attention_heads, self.head_dim
        g = self.num_gqa_groups if self.num_gqa_groups is not None else h
        if (
            not isinstance(h, (int, np.integer))
            or h < 1
            or not isinstance(g, (int, np.integer))
            or g < 1
            or h % g
        ):
            raise ValueError(f"num_gqa_groups ({g}) must be a positive divisor of num_attention_heads ({h})")
        if query.ndim != 4 or query.shape[2:] != (h, d):
            raise ValueError(
                f"query must be (batch, sq, num_attention_heads={h}, head_dim={d}), got {query.shape}"
            )
        b, sq = query.shape[:2]
        for name, t in (("key", key), ("value", value)):
            if t.ndim != 4 or t.shape[0] != b or t.shape[2:] != (g, d):
                raise ValueError(
                    f"{name} must be (batch={b}, sk, num_gqa_groups={g}, head_dim={d}), got {t.shape}"
                )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same sequence length, got {key.shape} and {value.shape}"
            )
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        sk = key.shape[1]
        masked = _check_mask(mask, mask_type, b, h, sq, sk)
        causal = mask_type in ("causal", "padding_causal")
        scale = float(self.scale_factor) if self.scale_factor is not None else 1.0 / float(np.sqrt(d))
        dt = query.dtype
        key, value = key.astype(dt), value.astype(dt)
        if bias is not None:
            bias = jnp.asarray(bias).astype(dt)
        if self.attention_dropout > 0 and not deterministic:
            rng = self.make_rng(self.dropout_rng_name)
            return _attention_with_dropout(
                query, key, value, masked, bias, causal, scale, self.attention_dropout, rng
            )
        keep = None if masked is None else jnp.logical_not(masked)
        kw = dict(bias=bias, mask=keep, is_causal=causal, scale=scale)
        if self.implementation not in (None, "cudnn", "xla"):
            raise ValueError(f"implementation must be None, 'cudnn' or 'xla', got {self.implementation!r}")
        if self.implementation == "cudnn":
            return jax.nn.dot_product_attention(query, key, value, implementation="cudnn", **kw)
        half = np.dtype(dt) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
        if self.implementation is None and _default_is_gpu() and half and d % 8 == 0 and d <= 128:
            try:
                return jax.nn.dot_product_attention(query, key, value, implementation="cudnn", **kw)
            except Exception:  # cuDNN refused the configuration at trace time: use XLA
                pass
        return jax.nn.dot_product_attention(query, key, value, implementation="xla", **kw)


def _attention_with_dropout(q, k, v, masked, bias, causal, scale, rate, rng):
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, preferred_element_type=jnp.float32).reshape(b, h, sq, sk)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32) / scale  # lowbit.softmax scales its whole input
    if causal and masked is None and sq == sk:
        probs = _softmax(logits, scale, softmax_type="scaled_upper_triang_masked")
    else:
        if causal:
            tri = jnp.arange(sk)[None, :] > jnp.arange(sq)[:, None]
            masked = tri[None, None] if masked is None else (masked | tri[None, None])
        probs = (
            _softmax(logits, scale, mask=masked, softmax_type="scaled_masked")
            if masked is not None
            else _softmax(logits, scale)
        )
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - rate), 0.0).astype(q.dtype)
    out = jnp.einsum(
        "bgrqk,bkgd->bqgrd", probs.reshape(b, g, h // g, sq, sk), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, sq, h, d).astype(q.dtype)


class MultiHeadAttention(nn.Module):
    """(Norm +) fused QKV projection, DotProductAttention (GQA, masks, dropout), output projection.

    Self-attention (``inputs_kv is inputs_q``) projects Q, K and V with one GEMM; cross-attention
    projects Q from ``inputs_q`` and K, V (one GEMM) from ``inputs_kv``. Returns
    ``(out, residual)``: ``residual`` is the norm output with ``return_layernorm_output`` and
    ``inputs_q`` otherwise (as in TransformerEngine)."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    return_layernorm_output: bool = False
    kernel_init: Initializer = DEFAULT_KERNEL_INIT
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: Any = "causal"
    scale_factor: Optional[float] = None
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: Optional[jax.Array] = None,
        mask: Optional[jax.Array] = None,
        bias: Optional[jax.Array] = None,
        *,
        deterministic: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        h, d = self.num_attention_heads, self.head_dim
        g = self.num_gqa_groups if self.num_gqa_groups is not None else h
        if not isinstance(h, (int, np.integer)) or h < 1:
            raise ValueError(f"num_attention_heads must be a positive int, got {h!r}")
        if not isinstance(g, (int, np.integer)) or g < 1 or h % g:
            raise ValueError(f"num_gqa_groups ({g}) must be a positive divisor of num_attention_heads ({h})")
        check_norm_type(self.layernorm_type)
        self_attn = inputs_kv is None or inputs_kv is inputs_q
        hidden = inputs_q.shape[-1]
        common = dict(
            kernel_init=self.kernel_init,
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            dtype=self.dtype,
            enable_low_rank_adaptation=self.enable_low_rank_adaptation,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
        )
        norm = dict(
            enable_layernorm=self.input_layernorm,
            layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=True,
        )
        lead = inputs_q.shape[:-1]
        if self_attn:
            qkv, ln_out = LayerNormDenseGeneral(
                features=(h + 2 * g) * d,
                kernel_axes=("embed", "joined_kv"),
                bias_axes=("joined_kv",),
                name="qkv",
                **norm,
                **common,
            )(inputs_q)
            q, k, v = jnp.split(qkv, [h * d, (h + g) * d], axis=-1)
        else:
            q, ln_out = LayerNormDenseGeneral(
                features=h * d,
                kernel_axes=("embed", "joined_kv"),
                bias_axes=("joined_kv",),
                name="query",
                **norm,
                **common,
            )(inputs_q)
            kv = DenseGeneral(
                features=2 * g * d,
                kernel_axes=("embed", "joined_kv"),
                bias_axes=("joined_kv",),
                name="kv",
                **common,
            )(inputs_kv)
            k, v = jnp.split(kv, 2, axis=-1)
        kv_lead = k.shape[:-1]
        q = q.reshape(lead + (h, d))
        k, v = k.reshape(kv_lead + (g, d)), v.reshape(kv_lead + (g, d))
        x = DotProductAttention(
            head_dim=d,
            num_attention_heads=h,
            num_gqa_groups=g,
            attention_dropout=self.attention_dropout,
            attn_mask_type=self.attn_mask_type,
            dropout_rng_name=self.dropout_rng_name,
            scale_factor=self.scale_factor,
            dtype=self.dtype,
            name="attention",
        )(q, k, v, mask, bias, deterministic=deterministic)
        x = x.reshape(lead + (h * d,))
        with tensor_parallel_layout("row"):  # heads split over tp: the output projection is row-parallel
            out = DenseGeneral(
                features=hidden,
                kernel_axes=("joined_kv", "embed"),
                bias_axes=("embed",),
                name="out",
                **common,
            )(x)
        return out, (ln_out if self.return_layernorm_output else inputs_q)


__all__ = ["DotProductAttention", "MultiHeadAttention"]
