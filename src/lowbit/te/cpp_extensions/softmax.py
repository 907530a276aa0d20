"""``transformer_engine.jax.cpp_extensions.softmax``: TE's kernel-availability query and its
plain-JAX softmax forms (TE's reference path; ``softmax_offset`` adds an implicit logit)."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

from lowbit.te.attention import AttnSoftmaxType
from lowbit.te.softmax import SoftmaxFusionType

Offset = Optional[Union[jax.Array, float]]


def is_softmax_kernel_available(
    softmax_fusion_type: SoftmaxFusionType,
    softmax_type: AttnSoftmaxType,
    batch: int,
    heads: int,
    q_seqlen: int,
    k_seqlen: int,
    dtype,
) -> bool:
    """Whether lowbit's fused softmax runs these inputs: every shape and float dtype for the
    vanilla softmax (lowbit.softmax has no size limits); never for sinks."""
    del batch, heads, q_seqlen, k_seqlen
    SoftmaxFusionType(getattr(softmax_fusion_type, "value", softmax_fusion_type))
    vanilla = AttnSoftmaxType(softmax_type) is AttnSoftmaxType.VANILLA_SOFTMAX
    return vanilla and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16, jnp.float16)


def _general_softmax(x, where=None, offset: Offset = None):
    # softmax over the last axis with an optional extra logit `offset` in every row's denominator
    x_max = jnp.max(x, -1, where=where, initial=-jnp.inf, keepdims=True)
    if offset is not None:
        offset = jnp.asarray(offset, x.dtype)
        x_max = jnp.maximum(x_max, offset)
    e = jnp.exp((x if where is None else jnp.where(where, x, -jnp.inf)) - x_max)
    den = jnp.sum(e, -1, where=where, keepdims=True)
    if offset is not None:
        den = den + jnp.exp(offset - x_max)
    return e / den


def jax_scaled_softmax(logits: jax.Array, scale_factor: float, softmax_offset: Offset = None) -> jax.Array:
    if softmax_offset is None:
        return jax.nn.softmax(scale_factor * logits)
    return _general_softmax(scale_factor * logits, offset=softmax_offset)


def jax_scaled_masked_softmax(
    logits: jax.Array, mask: jax.Array, scale_factor: float, softmax_offset: Offset = None
) -> jax.Array:
    """mask 1 = masked out."""
    if softmax_offset is None:
        return jax.nn.softmax(logits * scale_factor, where=mask != 1)
    return _general_softmax(logits * scale_factor, where=mask != 1, offset=softmax_offset)


def jax_scaled_upper_triang_masked_softmax(
    logits: jax.Array, scale_factor: float, softmax_offset: Offset = None
) -> jax.Array:
    mask = 1 - jnp.tril(jnp.ones_like(logits))
    return jax_scaled_masked_softmax(logits, mask, scale_factor, softmax_offset)


__all__ = [
    "is_softmax_kernel_available",
    "jax_scaled_masked_softmax",
    "jax_scaled_softmax",
    "jax_scaled_upper_triang_masked_softmax",
]
