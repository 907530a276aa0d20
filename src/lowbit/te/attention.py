# ---- issue 26: packing, sinks, context parallelism (lowbit.ops.attention) ---------------------
"""``transformer_engine.jax.attention``'s functions on lowbit: ``SequenceDescriptor``,
``fused_attn`` (TransformerEngine's signature) and the causal load-balancing reorders."""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

from lowbit.flax.attention_masks import BIAS_TYPES, MASK_TYPES, QKV_LAYOUTS, THD_LAYOUTS, enum_name
from lowbit.ops.attention import SequenceDescriptor
from lowbit.ops.attention import attention as _attention
from lowbit.ops.attention.context_parallel import (
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)


def _split_qkv(qkv, layout):
    """``(query, key, value)`` of TransformerEngine's qkv tuple for ``layout``."""
    n = 1 if layout in ("bs3hd", "t3hd") else 2 if layout in ("bshd_bs2hd", "thd_t2hd") else 3
    if not isinstance(qkv, (tuple, list)) or len(qkv) != n:
        raise ValueError(
            f"qkv must be a tuple of {n} arrays for qkv_layout={layout!r}, got {type(qkv).__name__}"
        )
    if n == 1:
        (x,) = qkv
        if x.ndim != 5 or x.shape[2] != 3:
            raise ValueError(f"qkv_layout={layout!r}: qkv[0] must be (b, s, 3, h, d), got {x.shape}")
        return x[:, :, 0], x[:, :, 1], x[:, :, 2]
    if n == 2:
        q, kv = qkv
        if kv.ndim != 5 or kv.shape[2] != 2:
            raise ValueError(f"qkv_layout={layout!r}: qkv[1] must be (b, s, 2, g, d), got {kv.shape}")
        return q, kv[:, :, 0], kv[:, :, 1]
    return tuple(qkv)


def fused_attn(
    qkv: Tuple,
    bias,
    sequence_descriptor,
    seed,
    attn_bias_type,
    attn_mask_type,
    qkv_layout,
    softmax_type,
    scaling_factor: float,
    dropout_probability: float,
    is_training: bool,
    max_segments_per_seq: int = 1,
    window_size: Optional[Tuple[int, int]] = None,
    context_parallel_strategy="DEFAULT",
    context_parallel_causal_load_balanced: bool = False,
    context_parallel_axis: str = "",
    context_checkpoint_name: str = "context",
    softmax_offset=None,
    stripe_size: Optional[int] = None,
    score_mod=None,
    score_mod_bprop=None,
    score_mod_tensors=None,
    score_mod_bprop_tensors=None,
    return_max_logit: bool = False,
):
    """TransformerEngine's ``fused_attn``: batch-first ``qkv`` per ``qkv_layout``, a
    :class:`SequenceDescriptor` (or, deprecated, a mask array, True = masked out), ``seed`` the
    dropout key (TransformerEngine's per-device split keys: the first is used). Runs
    :func:`lowbit.ops.attention.attention` (its implementation choice)."""
    from jax.ad_checkpoint import checkpoint_name

    if score_mod is not None or score_mod_bprop is not None or score_mod_tensors or score_mod_bprop_tensors:
        raise NotImplementedError(
            "fused_attn: score_mod (cuDNN frontend score modifiers) is not supported by lowbit"
        )
    if return_max_logit:
        raise NotImplementedError("fused_attn: return_max_logit is not supported by lowbit")
    if stripe_size not in (None, 1):
        raise NotImplementedError(
            f"fused_attn: stripe_size={stripe_size!r}: only stripes of one token are supported"
        )
    layout = enum_name(qkv_layout, "qkv_layout", QKV_LAYOUTS + THD_LAYOUTS)
    mask_type = enum_name(attn_mask_type, "attn_mask_type", MASK_TYPES)
    bias_type = enum_name(attn_bias_type, "attn_bias_type", BIAS_TYPES)
    q, k, v = _split_qkv(qkv, layout)
    mask = None
    if sequence_descriptor is not None and not isinstance(sequence_descriptor, SequenceDescriptor):
        warnings.warn(
            "Pass mask to fused_attn is deprecated, please use SequenceDescriptor instead.",
            DeprecationWarning,
        )
        mask = sequence_descriptor if mask_type.startswith("padding") else None
        sequence_descriptor = None
    rate = float(dropout_probability) if is_training else 0.0
    rng = None
    if rate > 0:
        if seed is None:
            raise ValueError("fused_attn: dropout_probability > 0 in training needs seed (a PRNG key)")
        rng = seed[0] if getattr(seed, "ndim", 1) == 2 else seed
    out = _attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        scale=float(scaling_factor),
        bias=None if bias_type == "no_bias" else bias,
        bias_type=bias_type,
        mask_type=mask_type,
        mask=None if mask is None else (mask != 0),
        sequence_descriptor=sequence_descriptor,
        thd=layout in THD_LAYOUTS,
        window=None if window_size in (None, (-1, -1)) else tuple(window_size),
        max_segments_per_seq=max_segments_per_seq,
        softmax_type=softmax_type,
        softmax_offset=softmax_offset,
        dropout_rate=rate,
        rng=rng,
        context_parallel_axis=context_parallel_axis,
        context_parallel_strategy=context_parallel_strategy,
        context_parallel_load_balanced=context_parallel_causal_load_balanced,
    )
    return checkpoint_name(out, context_checkpoint_name)


__all__ = [
    "SequenceDescriptor",
    "fused_attn",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
]
