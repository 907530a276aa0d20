"""``transformer_engine.jax.attention``: TE's attention enums (TE's member values, those of
its C headers), the mask helpers, and (below the marker) ``SequenceDescriptor``, ``fused_attn``
(TransformerEngine's signature) and the causal load-balancing reorders.

lowbit's attention is :class:`lowbit.flax.DotProductAttention`; these names let TE code and TE's
own tests that build masks or name layouts import unchanged.
"""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from lowbit.flax.attention_masks import BIAS_TYPES, MASK_TYPES, QKV_LAYOUTS, THD_LAYOUTS, enum_name
from lowbit.ops.attention import SequenceDescriptor
from lowbit.ops.attention import attention as _attention
from lowbit.ops.attention.context_parallel import (
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)


class AttnBiasType(Enum):
    """Where the bias enters: none, before the scale (``scale*(qk+b)``) or after (``scale*qk+b``)."""

    NO_BIAS = 0
    PRE_SCALE_BIAS = 1
    POST_SCALE_BIAS = 2


class AttnMaskType(Enum):
    """TE's mask kinds; causal ones are top-left aligned unless ``BOTTOM_RIGHT``."""

    NO_MASK = 0
    PADDING_MASK = 1
    CAUSAL_MASK = 2
    PADDING_CAUSAL_MASK = 3
    CAUSAL_BOTTOM_RIGHT_MASK = 4
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5

    def is_causal(self) -> bool:
        """True for every causal kind (padding or not, either alignment)."""
        return self not in (AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK)

    def is_padding(self) -> bool:
        """True where the kind includes padding."""
        return self.name.startswith("PADDING")

    def is_bottom_right(self) -> bool:
        """True where the causal diagonal is anchored at the bottom-right corner."""
        return self.name.endswith("BOTTOM_RIGHT_MASK")


class AttnSoftmaxType(Enum):
    """The attention softmax variant: vanilla, off-by-one (an implicit zero logit) or learnable
    (a per-head sink logit ``alpha[h]``)."""

    VANILLA_SOFTMAX = 0
    OFF_BY_ONE_SOFTMAX = 1
    LEARNABLE_SOFTMAX = 2

    @classmethod
    def from_str(cls, softmax_type: str) -> AttnSoftmaxType:
        """'vanilla', 'off_by_one' or 'learnable' -> the member."""
        found = _SOFTMAX_NAMES.get(softmax_type)
        if found is None:
            raise ValueError(
                f"Unknown softmax_type: {softmax_type!r}; valid: 'vanilla', 'off_by_one', 'learnable'"
            )
        return cls[found]


_SOFTMAX_NAMES = {
    "vanilla": "VANILLA_SOFTMAX",
    "off_by_one": "OFF_BY_ONE_SOFTMAX",
    "learnable": "LEARNABLE_SOFTMAX",
}


class QKVFormat(Enum):
    """Memory order of q, k, v: ``[s, b, h, d]``, ``[b, s, h, d]``, or THD (packed BSHD)."""

    SBHD = 0
    BSHD = 1
    THD = 2


class QKVLayout(Enum):
    """How q, k, v are packed: one tensor (``3``), q plus a packed kv (``2``), or three tensors."""

    BS3HD = 5
    BSHD_BS2HD = 7
    BSHD_BSHD_BSHD = 9
    T3HD = 10
    THD_T2HD = 12
    THD_THD_THD = 14

    def get_qkv_format(self) -> QKVFormat:
        """BSHD or THD, from the layout's leading letters."""
        return QKVFormat.THD if self.is_thd() else QKVFormat.BSHD

    def is_qkvpacked(self) -> bool:
        """q, k and v in one tensor."""
        return self in (QKVLayout.BS3HD, QKVLayout.T3HD)

    def is_kvpacked(self) -> bool:
        """k and v in one tensor, q separate."""
        return self in (QKVLayout.BSHD_BS2HD, QKVLayout.THD_T2HD)

    def is_separate(self) -> bool:
        """Three tensors."""
        return self in (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD)

    def is_thd(self) -> bool:
        """A packed-sequence (THD) layout."""
        return self.name.startswith("T")

    def _same_format(self, bshd: QKVLayout, thd: QKVLayout) -> QKVLayout:
        return thd if self.is_thd() else bshd

    def to_qkvpacked(self) -> QKVLayout:
        """This layout's format with q, k, v in one tensor."""
        return self._same_format(QKVLayout.BS3HD, QKVLayout.T3HD)

    def to_kvpacked(self) -> QKVLayout:
        """This layout's format with k, v packed."""
        return self._same_format(QKVLayout.BSHD_BS2HD, QKVLayout.THD_T2HD)

    def to_separate(self) -> QKVLayout:
        """This layout's format with three tensors."""
        return self._same_format(QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD)


