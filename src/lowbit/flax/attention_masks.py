"""Attention masks and biases with TransformerEngine's conventions, checked and combined.

Masks: ``True`` means *masked out*, shape ``(batch, 1 or heads, sq, sk)``. Causal types mask key
``j > i`` for query ``i`` ("causal", "padding_causal": top-left aligned) or ``j > i + sk - sq``
(the ``*_bottom_right`` types). ``window_size=(left, right)`` keeps keys in
``[i' - left, i' + right]`` (negative: unbounded), ``i'`` aligned like the causal mask; all masks
combine (a key is kept only if every one keeps it). Biases: "pre_scale_bias" is added before the
softmax scale, "post_scale_bias" after it.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from lowbit.sharding import batch_shards

MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
MASK_ALIASES = {
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
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
QKV_LAYOUTS = ("bs3hd", "bshd_bs2hd", "bshd_bshd_bshd")
THD_LAYOUTS = ("t3hd", "thd_t2hd", "thd_thd_thd")


def enum_name(v, name, choices):
    """A string or an enum member (TransformerEngine's AttnMaskType etc.), canonicalised."""
    s = getattr(v, "name", v)
    s = s.lower() if isinstance(s, str) else s
    s = MASK_ALIASES.get(s, s) if isinstance(s, str) else s
    if s not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {v!r}")
    return s


def check_window(window_size):
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


def check_mask(mask, mask_type, b, h, sq, sk):
    """The user mask of the padding types, validated; None for the others (TE ignores it)."""
    needs = mask_type.startswith("padding")
    if mask is None:  # a padding type without a mask: every position valid, as in TE
        return None
    if not needs:
        return None  # TransformerEngine ignores the mask of the no_mask/causal types
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(
            f"DotProductAttention: sequence_descriptor must be a SequenceDescriptor "
            f"(lowbit.te.attention) or a boolean mask array (True = masked out), got {type(mask).__name__}"
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


def combine_masks(padding, mask_type: str, window, sq: int, sk: int):
    """``(masked, plain_causal)``: the user's ``padding`` mask (or None) OR-ed with the static
    causal / window mask, broadcastable to ``(b, h, sq, sk)`` (None when nothing is masked), and
    whether the mask is exactly the square causal triangle (the fused causal kernels apply)."""
    tri = static_mask(mask_type, window, sq, sk)
    masked = padding
    if tri is not None:
        masked = jnp.asarray(tri)[None, None] if masked is None else (masked | tri[None, None])
    plain_causal = padding is None and window is None and "causal" in mask_type and sq == sk
    return masked, plain_causal


def bias_type(attn_bias_type, bias) -> str:
    """The bias type in effect: ``attn_bias_type`` canonicalised (None: "post_scale_bias" with a
    bias, else "no_bias"), consistent with whether a bias was given."""
    if attn_bias_type is None:
        return "no_bias" if bias is None else "post_scale_bias"
    t = enum_name(attn_bias_type, "attn_bias_type", BIAS_TYPES)
    if t == "no_bias" and bias is not None:
        raise ValueError("attn_bias_type='no_bias' but a bias was given")
    if t != "no_bias" and bias is None:
        raise ValueError(f"attn_bias_type={t!r} needs a bias (shape (1 or batch, heads, sq, sk))")
    return t


def check_bias(bias, b: int, h: int, sq: int, sk: int):
    """``bias`` as an array of shape ``(1 or b, 1 or h, sq, sk)``, or None. Under a mesh the
    leading size may also be the number of batch shards (``lowbit.sharding.batch_shards(b)``:
    one bias per shard, as ``RelativePositionBiases(batch_shards=)`` builds it)."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    lead = {1, b, batch_shards(b)}
    if (
        bias.ndim != 4
        or bias.shape[0] not in lead
        or any(m not in (1, w) for m, w in zip(bias.shape[1:], (h, sq, sk)))
    ):
        shards = f" or {batch_shards(b)} (batch shards)" if batch_shards(b) > 1 else ""
        raise ValueError(
            f"bias must have shape (1 or batch{shards}, 1 or heads, sq, sk) = "
            f"(1 or {b}, 1 or {h}, {sq}, {sk}), "
            f"got {tuple(bias.shape)}"
        )
    return bias


def bias_per_batch(bias, b: int):
    """A bias given once per batch shard (leading size n, 1 < n < b) repeated to one per
    sequence, for the paths that do not run per shard; others unchanged."""
    if bias is None or bias.shape[0] in (1, b):
        return bias
    return jnp.repeat(bias, b // bias.shape[0], axis=0)
