"""MultiHeadAttention under a recipe with ``fp8_mha=True`` (DelayedScaling, Float8CurrentScaling):
the fused QKV projection, FP8 attention and the output projection run as one op
(:func:`lowbit.ops.fused.mha_fp8.mha_fp8`), FP8 handed across both attention boundaries.

The parameters and the projections' DelayedScaling state are the usual ones (``qkv``, ``out``:
the modules are created as always, :func:`lowbit.flax.dense_general.operands_only` hands their
operands over); the attention's state sits in MultiHeadAttention's own scope (with fp8_dpa it is
in its DotProductAttention's). Calls the op cannot take (GQA, cross-attention, unfused QKV
parameters, LoRA, rotary embeddings, decode, a mask or bias, a window, sinks, a mesh that splits
the batch or heads, sequence parallelism, batch-second inputs, ``return_layernorm_output``) run
as with ``fp8_dpa`` (FP8 inside attention only), with a warning saying why.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax.attention_fp8 import fp8_state_variables
from lowbit.flax.attention_masks import MASK_TYPES, enum_name
from lowbit.flax.attention_projections import fused_qkv_module, out_module
from lowbit.flax.dense_general import operands_only
from lowbit.ops.attention import fp8_scales, softmax_type_name
from lowbit.ops.fused.mha_fp8 import mha_fp8
from lowbit.recipe import DelayedScaling
from lowbit.sharding import plan_heads


def _why_not(m, inputs_q, is_self, mask, bias, decode, h, g, lora) -> Optional[str]:
    mask_type = enum_name(m.attn_mask_type, "attn_mask_type", MASK_TYPES)
    checks = (
        (not is_self or g != h or not m.fuse_qkv_params, "GQA, cross-attention or unfused QKV"),
        (any(lora), "LoRA adapters"),
        (m.enable_rotary_pos_emb, "rotary embeddings (between the projection and attention)"),
        (decode, "decode=True"),
        (mask is not None or bias is not None, "a mask or bias"),
        (m.window_size is not None, "a window"),
        (softmax_type_name(m.softmax_type) != "vanilla", "attention sinks"),
        (mask_type not in ("no_mask", "causal"), f"attn_mask_type={mask_type!r}"),
        (m.enable_sequence_parallel, "sequence parallelism"),
        (m.transpose_batch_sequence, "batch-second inputs"),
        (m.return_layernorm_output, "return_layernorm_output=True"),
        (plan_heads(inputs_q.shape[0], h, g) is not None, "a mesh that splits the batch or heads"),
    )
    return next((why for bad, why in checks if bad), None)


def fp8_mha(m, inputs_q, is_self, mask, bias, decode, deterministic, h, g, d, rate, lora):
    """MultiHeadAttention ``m``'s ``(out, ln_out)`` through the fp8_mha op, or None (the recipe
    asks for none, or the call falls back to fp8_dpa with a warning)."""
    recipe = get_recipe()
    if recipe is None or not getattr(recipe, "fp8_mha", False):
        return None
    why = _why_not(m, inputs_q, is_self, mask, bias, decode, h, g, lora)
    if why is not None:
        warnings.warn(
            f"fp8_mha=True: FP8 inside attention only (as fp8_dpa), not across it: {why}", stacklevel=3
        )
        return None
    fp8_scales.check_recipe(recipe)
    with operands_only():
        qkv, _ = fused_qkv_module(m, h, d, False)(inputs_q)
        out = out_module(m, inputs_q.shape[-1], False)(
            jnp.zeros(inputs_q.shape[:2] + (h * d,), inputs_q.dtype)
        )
    delayed = isinstance(recipe, DelayedScaling)
    drop = 0.0 if deterministic else rate
    causal = enum_name(m.attn_mask_type, "attn_mask_type", MASK_TYPES) == "causal"
    y = mha_fp8(
        qkv.x, qkv.kernel, qkv.bias, out.kernel, out.bias, recipe=recipe, heads=h, norm=qkv.norm,
        qkv_state=qkv.ctx.state, out_state=out.ctx.state,
        attention_state=fp8_state_variables(m, recipe) if delayed else None,
        causal=causal, scale=(1.0 / math.sqrt(d)) if m.scale_attn_logits else 1.0,
        dropout_rate=drop, rng=m.make_rng(m.dropout_rng_name) if drop > 0 else None,
    )  # fmt: skip
    return y.astype(inputs_q.dtype), None


__all__ = ["fp8_mha"]
