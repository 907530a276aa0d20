"""Flax linen wrappers: a function run inside a parameter-free module that owns the recipe's
state (DelayedScaling's amax histories and scales) and RNG stream (NVFP4's stochastic rounding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.ops.dense import STATE_KEYS, dense
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


def wrap_function_in_state_module(f: Callable, recipe: Optional[Recipe] = None, name: Optional[str] = None):
    """Returns a Flax module class whose ``__call__(*args, **kwargs)`` is
    ``f(ctx, *args, **kwargs)`` with ``ctx`` a :class:`QuantizeContext`.

    The module creates no parameters. With DelayedScaling it keeps ``{x,kernel,grad}_amax_history
    (L,)`` and ``{x,kernel,grad}_scale (1,)`` in the ``_overwrite_with_gradient`` collection; with
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
            state = None
            if isinstance(r, DelayedScaling):
                state = {}
                for k in STATE_KEYS:
                    shape = (r.amax_history_len,) if k.endswith("history") else (1,)
                    init = jnp.zeros if k.endswith("history") else jnp.ones
                    state[k] = self.variable(OVERWRITE_WITH_GRADIENT, k, init, shape, jnp.float32).value
            rng = None
            if isinstance(r, NVFP4BlockScaling) and not r.disable_stochastic_rounding and self.has_rng(SR_RNG):
                rng = self.make_rng(SR_RNG)
            return f(QuantizeContext(r, state, rng), *args, **kwargs)

    cls_name = f"LowbitWrapper_{label}"
    _Wrapper.__name__ = _Wrapper.__qualname__ = cls_name
    return _Wrapper


#: TransformerEngine's name.
wrap_function_in_te_state_module = wrap_function_in_state_module


def _check_dimension_numbers(dimension_numbers, lhs_ndim: int):
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"lowbit dot_general: dimension_numbers must be ((lhs_contract, rhs_contract), "
                         f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    if tuple(lb) or tuple(rb):
        raise ValueError(
            f"lowbit dot_general: batch dimensions are not supported (got lhs_batch={tuple(lb)}, "
            f"rhs_batch={tuple(rb)}); use DenseGeneral without batch_dims, or lax.dot_general for batched matmuls")
    lc = tuple(d + lhs_ndim if d < 0 else d for d in lc)
    if sorted(lc) != list(range(lhs_ndim - len(lc), lhs_ndim)):
        raise ValueError(
            f"lowbit dot_general: lhs must be contracted over its trailing axes (got {tuple(lc)} for rank {lhs_ndim})")
    return tuple(lc), tuple(rc)


def make_dot_general_cls(recipe: Optional[Recipe] = None, *, fast_accum: bool = True):
    """A Flax module class for ``nn.Dense(..., dot_general=cls())`` (or ``dot_general_cls=cls``).

    Its instance is called like ``lax.dot_general(lhs, rhs, dimension_numbers, precision,
    preferred_element_type)`` and runs :func:`lowbit.dense` (quantized forward and backward);
    ``precision`` is ignored (the recipe decides). It creates no parameters.
    """

    def dot_general(ctx: QuantizeContext, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, **unused: Any):
        contracting = _check_dimension_numbers(dimension_numbers, jnp.ndim(lhs))
        return dense(lhs, rhs, contracting_dims=contracting, out_dtype=preferred_element_type,
                     fast_accum=fast_accum, **ctx.dense_kwargs())

    return wrap_function_in_state_module(dot_general, recipe, "dot_general")
