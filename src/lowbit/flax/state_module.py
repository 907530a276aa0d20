"""Flax linen wrappers: a function run inside a parameter-free module that owns the recipe's
state (DelayedScaling's amax histories and scales) and RNG stream (NVFP4's stochastic rounding).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.delayed_scaling import state_layout
from lowbit.recipe import DelayedScaling, NVFP4BlockScaling, Recipe

#: The collection whose "gradient" is the new value (Flax's TrainState overwrites it).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
#: The RNG stream NVFP4's stochastic rounding draws from.
SR_RNG = "sr_rng"


@dataclasses.dataclass(frozen=True)
class QuantizeContext:
    """What a wrapped function needs to quantize: the recipe, its state and its RNG key."""

    recipe: Optional[Recipe]
    state: Optional[dict]
    rng: Optional[jax.Array]

    def dense_kwargs(self) -> dict:
        return dict(recipe=self.recipe, state=self.state, rng=self.rng)


#: Key of the call counter in a scope's ``rng_counters`` (a tuple: never an RNG stream's name).
_CALLS_KEY = ("lowbit", "delayed_state_calls")


def call_index(module: nn.Module, site: str = "") -> int:
    """How many times ``module``'s state (``site``: which of its states) was read before in this
    init/apply: 0 on the first call.

    Kept beside Flax's own per-call counters (those that give each call of a shared module its
    own ``make_rng`` key): shared by every scope object of the same module path in one
    init/apply, and replayed by ``nn.jit`` on a cache hit.
    """
    counters, key = module.scope.rng_counters, _CALLS_KEY + (site,)
    i = counters.get(key, 0)
    counters[key] = i + 1
    return i


def state_variable_name(key: str, call: int) -> str:
    """The variable holding ``key`` of the ``call``-th call of a module (first call: ``key``)."""
    return key if call == 0 else f"{key}_call{call}"


def delayed_state_variables(
    module: nn.Module, recipe: DelayedScaling, num_groups: Optional[int] = None
) -> dict[str, jax.Array]:
    """The DelayedScaling state as variables of ``module`` in ``_overwrite_with_gradient``
    (created at init, read after); ``num_groups``: one history and scale per group.

    Each call of the module in one step gets its own state (``<key>_call<i>`` from the second
    call on): the new state is the "gradient" of the state, and Flax would sum the gradients of
    a state read twice (a shared or tied module), so a shared module keeps the state that
    separate modules would.
    """
    call = call_index(module)
    return {
        k: module.variable(
            OVERWRITE_WITH_GRADIENT, state_variable_name(k, call), init, shape, jnp.float32
        ).value
        for k, (shape, init) in state_layout(recipe, num_groups).items()
    }


def wrap_function_in_state_module(
    f: Callable, recipe: Optional[Recipe] = None, name: Optional[str] = None
) -> type[nn.Module]:
    """Returns a Flax module class whose ``__call__(*args, **kwargs)`` is
    ``f(ctx, *args, **kwargs)`` with ``ctx`` a :class:`QuantizeContext`.

    The module creates no parameters. With DelayedScaling it keeps ``{x,kernel,grad}_amax_history
    (L,)`` and ``{x,kernel,grad}_scale (1,)`` in the ``_overwrite_with_gradient`` collection (one
    set per call in a step: :func:`delayed_state_variables`); with
    NVFP4 (stochastic rounding on) it draws a key from the ``sr_rng`` stream when one is given.
    ``recipe=None`` uses the recipe of the enclosing :func:`lowbit.autocast` at trace time.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowbit recipe or None, got {type(recipe).__name__}")
    label = name or getattr(f, "__name__", "function")

    class _Wrapper(nn.Module):
        @nn.compact
        def __call__(self, *args, **kwargs):
            r = recipe if recipe is not None else get_recipe()
            state = delayed_state_variables(self, r) if isinstance(r, DelayedScaling) else None
            rng = None
            if (
                isinstance(r, NVFP4BlockScaling)
                and not r.disable_stochastic_rounding
                and self.has_rng(SR_RNG)
            ):
                rng = self.make_rng(SR_RNG)
            return f(QuantizeContext(r, state, rng), *args, **kwargs)

    cls_name = f"LowbitWrapper_{label}"
    _Wrapper.__name__ = _Wrapper.__qualname__ = cls_name
    return _Wrapper


#: TransformerEngine's name.
wrap_function_in_te_state_module = wrap_function_in_state_module
