"""FP8 expert-weight copies in plain jnp, for the optimizer update to write.

:func:`delayed_expert_copies` returns exactly (byte for byte) what
:func:`lowbit.moe.quantize_experts` returns under DelayedScaling, but as XLA elementwise ops
instead of lowbit's cast kernel: traced in the same jit as the optimizer update that computes
the new masters, XLA can fuse the cast into the update's own pass over the weights (the rowwise
FP8 copy one more output of that fusion; the colwise copy a per-expert transpose of it; the
per-expert amax a reduction of the same values). Measured on an H200 it is the slower way
(the full G64 MoE step with AdamW 25.67 ms against 24.13 with the cast kernel after the
update), so ``lowbit.flax.apply_updates_with_fp8_weights`` uses it only when asked
(``fused=True``); it is also an independent jnp statement of the kernel's bytes.
:func:`apply_update_with_fp8_copies` is the update itself (``w + update``) with its copies.

Delayed scaling only: its per-expert scales are known before the update (the state), so the
cast needs no amax pass over the new weights first. The numerics follow the CPU reference
kernel (csrc/kernels/cpu/quantize.cc): ``w * scale`` in float32, round to nearest even,
saturate to the format's max (Inf included), NaN to the canonical NaN code 0x7F; the amax
ignores NaN; a non-finite amax poisons the expert's decode scales (NaN), as every lowbit cast
does. No FP8 -> float round trip is taken (XLA on the GPU deletes such convert pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import delayed_scaling as ds
from lowbit.ops.fused.grouped_prequantized import QuantizedExperts
from lowbit.ops.gemm import pad_to
from lowbit.quantization.checks import check_scale_value
from lowbit.recipe import DelayedScaling, Recipe

_NAN_CODE = 0x7F  # encode_rne's canonical NaN for E4M3 and E5M2 alike
_FLOATS = (np.float32, jnp.bfloat16, np.float16)


def _check(op: str, w, recipe: Recipe) -> None:
    if not isinstance(recipe, DelayedScaling):
        raise ValueError(
            f"{op}: recipe must be DelayedScaling (the in-update copies use its per-expert scales), "
            f"got {type(recipe).__name__}; other recipes: lowbit.moe.quantize_experts"
        )
    if jnp.ndim(w) != 3:
        raise ValueError(f"{op}: w must be (G, K, N), got shape {tuple(jnp.shape(w))}")
    if np.dtype(w.dtype) not in [np.dtype(t) for t in _FLOATS]:
        raise ValueError(f"{op}: w must be float32, bfloat16 or float16, got {np.dtype(w.dtype).name}")


def delayed_expert_copies(w: jax.Array, recipe: DelayedScaling, state: dict) -> QuantizedExperts:
    """``quantize_experts(w, recipe, state)`` for ``w`` (G, K, N) under DelayedScaling, in jnp
    (see the module docstring); ``state``: ``lowbit.init_grouped_delayed_state(recipe, G)``-shaped
    (its ``kernel_scale`` (G,) encodes)."""
    op = "delayed_expert_copies"
    _check(op, w, recipe)
    G, K, N = w.shape
    state = ds.check_state_arg(op, recipe, state, "lowbit.init_grouped_delayed_state(recipe, G)", G)
    w, state = jax.lax.stop_gradient((w, state))
    # A traced scale that is not positive and finite encodes with 1, as the cast kernel's does.
    scale = check_scale_value(state["kernel_scale"], f"{op}: state['kernel_scale']")
    q = jnp.dtype(recipe.q_dtype("kernel"))
    wp = pad_to(pad_to(w, 1, 16), 2, 16)  # the padding quantize_experts' GEMMs need (zeros)
    Kp, Np = wp.shape[1:]
    v = wp.astype(jnp.float32)
    nan = jnp.isnan(v)
    amax = jnp.max(jnp.where(nan, 0.0, jnp.abs(v)), axis=(1, 2))
    fmax = float(jnp.finfo(q).max)
    codes = jnp.clip(v * scale[:, None, None], -fmax, fmax).astype(q)
    codes = jnp.where(nan, jax.lax.bitcast_convert_type(jnp.uint8(_NAN_CODE), q), codes)
    row = codes.reshape(G * Kp, Np)
    s_inv = jnp.where(jnp.isfinite(amax), 1.0 / scale, jnp.float32(np.nan))
    return QuantizedExperts(row, s_inv, row.T, s_inv, amax, (K, N))


def apply_update_with_fp8_copies(
    w: jax.Array, update: jax.Array, recipe: DelayedScaling, state: dict
) -> tuple[jax.Array, QuantizedExperts]:
    """``(new_w, copies)``: the optimizer's step applied to the master ``w`` (G, K, N)
    (``new_w = (w + update)`` in ``w``'s dtype, as ``optax.apply_updates``) and
    ``delayed_expert_copies(new_w, recipe, state)``, for the next step's
    :func:`lowbit.moe.grouped_gemm_prequantized` / ``moe_block(quantized_weights=...)``.
    ``state``: the DelayedScaling state that step runs with (the one this step's backward
    returned). Call it inside the jitted train step so that XLA fuses the cast into the update."""
    op = "apply_update_with_fp8_copies"
    _check(op, w, recipe)
    if tuple(jnp.shape(update)) != tuple(w.shape):
        raise ValueError(f"{op}: update must have w's shape {tuple(w.shape)}, got {tuple(jnp.shape(update))}")
    new_w = (w + update).astype(w.dtype)
    return new_w, delayed_expert_copies(new_w, recipe, state)


__all__ = ["apply_update_with_fp8_copies", "delayed_expert_copies"]
