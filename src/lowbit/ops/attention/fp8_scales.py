"""The scales of FP8 attention (``fp8_dpa=True``) under the per-tensor recipes, and the
DelayedScaling state that carries them.

Ten tensors have an encode scale (fp8 = x * scale): the inputs q, k, v and the probabilities s
and output o (forward format, E4M3), the output gradient do, the softmax-input gradient dp and
the gradients dq, dk, dv (backward format: E5M2 under HYBRID).

* DelayedScaling: one amax history ``(L,)`` and scale ``(1,)`` per tensor (``<role>_amax_history``,
  ``<role>_scale``), as the dense layers keep theirs; the op's "gradient" of the state is the state
  advanced by this step's amaxes (q, k, v, do measured here, s and o by the forward kernel, dp, dq,
  dk, dv by the backward kernel).
* Float8CurrentScaling: q, k, v and do from their own amax (``fp8_max / amax``). The kernels need
  the scales of s, o, dp, dq, dk, dv before they run, so these come from bounds on the tensors that
  the current amaxes give (:func:`current_output_scales`): exact upper bounds, so nothing saturates;
  loose ones cost resolution, which the backward format's range (E5M2: 2^30) absorbs. Under an
  E4M3 backward format (range 2^15) the loose gradient bounds could push values below E4M3's
  smallest subnormal, so current scaling needs the HYBRID format for FP8 attention.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from lowbit.delayed_scaling import update_delayed_scale
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, Format

FWD_ROLES = ("q", "k", "v", "s", "o")
BWD_ROLES = ("do", "dp", "dq", "dk", "dv")
ROLES = FWD_ROLES + BWD_ROLES
STATE_KEYS = tuple(k for r in ROLES for k in (f"{r}_amax_history", f"{r}_scale"))

# Rounding to E4M3 moves a value by at most 2^-4 of it: inputs decoded from FP8 and the FP8
# probabilities the kernel multiplies with are each at most this factor above the exact values.
ROUND = 1.0625


def check_recipe(recipe) -> None:
    """FP8 attention runs under DelayedScaling and Float8CurrentScaling (fp8_format HYBRID for the
    latter); anything else is an error naming what is wrong."""
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise NotImplementedError(
            f"fp8_dpa=True: FP8 attention runs under DelayedScaling or Float8CurrentScaling, not "
            f"{type(recipe).__name__}"
        )
    if isinstance(recipe, Float8CurrentScaling) and recipe.fp8_format is not Format.HYBRID:
        raise NotImplementedError(
            f"Float8CurrentScaling(fp8_format={recipe.fp8_format}, fp8_dpa=True): current scaling "
            "bounds the attention gradients' scales, which only E5M2's range absorbs; use "
            "fp8_format=Format.HYBRID"
        )


def dtypes(recipe):
    """(forward dtype, backward dtype) of FP8 attention under ``recipe``."""
    return recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype


def state_layout(recipe: DelayedScaling) -> dict:
    """``{key: (shape, init)}``: histories ``(L,)`` of zeros, scales ``(1,)`` of ones."""
    L = recipe.amax_history_len
    return {k: ((L,), jnp.zeros) if k.endswith("history") else ((1,), jnp.ones) for k in STATE_KEYS}


def init_state(recipe: DelayedScaling) -> dict:
    """Fresh DelayedScaling state of one FP8 attention."""
    return {k: init(shape, jnp.float32) for k, (shape, init) in state_layout(recipe).items()}


def check_state(recipe, state: Optional[dict]) -> Optional[dict]:
    """The state the op runs with: required (keys, shapes) under DelayedScaling, else refused."""
    if not isinstance(recipe, DelayedScaling):
        if state is not None:
            name = type(recipe).__name__
            raise ValueError(f"fp8 attention: state is only used with DelayedScaling, not {name}")
        return None
    if state is None:
        raise ValueError(
            "fp8 attention: DelayedScaling needs state=init_state(recipe) (amax histories and scales; "
            "Flax modules keep it in the '_overwrite_with_gradient' collection)"
        )
    for k, (shape, _) in state_layout(recipe).items():
        if k not in state or tuple(state[k].shape) != shape:
            got = None if k not in state else tuple(state[k].shape)
            raise ValueError(f"fp8 attention: state[{k!r}] must be float32 of shape {shape}, got {got}")
    return {k: jnp.asarray(state[k], jnp.float32) for k in STATE_KEYS}


def amax(x) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def encode_scale(a, fmax) -> jax.Array:
    """``fmax / a`` (1 where ``a`` is 0 or not finite), clamped to float32's range."""
    a = jnp.asarray(a, jnp.float32)
    ok = jnp.isfinite(a) & (a > 0)
    s = jnp.minimum(jnp.float32(fmax) / jnp.where(ok, a, 1.0), jnp.finfo(jnp.float32).max)
    return jnp.where(ok, s, 1.0).astype(jnp.float32)