def get_qkv_format(qkv_layout: QKVLayout) -> QKVFormat:
    """The format (BSHD or THD) of ``qkv_layout``."""
    return QKVLayout(qkv_layout).get_qkv_format()


class CPStrategy(Enum):
    """Context-parallel strategy of the fused attention: automatic, all-gather, or ring."""

    DEFAULT = 0
    ALL_GATHER = 1
    RING = 2


class ReorderStrategy(Enum):
    """Token reordering for causal context-parallel load balance: dual-chunk swap (BSHD) or
    striped (THD)."""

    DualChunkSwap = 0
    Striped = 1


_MASK_NAMES = {
    "no_mask": AttnMaskType.NO_MASK,
    "padding": AttnMaskType.PADDING_MASK,
    "causal": AttnMaskType.CAUSAL_MASK,
    "causal_bottom_right": AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_causal": AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
    "padding_causal": AttnMaskType.PADDING_CAUSAL_MASK,
    "causal_padding": AttnMaskType.PADDING_CAUSAL_MASK,
    "padding_causal_bottom_right": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "causal_padding_bottom_right": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_causal_padding": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_padding_causal": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
}


def canonicalize_attn_mask_type(attn_mask_type: str) -> AttnMaskType:
    """TE's mask-type strings (and their word-order aliases) -> :class:`AttnMaskType`."""
    found = _MASK_NAMES.get(attn_mask_type)
    if found is None:
        raise ValueError(f"Unsupported attn_mask_type={attn_mask_type!r}; supported: {sorted(_MASK_NAMES)}")
    return found


def run_length_fill(segment_ids: jax.Array) -> jax.Array:
    """Each token's run length: the number of consecutive equal ids it belongs to along the last
    axis (0 where the id is 0, i.e. padding)."""
    ids = jnp.asarray(segment_ids)
    rows = ids.reshape(-1, ids.shape[-1])

    def one_row(row):
        starts = jnp.concatenate([jnp.ones((1,), bool), row[1:] != row[:-1]])
        run = jnp.cumsum(starts) - 1  # run index of every token
        return jnp.bincount(run, length=row.shape[0])[run]

    lengths = jax.vmap(one_row)(rows).reshape(ids.shape)
    return jnp.where(ids == 0, 0, lengths)


def make_swa_mask(
    segment_pos_q: jax.Array,
    segment_pos_kv: jax.Array,
    window_size: Optional[Tuple[int, int]] = None,
    dtype=jnp.float32,
    segment_ids_q: Optional[jax.Array] = None,
    segment_ids_kv: Optional[jax.Array] = None,
) -> jax.Array:
    """Sliding-window mask, 1 = attend, shape ``(..., 1, sq, skv)``: query at position i sees keys
    in ``[i - left, i + right]`` (a negative or absent bound is unbounded). Given both segment id
    arrays, the window is anchored at each segment's end (bottom-right causal form) and only the
    left bound applies."""
    left, right = window_size if window_size is not None else (-1, -1)
    left = jnp.inf if left < 0 else left
    right = jnp.inf if right < 0 else right
    pq = jnp.asarray(segment_pos_q)[..., :, None]
    pk = jnp.asarray(segment_pos_kv)[..., None, :]
    if segment_ids_q is not None and segment_ids_kv is not None:
        # Distance from each token to its segment's end, compared on both sides.
        end_q = run_length_fill(segment_ids_q)[..., :, None] - pq
        end_k = run_length_fill(segment_ids_kv)[..., None, :] - pk
        keep = end_q + left >= end_k
    else:
        keep = (pk >= pq - left) & (pk <= pq + right)
    return keep[..., None, :, :].astype(dtype)


# --- sequence descriptors, fused attention, context parallelism (attnfeat helper) below ---
# ---- issue 26: packing, sinks, context parallelism (lowbit.ops.attention) ----


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
    "AttnBiasType",
    "AttnMaskType",
    "AttnSoftmaxType",
    "CPStrategy",
    "QKVFormat",
    "QKVLayout",
    "ReorderStrategy",
    "SequenceDescriptor",
    "canonicalize_attn_mask_type",
    "fused_attn",
    "get_qkv_format",
    "inverse_reorder_causal_load_balancing",
    "make_swa_mask",
    "reorder_causal_load_balancing",
    "run_length_fill",
]
