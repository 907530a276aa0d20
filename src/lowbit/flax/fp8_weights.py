"""FP8 primary expert weights for the Flax MoE block: the FP8 copies of its expert weights
(:func:`lowbit.moe.quantize_experts`, both layouts) kept in the ``"fp8_weights"`` collection,
remade by the training loop after each optimizer update, read by the step instead of casting
``wi`` / ``wo`` (the gradients still reach the float masters in ``params``).

The training loop's one change: build the next step's variables through
:func:`refresh_fp8_weights` (inside the jitted step, after the optimizer update)::

    variables = lowbit.flax.refresh_fp8_weights({**grads, "params": params})

(TE's loop: ``var_collect = refresh_fp8_weights({**var_collect, "params": state.params})``).
Call it once on ``model.init``'s variables as well, or the first step casts (and the second
compiles again).

Safe by default: ``init`` only declares the collection (an :class:`ExpertCopies` holding the
recipe and no arrays: nothing to optimize or overwrite); until the loop fills it, or when it is
absent or the recipe differs, the block casts its weights in the step as before. Once filled,
the copies' "gradient" is NaN scales: a loop that carries it into the next step without the
refresh gets a NaN loss, never stale weights.

Cost: the refresh is the same cast the step would make (one read of the masters, both FP8
copies written); it leaves the step, not the training loop. :func:`apply_updates_with_fp8_weights`
applies the optimizer's updates and remakes the copies in one call::

    updates, opt_state = tx.update(grads["params"], opt_state, params)
    variables = lowbit.flax.apply_updates_with_fp8_weights({**grads, "params": params}, updates)

with ``fused=True`` (DelayedScaling) the copies are jnp (:mod:`lowbit.ops.fused.expert_copies_jnp`,
the same bytes) that XLA may fuse into the update; on an H200 that was slower than the cast
kernel after the update (the full G64 step 25.67 against 24.13 ms), so the kernel is the default.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.delayed_scaling import STATE_KEYS
from lowbit.flax.state_module import OVERWRITE_WITH_GRADIENT, call_index
from lowbit.ops.fused.expert_copies_jnp import delayed_expert_copies
from lowbit.ops.fused.grouped_prequantized import QuantizedExperts, quantize_experts
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe

#: The collection holding the FP8 copies of the MoE blocks' expert weights.
FP8_WEIGHTS = "fp8_weights"
_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertCopies:
    """One MoE block's entry in ``"fp8_weights"``: ``quantize_experts(wi)`` and
    ``quantize_experts(wo)``, or None in the declaration ``init`` makes; ``recipe`` (static) the
    recipe they are made for."""

    wi: Optional[QuantizedExperts]
    wo: Optional[QuantizedExperts]
    recipe: Recipe = dataclasses.field(metadata=dict(static=True))

    @property
    def ready(self) -> bool:
        return self.wi is not None and self.wo is not None


@jax.custom_vjp
def _nan_cotangent(copies):
    return copies


def _nan_fwd(copies):
    return copies, copies


def _nan_bwd(copies, _):
    # The copies' "gradient" is no copy: NaN scales make a loop that writes it back unrefreshed fail loudly.
    def poison(a):
        return jnp.full_like(a, jnp.nan) if a.dtype == jnp.float32 else jnp.zeros_like(a)

    return (jax.tree_util.tree_map(poison, copies),)


_nan_cotangent.defvjp(_nan_fwd, _nan_bwd)


def expert_copies(module: nn.Module, recipe, wi, wo, enabled: bool = True) -> Optional[tuple]:
    """The ``quantized_weights`` for :func:`lowbit.moe.moe_block` from ``module``'s
    ``"fp8_weights"`` entry, or None (the step casts): not enabled, not an FP8 recipe, no filled
    entry for this recipe, or a second call of a shared module under DelayedScaling (its copies
    follow the first call's state)."""
    if not enabled or not isinstance(recipe, _RECIPES):
        return None
    if module.is_initializing() and module.is_mutable_collection(FP8_WEIGHTS):
        module.variable(FP8_WEIGHTS, "experts", ExpertCopies, None, None, recipe)
        return None
    if not module.has_variable(FP8_WEIGHTS, "experts"):
        return None
    c = module.get_variable(FP8_WEIGHTS, "experts")
    if not isinstance(c, ExpertCopies) or not c.ready or c.recipe != recipe:
        return None
    if isinstance(recipe, DelayedScaling) and call_index(module, FP8_WEIGHTS) > 0:
        return None
    for name, q, w in (("wi", c.wi, wi), ("wo", c.wo, wo)):
        if (q.amax.shape[0], *q.kn) != tuple(w.shape):
            raise ValueError(
                f"{FP8_WEIGHTS}: the copy of {name} is for shape {(q.amax.shape[0], *q.kn)}, the "
                f"parameter is {tuple(w.shape)}; remake the copies with refresh_fp8_weights"
            )
    return _nan_cotangent((c.wi, c.wo))


def _module_state(states, path, name):
    node = functools.reduce(lambda t, k: t[k], path + (name,), states)
    return {k: node[k] for k in STATE_KEYS}  # the first call's state (the one the copies follow)


def _remake(node, path, params, states, quantize=quantize_experts, op="refresh_fp8_weights"):
    if isinstance(node, ExpertCopies):
        r = node.recipe
        p = functools.reduce(lambda t, k: t[k], path, params)
        s1 = s2 = None
        if isinstance(r, DelayedScaling):
            s1, s2 = _module_state(states, path, "fc1_state"), _module_state(states, path, "fc2_state")
        return ExpertCopies(quantize(p["wi"], r, s1), quantize(p["wo"], r, s2), r)
    if isinstance(node, Mapping):
        # The entry sits one level below its module ("experts"): its module path stops before it.
        return {
            k: _remake(v, path if isinstance(v, ExpertCopies) else path + (k,), params, states, quantize, op)
            for k, v in node.items()
        }
    raise TypeError(f"{op}: unexpected {type(node).__name__} in the {FP8_WEIGHTS!r} collection")


def refresh_fp8_weights(variables: Mapping) -> Mapping:
    """``variables`` with every MoE block's FP8 expert copies remade from ``params`` (and, under
    DelayedScaling, the block's ``_overwrite_with_gradient`` state: the new one, so run it after
    the step). Unchanged when there is no ``"fp8_weights"`` collection."""
    return _refreshed("refresh_fp8_weights", variables, quantize_experts)


def _in_update(w, recipe, state):
    # DelayedScaling's copies in jnp (fused into the update); the others need an amax pass first.
    if isinstance(recipe, DelayedScaling):
        return delayed_expert_copies(w, recipe, state)
    return quantize_experts(w, recipe, state)


def apply_updates_with_fp8_weights(variables: Mapping, updates, *, fused: bool = False) -> Mapping:
    """``variables`` with ``params`` updated (``params + updates`` in each parameter's dtype, as
    ``optax.apply_updates``) and every MoE block's FP8 expert copies made from the new params.
    ``fused=True`` (DelayedScaling only) writes them in jnp so that XLA can put the cast in the
    update's own fusion; the default casts with lowbit's kernel (:func:`lowbit.moe.quantize_experts`)
    after the update, which measured faster: the full G64 step with AdamW 24.13 ms against
    25.67 (G8 46.51 against 48.53; one H200, ``python -m lowbit.bench moe``, ``... + adamw``
    rows). Either way the copies equal ``refresh_fp8_weights`` of the updated variables byte for
    byte (on a GPU the scale inverses to one ulp). ``variables``:
    the step's ``{**grads, "params": params}`` (the non-params collections hold their
    "gradients": the new DelayedScaling state the copies are made with); ``updates``: the
    optimizer's, with ``params``' tree structure. Call it inside the jitted train step."""
    if not isinstance(fused, bool):
        raise ValueError(f"apply_updates_with_fp8_weights: fused must be a bool, got {fused!r}")
    if "params" not in variables:
        raise ValueError("apply_updates_with_fp8_weights: variables must hold 'params'")
    pl, treedef = jax.tree_util.tree_flatten_with_path(variables["params"])
    ul = jax.tree_util.tree_leaves_with_path(updates)
    if [k for k, _ in pl] != [k for k, _ in ul]:  # by key paths: a FrozenDict and a dict agree
        raise ValueError(
            "apply_updates_with_fp8_weights: updates must have the tree structure of "
            f"variables['params'], got {jax.tree_util.tree_structure(updates)}"
        )
    for (path, p), (_, u) in zip(pl, ul):
        if jnp.shape(u) != jnp.shape(p):
            raise ValueError(
                f"apply_updates_with_fp8_weights: updates{jax.tree_util.keystr(path)} must have its "
                f"parameter's shape {tuple(jnp.shape(p))}, got {tuple(jnp.shape(u))}"
            )
    new = treedef.unflatten([jnp.asarray(p + u).astype(jnp.result_type(p)) for (_, p), (_, u) in zip(pl, ul)])
    out = {**variables, "params": new}
    out = flax.core.freeze(out) if isinstance(variables, flax.core.FrozenDict) else out
    return _refreshed("apply_updates_with_fp8_weights", out, _in_update if fused else quantize_experts)


def _refreshed(op: str, variables: Mapping, quantize) -> Mapping:
    if FP8_WEIGHTS not in variables:
        return variables
    if "params" not in variables:
        raise ValueError(f"{op}: variables must hold 'params' beside {FP8_WEIGHTS!r}")
    params = nn.meta.unbox(variables["params"])
    states = variables.get(OVERWRITE_WITH_GRADIENT, {})
    out = {**variables, FP8_WEIGHTS: _remake(variables[FP8_WEIGHTS], (), params, states, quantize, op)}
    return flax.core.freeze(out) if isinstance(variables, flax.core.FrozenDict) else out


__all__ = [
    "FP8_WEIGHTS",
    "ExpertCopies",
    "apply_updates_with_fp8_weights",
    "expert_copies",
    "refresh_fp8_weights",
]