def fmax(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def current_output_scales(recipe, a: dict, *, scale: float, rate: float, sq: int, d: int) -> dict:
    """Scales of s, o, dp, dq, dk, dv from the current amaxes ``a`` of q, k, v, do (of the tensors
    as given; ``ROUND`` covers their FP8 rounding). With ``P <= 1`` the probabilities,
    ``P' = P * keep / (1 - rate)`` after dropout, ``D_i = sum_j P'_ij dP_ij``:

    * s: ``P' <= 1 / (1 - rate)``;
    * o: a row of ``P' v`` with ``sum_j P'_ij <= ROUND / (1 - rate)``: ``|o| <= ROUND a_v / (1-rate)``;
    * dp (the softmax input's gradient ``P (dP' - D)``): ``|dP_ij| <= d a_do a_v``, so
      ``|dp| <= 4 d a_do a_v / (1 - rate)`` (covers ``1 + ROUND`` and the roundings);
    * dv ``= P'^T do``: ``|dv| <= sq ROUND a_do / (1 - rate)``;
    * dq ``= scale dp k``: ``sum_j |dp_ij| <= ROUND`` times the dp bound, so ``scale a_k`` times it;
    * dk ``= scale dp^T q``: ``sq`` rows: ``scale a_q sq`` times the dp bound.

    Each bound is taken ``ROUND^2`` larger again for the inputs' rounding."""
    f, b = dtypes(recipe)
    keep = 1.0 - rate
    r2 = ROUND * ROUND
    bound_dp = 4.0 * d * a["do"] * a["v"] * r2 / keep
    bounds = {
        "o": ROUND * a["v"] * r2 / keep,
        "dp": bound_dp,
        "dv": sq * ROUND * a["do"] * r2 / keep,
        "dq": scale * a["k"] * bound_dp * r2,
        "dk": scale * a["q"] * sq * bound_dp * r2,
    }
    out = {r: encode_scale(v, fmax(f if r == "o" else b)) for r, v in bounds.items()}
    out["s"] = jnp.float32(fmax(f) * keep)
    return out


def step_state(recipe: DelayedScaling, state: dict, amaxes: dict) -> dict:
    """The state advanced by one step's amaxes (one per role), or unchanged when any is not
    finite (the optimizer skips that step; see lowbit.delayed_scaling.advance_step)."""
    f, b = dtypes(recipe)
    new = dict(state)
    for r in ROLES:
        h, s = update_delayed_scale(
            state[f"{r}_amax_history"], state[f"{r}_scale"], amaxes[r], recipe, f if r in FWD_ROLES else b
        )
        new[f"{r}_amax_history"], new[f"{r}_scale"] = h, s.reshape(1)
    ok = jnp.all(jnp.stack([jnp.isfinite(jnp.reshape(amaxes[r], ())) for r in ROLES]))
    return {k: jnp.where(ok, new[k], v) for k, v in state.items()}


__all__ = [
    "BWD_ROLES",
    "FWD_ROLES",
    "ROLES",
    "STATE_KEYS",
    "amax",
    "check_recipe",
    "check_state",
    "current_output_scales",
    "dtypes",
    "encode_scale",
    "init_state",
    "state_layout",
    "step_state",
]
