"""Field handling shared by the modules for TransformerEngine >= 2.10's API:
``transpose_batch_sequence=None`` (batch-first), the attention ``softmax_type`` and the
``*_input_axes`` logical constraints."""

from __future__ import annotations

import flax.linen as nn

from lowbit.ops.attention import softmax_type_name


def batch_first_default(module) -> None:
    """In ``__post_init__``: ``transpose_batch_sequence=None`` becomes False, TE >= 2.10's default
    (inputs ``(batch, seq, ...)``); before 2.10 TE's attention defaulted to True."""
    if module.transpose_batch_sequence is None:
        object.__setattr__(module, "transpose_batch_sequence", False)


def check_attn_softmax_type(value) -> str:
    """The attention softmax variant (a string or TE's ``AttnSoftmaxType``), refused unless
    vanilla: for modules without attention sinks (``Softmax``)."""
    canon = softmax_type_name(value)
    if canon != "vanilla":
        raise NotImplementedError(
            f"softmax_type={value!r}: only the vanilla softmax is supported here (the attention "
            "modules compute the sinks)"
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
