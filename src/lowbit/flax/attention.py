"""Attention with TransformerEngine's names, fields, defaults and parameter layout:
DotProductAttention and MultiHeadAttention (docs/te_modules_attention.md lists every field).
FP8 under ``fp8_dpa`` / ``fp8_mha`` (``attention_fp8``, ``attention_fp8_mha``), else in the input
precision; the projections are lowbit GEMMs. Paths (:mod:`lowbit.flax.attention_paths`):

* no dropout (``attention_dropout == 0`` or ``deterministic``): ``jax.nn.dot_product_attention``,
  cuDNN's fused kernel on a GPU when it takes the shapes and dtypes, XLA otherwise;
* dropout on a GPU (bf16/fp16, head_dim a multiple of 8 up to 128): cuDNN's fused attention with
  dropout (``jax._src.cudnn.fused_attention_stablehlo``); its random stream is cuDNN's (a seed
  per module path, an offset that advances with every execution), not ``dropout_rng_name``'s;
* dropout otherwise (CPU, float32): logits -> ``lowbit.softmax`` -> dropout drawn from the
  ``dropout_rng_name`` stream -> values (float32 logits and softmax).

Masks follow TransformerEngine (:mod:`lowbit.flax.attention_masks`): ``True`` means *masked
out*, shape ``(batch, 1 or heads, sq, sk)``; causal, bottom-right causal and sliding-window masks
combine with it (a fully masked row: see docs/te_modules_attention.md).
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowbit.flax.attention_fp8 import fp8_dpa
from lowbit.flax.attention_fp8_mha import fp8_mha
from lowbit.flax.attention_masks import (
    MASK_TYPES,
    QKV_LAYOUTS,
    THD_LAYOUTS,
    bias_type,
    check_bias,
    check_mask,
    check_window,
    combine_masks,
    enum_name,
)
from lowbit.flax.attention_paths import (
    attention_reference,
    check_score_mod,
    cudnn_attention_dropout,
    max_logit,
    per_shard_attention,
)

# The path predicates under their private names here: DotProductAttention looks them up in this
# module at call time, so patching lowbit.flax.attention._default_is_gpu (tests do) takes effect.
from lowbit.flax.attention_paths import cudnn_dropout_allowed as _cudnn_dropout_allowed
from lowbit.flax.attention_paths import default_is_gpu as _default_is_gpu
from lowbit.flax.attention_paths import traced_in_loop as _traced_in_loop
from lowbit.flax.attention_projections import lora_scope, out_projection, qkv_projections
from lowbit.flax.compat import batch_first_default
from lowbit.flax.params import Initializer, check_norm_type
from lowbit.flax.positions import canonical_group_method, check_rotary_windows, rotary_pos_emb
from lowbit.ops.attention import (
    SequenceDescriptor,
    cp_active,
    implementations,
    make_spec,
    pick_implementation,
    softmax_type_name,
)
from lowbit.ops.attention import attention as core_attention
from lowbit.sharding import HEAD_AXES, constrain_sequence

_CP_STRATEGIES = ("DEFAULT", "ALL_GATHER", "ALLGATHER", "RING")


class DotProductAttention(nn.Module):
    """``softmax(scale * q k^T + bias, masked) v`` with GQA (TransformerEngine's fields).

    Inputs per ``qkv_layout``: "bshd_bshd_bshd" ``query (b, sq, heads, d)``, ``key``/``value
    (b, sk, groups, d)``; "bshd_bs2hd" ``key (b, sk, 2, groups, d)`` (``value`` ignored);
    "bs3hd" ``query (b, s, 3, heads, d)`` (``key``/``value`` ignored). With
    ``transpose_batch_sequence=True`` (TransformerEngine's default before 2.10; None, the default,
    is False as in TE >= 2.10) the first two axes are ``(seq, batch)`` instead, for the inputs and
    the output. ``scale_factor`` defaults to
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
    transpose_batch_sequence: Optional[bool] = None  # None: False (batch-first), as TE >= 2.10
    window_size: Optional[Tuple[int, int]] = None
    max_segments_per_seq: Optional[int] = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    #: attention sinks: "vanilla", "off_by_one" (a zero logit more in the denominator) or
    #: "learnable" (a logit per head, parameter ``softmax_offset (1, heads, 1, 1)``).
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None  # TE's cuDNN-frontend callbacks: refused unless None
    score_mod_bprop: Optional[Callable] = None
    #: return ``(out, max_logit)``, ``max_logit (heads,)`` the per-head maximum logit (as TE)
    return_max_logit: bool = False
    #: lowbit: None = cuDNN on a GPU where it applies, else XLA; or force "cudnn" / "xla" (or a
    #: name registered with lowbit.ops.attention.register_implementation).
    implementation: Optional[str] = None

    def __post_init__(self):
        batch_first_default(self)
        super().__post_init__()

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
        check_score_mod(self)
        mask_type = enum_name(self.attn_mask_type, "attn_mask_type", MASK_TYPES)
        btype = bias_type(self.attn_bias_type, bias)
        layout = enum_name(self.qkv_layout, "qkv_layout", QKV_LAYOUTS + THD_LAYOUTS)
        softmax = softmax_type_name(self.softmax_type)
        window = check_window(self.window_size)
        rate = self.attention_dropout
        if not isinstance(rate, (int, float, np.floating)) or not 0.0 <= rate < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {rate!r}")
        if self.implementation not in (None, "cudnn", *implementations()):
            raise ValueError(
                f"implementation must be None, 'cudnn' or one of {list(implementations())}, got "
                f"{self.implementation!r}"
            )

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

        # Packing, sinks, context parallelism, or a registered implementation (lowbit's cuDNN
        # op) that takes the call: lowbit.ops.attention picks the path.
        drop = 0.0 if deterministic else rate
        out = fp8_dpa(self, query, key, value, sequence_descriptor, bias, mask_type, softmax, window, drop)
        if out is None and self._use_core(
            query, key, value, sequence_descriptor, btype, mask_type, layout, window, softmax, drop
        ):
            if self.return_max_logit:  # lowbit.ops.attention returns no logit statistics
                raise NotImplementedError(
                    "DotProductAttention(return_max_logit=True) with packing, THD, sinks, context "
                    "parallelism or implementation= is not supported by lowbit"
                )
            args = (sequence_descriptor, bias, btype, mask_type, layout, window, softmax, drop)
            out = self._core(query, key, value, *args)
        if out is not None:  # FP8 attention, or lowbit.ops.attention's path
            out = checkpoint_name(out, self.context_checkpoint_name)
            return jnp.swapaxes(out, 0, 1) if self.transpose_batch_sequence else out
        padding = check_mask(sequence_descriptor, mask_type, b, h, sq, sk)
        masked, plain_causal = combine_masks(padding, mask_type, window, sq, sk)
        scale = float(self.scale_factor) if self.scale_factor is not None else 1.0 / math.sqrt(d)
        dt = query.dtype
        key, value = key.astype(dt), value.astype(dt)
        bias = check_bias(bias, b, h, sq, sk)

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
                        query, key, value, masked, bias, btype, scale, rate, seed, plain_causal
                    )
                except Exception:
                    if self.implementation == "cudnn":
                        raise
            if out is None:
                out = attention_reference(
                    query, key, value, masked, bias, btype, scale, rate, rng, plain_causal
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
            out = self._fast(query, key, value, masked, bias, btype, scale, plain_causal, local)
        out = checkpoint_name(out, self.context_checkpoint_name)
        out = jnp.swapaxes(out, 0, 1) if self.transpose_batch_sequence else out
        if self.return_max_logit:
            return out, max_logit(query, key, masked, bias, btype, scale).astype(out.dtype)
        return out

    def _use_core(self, query, key, value, desc, btype, mask_type, layout, window, softmax, rate) -> bool:
        if isinstance(desc, SequenceDescriptor) or softmax != "vanilla" or layout in THD_LAYOUTS:
            return True
        if cp_active(self.context_parallel_axis):
            return True
        impl = self.implementation
        if impl in ("cudnn", "xla") or (impl is None and len(implementations()) == 1):
            return False
        mask = jnp.asarray(desc) if hasattr(desc, "shape") else None  # check_mask names a bad type
        spec = make_spec(query, key, value, scale=1.0, bias_type=btype, mask_type=mask_type, window=window,
                         mask=mask, dropout_rate=rate)  # fmt: skip
        return pick_implementation(spec, impl) != "xla"

    def _core(self, query, key, value, desc, bias, btype, mask_type, layout, window, softmax, rate):
        """Packing, sinks and context parallelism through :func:`lowbit.ops.attention.attention`."""
        b, sq, h, d = query.shape
        padding = None
        if desc is not None and not isinstance(desc, SequenceDescriptor):
            padding = check_mask(desc, mask_type, b, h, sq, key.shape[1])
            desc = None
        offset = None
        if softmax == "learnable":
            init = nn.with_logical_partitioning(nn.initializers.zeros, (None, HEAD_AXES, None, None))
            offset = self.param("softmax_offset", init, (1, h, 1, 1), jnp.float32)
        rng = self.make_rng(self.dropout_rng_name) if rate > 0 else None
        return core_attention(
            query,
            key.astype(query.dtype),
            value.astype(query.dtype),
            scale=float(self.scale_factor) if self.scale_factor is not None else 1.0 / math.sqrt(d),
            bias=check_bias(bias, b, h, sq, key.shape[1]),
            bias_type=btype,
            mask_type=mask_type,
            mask=padding,
            sequence_descriptor=desc,
            thd=layout in THD_LAYOUTS,
            window=window,
            max_segments_per_seq=self.max_segments_per_seq,
            softmax_type=softmax,
            softmax_offset=offset,
            dropout_rate=rate,
            rng=rng,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_load_balanced=self.context_parallel_causal_load_balanced,
            implementation=None if self.implementation == "cudnn" else self.implementation,
        )

    def _check_unsupported(self):
        if self.max_segments_per_seq is not None and (
            not isinstance(self.max_segments_per_seq, (int, np.integer)) or self.max_segments_per_seq < 1
        ):
            raise ValueError(
                f"max_segments_per_seq must be a positive int, got {self.max_segments_per_seq!r}"
            )
        if not isinstance(self.context_parallel_axis, str):
            raise TypeError(
                f"context_parallel_axis must be a mesh axis name (str), got {self.context_parallel_axis!r}"
            )
        s = self.context_parallel_strategy
        if getattr(s, "name", s) is None or str(getattr(s, "name", s)).upper() not in _CP_STRATEGIES:
            raise ValueError(
                f"context_parallel_strategy must be one of {list(_CP_STRATEGIES)} (case insensitive), "
                f"got {s!r}"
            )
        if not isinstance(self.context_checkpoint_name, str):
            raise TypeError(f"context_checkpoint_name must be a str, got {self.context_checkpoint_name!r}")

    def _unpack(self, layout, query, key, value):
        layout = {"t3hd": "bs3hd", "thd_t2hd": "bshd_bs2hd"}.get(layout, layout)
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
            keep, kw = None, dict(is_causal=True, scale=scale, local_window_size=local)
        else:
            keep = None if (masked is None or plain_causal) else jnp.logical_not(masked)
            kw = dict(is_causal=plain_causal, scale=scale)
        if self.implementation == "cudnn":
            impls = ("cudnn",)
        elif self._use_cudnn(query.dtype, query.shape[-1]):
            impls = ("cudnn", "xla")  # cuDNN may refuse the configuration at trace time: XLA then
        else:
            impls = ("xla",)
        for impl in impls:

            def attend(q, k, v, b, m, impl=impl):
                return jax.nn.dot_product_attention(q, k, v, bias=b, mask=m, implementation=impl, **kw)

            try:
                return per_shard_attention(attend, query, key, value, bias, keep)
            except Exception:
                if impl == impls[-1]:
                    raise


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
    position and attends to the cached keys up to it.

    Sequence parallelism (``MeshResource(tpsp_resource=...)``): the projections gather their FP8
    input along the sequence and the output projection reduce-scatters along it; the attention
    sees whole sequences, heads split over the tpsp axis. ``enable_sequence_parallel`` pins
    ``inputs_q`` to the sequence-split layout (TransformerEngine's ``SEQLEN_TP_AXES`` constraint;
    :func:`lowbit.sharding.constrain_sequence`); without ``tpsp_resource`` it does nothing."""

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
    transpose_batch_sequence: Optional[bool] = None  # None: False (batch-first), as TE >= 2.10
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"  # attention sinks: DotProductAttention.softmax_type
    score_mod: Optional[Callable] = None  # refused unless None, as DotProductAttention's
    score_mod_bprop: Optional[Callable] = None
    # Deprecated in TransformerEngine (same handling here)
    num_heads: Optional[int] = None
    dropout_rate: Optional[float] = None
    output_layernorm: Optional[bool] = None
    apply_residual_connection_post_layernorm: Optional[bool] = None
    fuse_qkv: Optional[bool] = None

    def __post_init__(self):
        batch_first_default(self)
        super().__post_init__()

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
        for name, n in (("num_attention_heads", h), ("head_dim", d)):
            if not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
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
        if self.enable_sequence_parallel:  # the residual stream arrives split along the sequence
            inputs_q = constrain_sequence(inputs_q)
        if inputs_kv is None or is_self:
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
        fused = fp8_mha(
            self, inputs_q, is_self, mask, bias, decode, deterministic, h, g, d, rate, (lora_qkv, lora_out)
        )
        if fused is not None:  # the recipe's fp8_mha: projections and attention as one op
            return fused
        q, k, v, ln_out = qkv_projections(self, inputs_q, inputs_kv, is_self, h, g, d, lora_qkv)
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
        if decode and isinstance(mask, SequenceDescriptor):
            raise NotImplementedError("decode=True takes a mask array, not a SequenceDescriptor")
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
            softmax_type=self.softmax_type,
            score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
        )(q, k, v, mask, bias, deterministic=deterministic)
        x = x.reshape(x.shape[:2] + (h * d,))
        out = out_projection(self, x, inputs_q.shape[-1], lora_out)
        out = checkpoint_name(out, "out_proj")
        return out, ln_out

    def _decode_step(self, q, k, v, mask, bias, stepping, h, d):
        """TransformerEngine's autoregressive cache (collection "cache"; docs/te_modules_attention.md:
        init attends normally, each later call writes one position and attends up to it)."""
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
        window = check_window(self.window_size)
        if window is not None and window[0] >= 0:
            step = step | (j < cur - window[0])
        step = jnp.broadcast_to(step, (batch, 1, 1, length))
        mt = enum_name(self.attn_mask_type, "attn_mask_type", MASK_TYPES)
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


__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "attention_reference",
    "cudnn_attention_dropout",
    "lora_scope",
]
