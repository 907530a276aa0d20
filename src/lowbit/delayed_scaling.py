"""DelayedScaling state: the amax histories and encode scales of one GEMM's three tensors.

One history and one scale per role (x, kernel, grad): ``<role>_amax_history`` float32 ``(L,)``
(zeros) and ``<role>_scale`` float32 ``(1,)`` (ones). A grouped GEMM keeps one of each per group:
``(L, G)`` and ``(G,)``. An op reads the scales, and returns the state advanced by one step
(:func:`advance`) as the cotangent of the state, which Flax's ``_overwrite_with_gradient``
collection writes back. A non-finite amax never enters a history: the optimizer skips such a
step (``optax.apply_if_finite``), and the state must not remember it for L steps either.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from lowbit.quantization.checks import check_scale_value
from lowbit.recipe import DelayedScaling, Recipe

ROLES = ("x", "kernel", "grad")
STATE_KEYS = tuple(k for r in ROLES for k in (f"{r}_amax_history", f"{r}_scale"))
_FLT_MAX = float(np.finfo(np.float32).max)


def state_layout(
    recipe: DelayedScaling, num_groups: Optional[int] = None
) -> dict[str, tuple[tuple, Callable]]:
    """``{key: (shape, init)}`` in STATE_KEYS order: histories start at 0, scales at 1."""
    L = recipe.amax_history_len
    hist, scale = ((L,), (1,)) if num_groups is None else ((L, num_groups), (num_groups,))
    return {k: (hist, jnp.zeros) if k.endswith("history") else (scale, jnp.ones) for k in STATE_KEYS}


def _require_recipe(fn: str, recipe) -> None:
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{fn} needs a DelayedScaling recipe, got {type(recipe).__name__}")


def init_delayed_state(recipe: DelayedScaling) -> dict[str, jax.Array]:
    """Fresh state of one dense: empty amax histories (L,) and unit scales (1,), float32."""
    _require_recipe("init_delayed_state", recipe)
    return {k: init(shape, jnp.float32) for k, (shape, init) in state_layout(recipe).items()}


def init_grouped_delayed_state(recipe: DelayedScaling, num_groups: int) -> dict[str, jax.Array]:
    """Fresh DelayedScaling state of one grouped GEMM: ``{x,kernel,grad}_amax_history`` float32
    ``(L, G)`` (zeros) and ``{x,kernel,grad}_scale`` float32 ``(G,)`` (ones). Its "gradient"
    through :func:`lowbit.grouped_gemm` is the updated state."""
    _require_recipe("init_grouped_delayed_state", recipe)
    return {k: init(shape, jnp.float32) for k, (shape, init) in state_layout(recipe, num_groups).items()}


def update_delayed_scale(
    history: ArrayLike, scale: ArrayLike, amax: ArrayLike, recipe: DelayedScaling, q_dtype: DTypeLike
) -> tuple[jax.Array, jax.Array]:
    """One step of DelayedScaling: push ``amax`` as the newest entry (index 0, the oldest falls
    off the end) and recompute the encode scale from the updated history.

    scale = (fp8_max / a) / 2**margin, a = max(history) ("max") or history[0] ("most_recent"),
    clamped to the largest float32; the previous scale is kept where a is 0 or not finite.
    A non-finite ``amax`` leaves history and scale unchanged (an Inf would pin the scale for
    L steps).
    """
    amax = jnp.reshape(amax, ()).astype(jnp.float32)
    old = jnp.asarray(history, jnp.float32)
    history = jnp.roll(old, 1).at[0].set(amax)
    a = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    fmax = float(jnp.finfo(q_dtype).max)
    new = jnp.minimum((jnp.float32(fmax) / a) / jnp.float32(2.0**recipe.margin), jnp.float32(_FLT_MAX))
    ok = jnp.isfinite(a) & (a > 0)
    scale = jnp.asarray(scale, jnp.float32)
    finite = jnp.isfinite(amax)
    return jnp.where(finite, history, old), jnp.where(finite & ok, new, scale).astype(jnp.float32)


def advance(recipe: DelayedScaling, state: dict, amaxes: dict, grouped: bool = False) -> dict:
    """``state`` with the roles of ``amaxes`` ({role: amax}) advanced one step; other roles kept.
    ``grouped``: one history column and one scale per group (the update runs per group)."""
    out = dict(state)
    for role, amax in amaxes.items():
        q = recipe.q_dtype(role)

        def step(h, s, a, q=q):
            return update_delayed_scale(h, s, a, recipe, q)

        if grouped:
            step = jax.vmap(step, in_axes=(1, 0, 0), out_axes=(1, 0))
        out[f"{role}_amax_history"], out[f"{role}_scale"] = step(
            state[f"{role}_amax_history"], state[f"{role}_scale"], amax
        )
    return out


def advance_step(recipe: DelayedScaling, state: dict, amaxes: dict, grouped: bool = False) -> dict:
    """:func:`advance` for one GEMM's whole step (all its roles), or ``state`` unchanged when any
    of the amaxes is not finite: that step's loss is non-finite and the optimizer skips it, so
    the state stays as if the step never ran."""
    new = advance(recipe, state, amaxes, grouped)
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in amaxes.values()]))
    return {k: jnp.where(ok, new[k], v) for k, v in state.items()}


def scale_of(state: Optional[dict], role: str) -> Optional[jax.Array]:
    """The encode scale of ``role`` (None without state: the recipe is not DelayedScaling)."""
    return None if state is None else state[f"{role}_scale"]


def check_state_arg(
    op: str, recipe: Recipe, state: Optional[dict], init_hint: str, num_groups: Optional[int] = None
) -> Optional[dict]:
    """The state an op runs with: checked under DelayedScaling (keys, shapes, float32), refused
    under other recipes. ``init_hint`` names the call that makes a fresh one."""
    if not isinstance(recipe, DelayedScaling):
        if state is not None:
            raise ValueError(f"{op}: state is only used with DelayedScaling, not {type(recipe).__name__}")
        return None
    if state is None:
        raise ValueError(
            f"{op}: DelayedScaling needs state={init_hint} (the amax histories and scales; "
            "Flax modules keep it in the '_overwrite_with_gradient' collection)"
        )
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{op}: state is missing {missing}")
    for k, (want, _) in state_layout(recipe, num_groups).items():
        v = state[k]
        if tuple(v.shape) != want or np.dtype(v.dtype) != np.float32:
            raise ValueError(
                f"{op}: state[{k!r}] must be float32 of shape {want}, got "
                f"{np.dtype(v.dtype).name} {tuple(v.shape)}"
            )
    for role in ROLES:  # concrete scales only; traced ones are guarded where quantize reads them
        check_scale_value(state[f"{role}_scale"], f"{op}: state[{role + '_scale'!r}]")
    return {k: state[k] for k in STATE_KEYS}


__all__ = [
    "ROLES",
    "STATE_KEYS",
    "advance",
    "advance_step",
    "check_state_arg",
    "init_delayed_state",
    "init_grouped_delayed_state",
    "scale_of",
    "state_layout",
    "update_delayed_scale",
]
