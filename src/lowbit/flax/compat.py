"""Field handling shared by the modules for TransformerEngine >= 2.10's API:
``transpose_batch_sequence=None`` (batch-first), the attention ``softmax_type`` and the
``*_input_axes`` logical constraints."""

from __future__ import annotations

import flax.linen as nn

# TE's AttnSoftmaxType names and strings -> the canonical string.
_ATTN_SOFTMAX = {
    "vanilla": "vanilla",
    "vanilla_softmax": "vanilla",
    "off_by_one": "off_by_one",
    "off-by-one": "off_by_one",
    "off_by_one_softmax": "off_by_one",
    "learnable": "learnable",
    "learnable_softmax": "learnable",
}


def batch_first_default(module) -> None:
    """In ``__post_init__``: ``transpose_batch_sequence=None`` becomes False, TE >= 2.10's default
    (inputs ``(batch, seq, ...)``); before 2.10 TE's attention defaulted to True."""
    if module.transpose_batch_sequence is None:
        object.__setattr__(module, "transpose_batch_sequence", False)


def attn_softmax_type(value) -> str:
    """'vanilla', 'off_by_one' or 'learnable' from a string or TE's ``AttnSoftmaxType``."""
    key = getattr(value, "name", value)
    canon = _ATTN_SOFTMAX.get(key.lower()) if isinstance(key, str) else None
    if canon is None:
        raise ValueError(f"softmax_type must be 'vanilla', 'off_by_one' or 'learnable', got {value!r}")
    return canon


def check_attn_softmax_type(value) -> str:
    """As :func:`attn_softmax_type`, refusing the variants lowbit's attention does not compute."""
    canon = attn_softmax_type(value)
    if canon != "vanilla":
        raise NotImplementedError(
            f"softmax_type={value!r}: only the vanilla attention softmax is supported by lowbit"
        )
    return canon


def constrain_logical(x, axes):
    """TransformerEngine's ``*_input_axes``: a logical sharding constraint (a no-op without Flax
    logical axis rules and a mesh; None or () names nothing)."""
    if not axes:
        return x
    axes = tuple(axes)
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} must name each of the input's {x.ndim} dimensions")
    return nn.with_logical_constraint(x, axes)
