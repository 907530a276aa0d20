"""Attention with TransformerEngine's names, fields, defaults and parameter layout:
DotProductAttention and MultiHeadAttention (docs/te_modules_attention.md lists every field).

Attention math is not quantized (as in TransformerEngine's FP8 recipes); the projections are lowbit
GEMMs (:mod:`lowbit.flax.modules`). Paths:

* no dropout (``attention_dropout == 0`` or ``deterministic``): ``jax.nn.dot_product_attention``,
  cuDNN's fused kernel on a GPU when it takes the shapes and dtypes, XLA otherwise;
* dropout on a GPU (bf16/fp16, head_dim a multiple of 8 up to 128): cuDNN's fused attention with
  dropout (``jax._src.cudnn.fused_attention_stablehlo``); its random stream is cuDNN's (a seed
  per module path, an offset that advances with every execution), not ``dropout_rng_name``'s;
* dropout otherwise (CPU, float32): logits -> ``lowbit.softmax`` -> dropout drawn from the
  ``dropout_rng_name`` stream -> values (float32 logits and softmax).

Masks follow TransformerEngine: ``True`` means *masked out*, shape ``(batch, 1 or heads, sq, sk)``.
Causal types mask key ``j > i`` for query ``i`` ("causal", "padding_causal": top-left aligned) or
``j > i + sk - sq`` (the ``*_bottom_right`` types). ``window_size=(left, right)`` keeps keys in
``[i' - left, i' + right]`` (negative: unbounded), ``i'`` aligned like the causal mask; all masks
combine (a key is kept only if every one keeps it). A query row with every key masked out has an
unspecified output (the paths differ there, as TransformerEngine's backends do).
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowbit.flax.modules import DenseGeneral, LayerNormDenseGeneral, check_norm_type, split_first_feature_axis
from lowbit.flax.positions import canonical_group_method, check_rotary_windows, rotary_pos_emb
from lowbit.ops.softmax import softmax as _softmax
from lowbit.sharding import tensor_parallel_layout

Initializer = Callable[..., Any]

_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
_MASK_ALIASES = {
    "no_mask": "no_mask",
    "padding_mask": "padding",
    "causal_mask": "causal",
    "causal_padding": "padding_causal",
    "padding_causal_mask": "padding_causal",
    "bottom_right_causal": "causal_bottom_right",
    "causal_bottom_right_mask": "causal_bottom_right",
    "causal_padding_bottom_right": "padding_causal_bottom_right",
    "bottom_right_causal_padding": "padding_causal_bottom_right",
    "bottom_right_padding_causal": "padding_causal_bottom_right",
    "padding_causal_bottom_right_mask": "padding_causal_bottom_right",
}
_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
_QKV_LAYOUTS = ("bs3hd", "bshd_bs2hd", "bshd_bshd_bshd")
_THD_LAYOUTS = ("t3hd", "thd_t2hd", "thd_thd_thd")
_CP_STRATEGIES = ("DEFAULT", "ALL_GATHER", "ALLGATHER", "RING")
_LAYER_TYPES = ("encoder", "decoder")
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

# TransformerEngine's logical axis names of the weights (lowbit.te.sharding has the same strings;
# lowbit.te.flax.extend_logical_axis_rules maps them onto the MeshResource).
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


def _enum_name(v, name, choices):
    """A string or an enum member (TransformerEngine's AttnMaskType etc.), canonicalised."""
    s = getattr(v, "name", v)
    s = s.lower() if isinstance(s, str) else s
    s = _MASK_ALIASES.get(s, s) if isinstance(s, str) else s
    if s not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {v!r}")
    return s


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


def _check_window(window_size):
    """None, or ``(left, right)`` ints (negative = unbounded)."""
    if window_size is None:
        return None
    try:
        left, right = window_size
        ok = all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"window_size must be None or a pair (left, right) of ints (negative = unbounded), "
            f"got {window_size!r}"
        )
    return int(left), int(right)


# Traces whose body XLA runs repeatedly: cuDNN's dropout inside them aborts XLA (jax 0.11.2, H100:
# "Fatal Python error: Aborted" compiling lax.scan over the attention), so dropout there takes the
# reference path.
_LOOP_TRACES = ("scan", "while", "fori_loop", "map")


def _traced_in_loop() -> bool:
    """Whether the current trace, or one it is nested in, traces a loop body (lax.scan, nn.scan,
    while/fori loops). Reads JAX's trace stack (private); if that is not readable, answers True
    so that dropout takes the safe reference path."""
    try:
        from jax._src import core

        t = core.trace_ctx.trace
        while t is not None:
            frame = getattr(t, "frame", None)
            what = getattr(getattr(frame, "debug_info", None), "traced_for", "") or ""
            if any(w in what for w in _LOOP_TRACES):
                return True
            t = getattr(t, "parent_trace", None)
        return False
    except Exception:
        return True


def _cudnn_dropout_allowed(implementation) -> bool:
    """cuDNN's fused attention with dropout crashes XLA (jax 0.11.2, H100) when XLA records the
    cuDNN call into a command buffer (CUDA graph): "Check failed: local_device_ordinal.has_value()"
    in cuda_dnn.cc at the first execution of a full layer. It runs when asked for explicitly
    (``implementation="cudnn"`` or ``LOWBIT_CUDNN_DROPOUT=1``) or when XLA_FLAGS sets
    ``--xla_gpu_enable_command_buffer`` to a list without CUDNN; otherwise dropout takes the
    reference path."""
    if implementation == "cudnn" or os.environ.get("LOWBIT_CUDNN_DROPOUT", "") == "1":
        return True
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_gpu_enable_command_buffer="):
            return "CUDNN" not in flag.split("=", 1)[1].upper()
    return False


def _default_is_gpu() -> bool:
    """Whether attention will run on a GPU: the jax.default_device in effect, else the backend."""
    dev = getattr(jax.config, "jax_default_device", None)
    if dev is not None:
        return getattr(dev, "platform", str(dev)) in ("gpu", "cuda")
    return jax.default_backend() == "gpu"


def _check_mask(mask, mask_type, b, h, sq, sk):
    """The user mask of the padding types, validated; None for the others (TE ignores it)."""
    needs = mask_type.startswith("padding")
    if mask is None:
        if needs:
            raise ValueError(
                f"mask is required for attn_mask_type={mask_type!r} (True = masked out, "
                f"shape (batch, 1, sq, sk))"
            )
        return None
    if not needs:
        return None  # TransformerEngine ignores the mask of the no_mask/causal types
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise NotImplementedError(
            f"DotProductAttention: sequence_descriptor must be a boolean mask array (True = masked "
            f"out); TransformerEngine's SequenceDescriptor (seqlens, offsets, segment ids) is not "
            f"supported, got {type(mask).__name__}"
        )
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


def static_mask(mask_type: str, window, sq: int, sk: int) -> Optional[np.ndarray]:
    """The causal / sliding-window part of the mask, ``(sq, sk)`` bool (True = masked out), or
    None when there is none."""
    off = sk - sq if mask_type.endswith("bottom_right") else 0
    i = np.arange(sq)[:, None] + off
    j = np.arange(sk)[None, :]
    out = np.zeros((sq, sk), bool)
    if "causal" in mask_type:
        out |= j > i
    if window is not None:
        left, right = window
        if left >= 0:
            out |= j < i - left
        if right >= 0:
            out |= j > i + right
    return out if out.any() else None


class DotProductAttention(nn.Module):
    """``softmax(scale * q k^T + bias, masked) v`` with GQA (TransformerEngine's fields).

    Inputs per ``qkv_layout``: "bshd_bshd_bshd" ``query (b, sq, heads, d)``, ``key``/``value
    (b, sk, groups, d)``; "bshd_bs2hd" ``key (b, sk, 2, groups, d)`` (``value`` ignored);
    "bs3hd" ``query (b, s, 3, heads, d)`` (``key``/``value`` ignored). With
    ``transpose_batch_sequence`` (TransformerEngine's default, True) the first two axes are
    ``(seq, batch)`` instead, for the inputs and the output. ``scale_factor`` defaults to
    ``1/sqrt(head_dim)``. ``attn_bias_type`` None: "post_scale_bias" with a bias, else "no_bias";
    "pre_scale_bias" is ``softmax(scale * (q k^T + bias))``. ``float32_logits`` is accepted and
    always in effect (lowbit's logits and softmax are float32 on every path)."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: Any = "causal"
    attn_bias_type: Any = None
    dtype: Any = jnp.float32
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: Optional[float] = None
    transpose_batch_sequence: bool = True
    window_size: Optional[Tuple[int, int]] = None
    max_segments_per_seq: Optional[int] = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    #: lowbit: None = cuDNN on a GPU where it applies, else XLA; or force "cudnn" / "xla".
    implementation: Optional[str] = None

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        sequence_descriptor: Optional[jax.Array] = None,
        bias: Optional[jax.Array] = None,
        *,
        deterministic: bool = False,
        mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError("sequence_descriptor and mask cannot be provided at the same time")
            sequence_descriptor = mask
        self._check_unsupported()
        mask_type = _enum_name(self.attn_mask_type, "attn_mask_type", _MASK_TYPES)
        bias_type = self._bias_type(bias)
        layout = _enum_name(self.qkv_layout, "qkv_layout", _QKV_LAYOUTS + _THD_LAYOUTS)
        if layout in _THD_LAYOUTS:
            raise NotImplementedError(
                f"qkv_layout={self.qkv_layout!r}: the THD layouts (sequence packing) are not supported "
                f"by lowbit; use one of {list(_QKV_LAYOUTS)}"
            )
        window = _check_window(self.window_size)
        rate = self.attention_dropout
        if not isinstance(rate, (int, float, np.floating)) or not 0.0 <= rate < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {rate!r}")
        if self.implementation not in (None, "cudnn", "xla"):
            raise ValueError(f"implementation must be None, 'cudnn' or 'xla', got {self.implementation!r}")

        query, key, value = self._unpack(layout, query, key, value)
        if self.transpose_batch_sequence:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        h, d = self.num_attention_heads, self.head_dim
        g = self.num_gqa_groups if self.num_gqa_groups is not None else h
        if not all(isinstance(n, (int, np.integer)) and n >= 1 for n in (h, g)) or h % g:
            raise ValueError(f"num_gqa_groups ({g}) must be a positive divisor of num_attention_heads ({h})")
        sb = "(sq, batch" if self.transpose_batch_sequence else "(batch, sq"
        if query.ndim != 4 or query.shape[2:] != (h, d):
            raise ValueError(
                f"query must be {sb}, num_attention_heads={h}, head_dim={d}), got "
                f"{jnp.swapaxes(query, 0, 1).shape if self.transpose_batch_sequence else query.shape}"
            )
        b, sq = query.shape[:2]
        for name, t in (("key", key), ("value", value)):
            if t.ndim != 4 or t.shape[0] != b or t.shape[2:] != (g, d):
                raise ValueError(
                    f"{name} must be (batch={b}, sk, num_gqa_groups={g}, head_dim={d}) in the (batch, seq) "
                    f"order, got {t.shape}"
                )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same sequence length, got {key.shape} and {value.shape}"
            )
        sk = key.shape[1]

        padding = _check_mask(sequence_descriptor, mask_type, b, h, sq, sk)
        tri = static_mask(mask_type, window, sq, sk)
        masked = padding
        if tri is not None:
            masked = jnp.asarray(tri)[None, None] if masked is None else (masked | tri[None, None])
        # The causal triangle alone, square: the fused causal kernels apply.
        plain_causal = padding is None and window is None and "causal" in mask_type and sq == sk
        scale = float(self.scale_factor) if self.scale_factor is not None else 1.0 / math.sqrt(d)
        dt = query.dtype
        key, value = key.astype(dt), value.astype(dt)
        if bias is not None:
            bias = jnp.asarray(bias)
            if bias.ndim != 4 or any(m not in (1, w) for m, w in zip(bias.shape, (b, h, sq, sk))):
                raise ValueError(
                    f"bias must have shape (1 or batch, 1 or heads, sq, sk) = "
                    f"(1 or {b}, 1 or {h}, {sq}, {sk}), "
                    f"got {tuple(bias.shape)}"
                )

        if rate > 0 and not deterministic:
            # Drawn on every path (the dropout stream is required, as in TransformerEngine), used
            # by the reference path; cuDNN's dropout has its own generator.
            rng = self.make_rng(self.dropout_rng_name)
            out = None
            if (
                self._use_cudnn(dt, d)
                and not _traced_in_loop()
                and _cudnn_dropout_allowed(self.implementation)
            ):
                # A seed per module path: layers with the same shapes draw different masks.
                seed = zlib.crc32("/".join(str(p) for p in self.scope.path).encode()) & 0x7FFFFFFF
                try:
                    out = cudnn_attention_dropout(
                        query, key, value, masked, bias, bias_type, scale, rate, seed, plain_causal
                    )
                except Exception:
                    if self.implementation == "cudnn":
                        raise
            if out is None:
                out = attention_reference(
                    query, key, value, masked, bias, bias_type, scale, rate, rng, plain_causal
                )
        else:
            # A square causal mask with a left window (no padding): the fused kernels' own
            # sliding window (cuDNN's sliding_window_length) instead of an explicit mask.
            local = None
            if (
                padding is None
                and "causal" in mask_type
                and sq == sk
                and window is not None
                and window[0] >= 0
            ):
                local = (window[0], 0)
            out = self._fast(query, key, value, masked, bias, bias_type, scale, plain_causal, local)
        out = checkpoint_name(out, self.context_checkpoint_name)
        return jnp.swapaxes(out, 0, 1) if self.transpose_batch_sequence else out

    def _check_unsupported(self):
        if self.max_segments_per_seq not in (None, 1):
            raise NotImplementedError(
                f"max_segments_per_seq={self.max_segments_per_seq!r}: several segments per sequence "
                f"(sequence packing) are not supported by lowbit; leave it at 1"
            )
        if self.context_parallel_causal_load_balanced:
            raise NotImplementedError(
                "context_parallel_causal_load_balanced=True: context parallelism is not supported by lowbit"
            )
        if self.context_parallel_axis:
            raise NotImplementedError(
                f"context_parallel_axis={self.context_parallel_axis!r}: context parallelism is not "
                f"supported by lowbit; leave it ''"
            )
        s = self.context_parallel_strategy
        if getattr(s, "name", s) is None or str(getattr(s, "name", s)).upper() not in _CP_STRATEGIES:
            raise ValueError(
                f"context_parallel_strategy must be one of {list(_CP_STRATEGIES)} (case insensitive), "
                f"got {s!r}"
            )
        if not isinstance(self.context_checkpoint_name, str):
            raise TypeError(f"context_checkpoint_name must be a str, got {self.context_checkpoint_name!r}")

    def _bias_type(self, bias):
        if self.attn_bias_type is None:
            return "no_bias" if bias is None else "post_scale_bias"
        t = _enum_name(self.attn_bias_type, "attn_bias_type", _BIAS_TYPES)
        if t == "no_bias" and bias is not None:
            raise ValueError("attn_bias_type='no_bias' but a bias was given")
        if t != "no_bias" and bias is None:
            raise ValueError(f"attn_bias_type={t!r} needs a bias (shape (1 or batch, heads, sq, sk))")
        return t

    def _unpack(self, layout, query, key, value):
        if layout == "bs3hd":
            if query.ndim != 5 or query.shape[2] != 3:
                raise ValueError(
                    f"qkv_layout='bs3hd': query must be (b, s, 3, heads, head_dim), got {query.shape}"
                )
            return query[:, :, 0], query[:, :, 1], query[:, :, 2]
        if layout == "bshd_bs2hd":
            if key.ndim != 5 or key.shape[2] != 2:
                raise ValueError(
                    f"qkv_layout='bshd_bs2hd': key must be (b, s, 2, groups, head_dim), got {key.shape}"
                )
            return query, key[:, :, 0], key[:, :, 1]
        return query, key, value

    def _use_cudnn(self, dt, d) -> bool:
        if self.implementation == "cudnn":
            return True
        half = np.dtype(dt) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
        return self.implementation is None and _default_is_gpu() and half and d % 8 == 0 and d <= 128

    def _fast(self, query, key, value, masked, bias, bias_type, scale, plain_causal, local=None):
        if bias is not None:
            bias = bias.astype(query.dtype)
            if bias_type == "pre_scale_bias":  # softmax(scale * (qk + bias))
                bias = (bias * scale).astype(query.dtype)
        if local is not None:
            kw = dict(bias=bias, mask=None, is_causal=True, scale=scale, local_window_size=local)
        else:
            keep = None if (masked is None or plain_causal) else jnp.logical_not(masked)
            kw = dict(bias=bias, mask=keep, is_causal=plain_causal, scale=scale)
        if self.implementation == "cudnn":
            return jax.nn.dot_product_attention(query, key, value, implementation="cudnn", **kw)
        if self._use_cudnn(query.dtype, query.shape[-1]):
            try:
                return jax.nn.dot_product_attention(query, key, value, implementation="cudnn", **kw)
            except Exception:  # cuDNN refused the configuration at trace time: use XLA
                pass
        return jax.nn.dot_product_attention(query, key, value, implementation="xla", **kw)


def attention_reference(q, k, v, masked, bias, bias_type, scale, rate, rng, plain_causal=False):
    """logits (float32) -> ``lowbit.softmax`` -> dropout (``rate``, from ``rng``) -> values.

    ``q (b, sq, h, d)``, ``k``/``v (b, sk, g, d)``, ``masked`` True = out (broadcastable to
    ``(b, h, sq, sk)``) or None; ``plain_causal``: the mask is exactly the square causal triangle."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, preferred_element_type=jnp.float32).reshape(b, h, sq, sk)
    smax_scale = scale
    if bias is not None:
        if bias_type == "pre_scale_bias":
            logits = logits + bias.astype(jnp.float32)
        else:
            logits = logits * scale + bias.astype(jnp.float32)
            smax_scale = 1.0
    if plain_causal:
        probs = _softmax(logits, smax_scale, softmax_type="scaled_upper_triang_masked")
    elif masked is not None:
        probs = _softmax(logits, smax_scale, mask=masked, softmax_type="scaled_masked")
    else:
        probs = _softmax(logits, smax_scale)
    if rate > 0:
        keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
    probs = probs.astype(q.dtype)
    out = jnp.einsum(
        "bgrqk,bkgd->bqgrd", probs.reshape(b, g, h // g, sq, sk), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, sq, h, d).astype(q.dtype)


def cudnn_attention_dropout(q, k, v, masked, bias, bias_type, scale, rate, seed, plain_causal=False):
    """cuDNN's fused attention with dropout (GPU, bf16/fp16): same inputs as
    :func:`attention_reference`; the dropout stream is cuDNN's (``seed`` and an offset that
    advances with every execution of the compiled program)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

    if bias is not None:
        bias = bias.astype(q.dtype)
        if bias_type == "pre_scale_bias":
            bias = (bias * scale).astype(q.dtype)
    keep = None if (masked is None or plain_causal) else jnp.logical_not(masked)
    return cudnn_dpa(
        q,
        k,
        v,
        bias,
        keep,
        scale=scale,
        mask_type=MaskType.CAUSAL if plain_causal else MaskType.NO_MASK,
        seed=int(seed),
        dropout_rate=float(rate),
        qkv_layout="BTNH",
    )


class MultiHeadAttention(nn.Module):
    """(Norm +) Q/K/V projections, DotProductAttention, output projection (TransformerEngine's
    fields, defaults and parameter layout).

    Parameters (``H`` = hidden, ``h`` heads, ``g`` groups, ``d`` head_dim), as TransformerEngine:

    * ``fuse_qkv_params`` and self-attention with ``g == h``: ``qkv`` (norm ``scale``/``ln_bias``,
      ``kernel (H, 3, h*d)``, ``bias (3, h*d)``);
    * ``fuse_qkv_params`` otherwise (GQA or cross-attention): ``query`` (norm + ``kernel
      (H, h*d)``) and ``kv`` (``kernel (H, 2, g*d)``, ``bias (2, g*d)``);
    * ``fuse_qkv_params=False``: ``query`` (norm + kernel), ``key`` and ``value`` (``(H, g*d)``);
    * ``out``: ``kernel (h*d, H)``, ``bias (H,)``.

    Self-attention (``inputs_kv is inputs_q``, or None) projects K and V from the norm output;
    cross-attention from ``inputs_kv`` as given. ``scaled_query_init`` divides the query kernel's
    initial values by ``sqrt(head_dim)`` and ``scale_attn_logits`` (default False) scales the
    logits by ``1/sqrt(head_dim)``: by default the logits are not scaled (TransformerEngine's
    T5 convention). Returns ``(out, ln_out)``: ``ln_out`` is the norm output when
    ``return_layernorm_output`` (and, as in TransformerEngine, for self-attention without the
    fused ``qkv``), else None. ``decode=True`` keeps TransformerEngine's key/value cache
    (collection "cache"): the call that creates it attends normally, each later call takes one
    position and attends to the cached keys up to it."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Optional[Initializer] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: Any = "causal"
    attn_bias_type: Any = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = True
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    # Deprecated in TransformerEngine (same handling here)
    num_heads: Optional[int] = None
    dropout_rate: Optional[float] = None
    output_layernorm: Optional[bool] = None
    apply_residual_connection_post_layernorm: Optional[bool] = None
    fuse_qkv: Optional[bool] = None

    def _deprecated(self):
        h, rate = self.num_attention_heads, self.attention_dropout
        cls = type(self).__name__
        if self.num_heads is not None:
            warnings.warn(f"{cls}.num_heads is deprecated; use num_attention_heads", DeprecationWarning)
            h = self.num_heads
        if self.dropout_rate is not None:
            warnings.warn(f"{cls}.dropout_rate is deprecated; use attention_dropout", DeprecationWarning)
            rate = self.dropout_rate
        if self.apply_residual_connection_post_layernorm is not None:
            warnings.warn(
                f"{cls}.apply_residual_connection_post_layernorm is deprecated (and, as in "
                f"TransformerEngine, has no effect); use return_layernorm_output",
                DeprecationWarning,
            )
        if self.fuse_qkv is not None:
            warnings.warn(
                f"{cls}.fuse_qkv is deprecated (and, as in TransformerEngine, has no effect); "
                f"use fuse_qkv_params",
                DeprecationWarning,
            )
        if self.output_layernorm is not None:
            raise ValueError(
                f"{cls}.output_layernorm is deprecated and must stay None; use input_layernorm to "
                f"choose whether the input is normalized"
            )
        return h, rate

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: Optional[jax.Array] = None,
        mask: Optional[jax.Array] = None,
        bias: Optional[jax.Array] = None,
        *,
        decode: bool = False,
        deterministic: bool = False,
    ) -> tuple[jax.Array, Optional[jax.Array]]:
        h, rate = self._deprecated()
        d = self.head_dim
        g = self.num_gqa_groups if self.num_gqa_groups is not None else h
        if not isinstance(h, (int, np.integer)) or h < 1:
            raise ValueError(f"num_attention_heads must be a positive int, got {h!r}")
        if not isinstance(d, (int, np.integer)) or d < 1:
            raise ValueError(f"head_dim must be a positive int, got {d!r}")
        if not isinstance(g, (int, np.integer)) or g < 1 or h % g:
            raise ValueError(f"num_gqa_groups ({g}) must be a positive divisor of num_attention_heads ({h})")
        check_norm_type(self.layernorm_type)
        lora_qkv, lora_out, _ = lora_scope(self.low_rank_adaptation_scope)
        if self.enable_rotary_pos_emb:
            canonical_group_method(self.rotary_pos_emb_group_method)
            check_rotary_windows(self.rotary_pos_emb_windows)
            if d % 2:
                raise ValueError(f"enable_rotary_pos_emb needs an even head_dim, got {d}")
        is_self = inputs_kv is None or inputs_kv is inputs_q
        if inputs_kv is None:
            inputs_kv = inputs_q
        if inputs_q.dtype != inputs_kv.dtype:
            raise ValueError(
                f"inputs_q and inputs_kv must have the same dtype, got {inputs_q.dtype} and {inputs_kv.dtype}"
            )
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3:
            order = "(seq, batch, hidden)" if self.transpose_batch_sequence else "(batch, seq, hidden)"
            raise ValueError(
                f"inputs_q and inputs_kv must be rank 3 {order}, got {inputs_q.shape} and {inputs_kv.shape}"
            )
        kinit = self.kernel_init
        if kinit is None:
            kinit = nn.initializers.variance_scaling(1.0, "fan_in", "normal", dtype=self.dtype)
        scaled = self.scaled_query_init

        def query_init(key, shape, dtype):
            w = kinit(key, shape, dtype)
            return (w / jnp.sqrt(d).astype(dtype)) if scaled else w

        def stacked_init(n, first):
            # TransformerEngine's qkv_init / kv_init: one draw per slot, each with fan_in = hidden.
            def init(key, shape, dtype):
                if len(shape) != 3 or shape[-2] != n:
                    return kinit(key, shape, dtype)
                keys = jax.random.split(key, n)
                parts = [
                    (first if i == 0 else kinit)(keys[i], (shape[0], shape[-1]), dtype) for i in range(n)
                ]
                return jnp.stack(parts, axis=-2).astype(dtype)

            return init

        common = dict(
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            dtype=self.dtype,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
        )
        norm = dict(
            enable_layernorm=self.input_layernorm,
            layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            scale_axes=(W_NO_SHARD_AXES,),
            ln_bias_axes=(W_NO_SHARD_AXES,),
        )
        rlo = bool(self.return_layernorm_output)
        if self.fuse_qkv_params and is_self and g == h:
            with split_first_feature_axis():  # q, k, v as three arrays: no split or concat copies
                qkv, ln_out = LayerNormDenseGeneral(
                    features=(3, h * d),
                    kernel_init=stacked_init(3, query_init),
                    kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
                    bias_axes=(W_JOINED_AXES, W_TP_AXES),
                    return_layernorm_output=rlo,
                    enable_low_rank_adaptation=lora_qkv,
                    name="qkv",
                    **norm,
                    **common,
                )(inputs_q)
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
                return_layernorm_output=(rlo or is_self) if self.fuse_qkv_params else True,
                enable_low_rank_adaptation=lora_qkv,
                name="query",
                **norm,
                **common,
            )(inputs_q)
            if is_self:
                inputs_kv = ln_out
            if self.fuse_qkv_params:
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
        dt = inputs_q.dtype
        q = q.astype(dt).reshape(q.shape[:2] + (h, d))
        k = k.astype(dt).reshape(k.shape[:2] + (g, d))
        v = v.astype(dt).reshape(v.shape[:2] + (g, d))
        tbs = self.transpose_batch_sequence
        mask_type, window = self.attn_mask_type, self.window_size
        # decode: the cache exists after the call that created it (init, full length)
        stepping = decode and self.has_variable("cache", "cached_key")
        offset = self.get_variable("cache", "cache_index") if stepping else 0
        if self.enable_rotary_pos_emb:
            windows, method = self.rotary_pos_emb_windows, self.rotary_pos_emb_group_method
            q = rotary_pos_emb(q, windows, tbs, method, position_offset=offset)
            k = rotary_pos_emb(k, windows, tbs, method, position_offset=offset)
        if decode:
            k, v, mask, bias = self._decode_step(q, k, v, mask, bias, stepping, h, d)
            if stepping:  # one query at position cache_index: the step mask replaces the causal one
                mask_type, window = "padding", None
        x = DotProductAttention(
            head_dim=d,
            num_attention_heads=h,
            num_gqa_groups=g,
            attn_mask_type=mask_type,
            attn_bias_type=self.attn_bias_type,
            attention_dropout=rate,
            dtype=self.dtype,
            dropout_rng_name=self.dropout_rng_name,
            float32_logits=self.float32_logits,
            qkv_layout="bshd_bshd_bshd",
            scale_factor=(1.0 / math.sqrt(d)) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=tbs,
            window_size=window,
        )(q, k, v, mask, bias, deterministic=deterministic)
        x = x.reshape(x.shape[:2] + (h * d,))
        with tensor_parallel_layout("row"):  # heads split over tp: the output projection is row-parallel
            out = DenseGeneral(
                features=inputs_q.shape[-1],
                kernel_init=kinit,
                kernel_axes=(W_TP_AXES, W_FSDP_AXES),
                bias_axes=(W_NO_SHARD_AXES,),
                enable_low_rank_adaptation=lora_out,
                name="out",
                **common,
            )(x)
        out = checkpoint_name(out, "out_proj")
        return out, ln_out

    def _decode_step(self, q, k, v, mask, bias, stepping, h, d):
        """TransformerEngine's autoregressive cache (collection "cache": ``cached_key``,
        ``cached_value``, ``cache_index``). The call that creates it (init with the full length)
        attends normally; each later call takes one position, writes its key/value at
        ``cache_index`` and attends to keys ``0 .. cache_index`` (and the window)."""
        ck = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        ci = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if not stepping:
            return k, v, mask, bias
        seq_axis = 0 if self.transpose_batch_sequence else 1
        length, batch = ck.value.shape[seq_axis], ck.value.shape[1 - seq_axis]
        expected = (1, batch, h, d) if self.transpose_batch_sequence else (batch, 1, h, d)
        if q.shape != expected:
            raise ValueError(
                f"decode=True: each step takes one position, the query must be {expected} "
                f"(cache of length {length}), got {q.shape}"
            )
        cur = ci.value.astype(jnp.int32)
        shape = [1, 1, 1, 1]
        shape[seq_axis] = length
        onehot = jax.nn.one_hot(cur, length, dtype=k.dtype).reshape(shape)
        k = ck.value + k.astype(ck.value.dtype) * onehot
        v = cv.value + v.astype(cv.value.dtype) * onehot
        ck.value, cv.value, ci.value = k, v, ci.value + 1
        j = jnp.arange(length)
        step = j > cur
        window = _check_window(self.window_size)
        if window is not None and window[0] >= 0:
            step = step | (j < cur - window[0])
        step = jnp.broadcast_to(step, (batch, 1, 1, length))
        mt = _enum_name(self.attn_mask_type, "attn_mask_type", _MASK_TYPES)
        if mask is not None and mt.startswith("padding"):
            m = jnp.asarray(mask)
            if m.shape[-2] != 1:  # a full (b, 1, L, L) mask: the row of this position
                m = jax.lax.dynamic_slice_in_dim(m, cur, 1, axis=2)
            step = step | (m != 0)
        if bias is not None:
            bias = jnp.asarray(bias)
            if bias.shape[-2] != 1:
                bias = jax.lax.dynamic_slice_in_dim(bias, cur, 1, axis=2)
        return k, v, step, bias


__all__ = ["DotProductAttention", "MultiHeadAttention", "attention_reference", "cudnn_attention_dropout"]
