"""``make_ragged_dot_cls(recipe)``: a Flax module to call where a model calls ``jax.lax.ragged_dot``.

The module creates no parameters. Its call takes ragged_dot's arguments and runs
:func:`lowbit.grouped_gemm`; with DelayedScaling it keeps one amax history and one scale per
group for each role (``{x,kernel,grad}_amax_history`` float32 ``(L, G)``,
``{x,kernel,grad}_scale`` float32 ``(G,)``) in the ``_overwrite_with_gradient`` collection,
whose "gradient" is the updated state (a training step overwrites the state with it).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax.state_module import OVERWRITE_WITH_GRADIENT, delayed_state_variables
from lowbit.ops.grouped_gemm import grouped_gemm
from lowbit.recipe import DelayedScaling, Recipe

__all__ = ["OVERWRITE_WITH_GRADIENT", "make_ragged_dot_cls"]


def make_ragged_dot_cls(recipe: Optional[Recipe] = None, *, fast_accum: bool = True) -> type[nn.Module]:
    """A Flax module class; ``cls()(lhs, rhs, group_sizes)`` computes
    ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` with lowbit's grouped GEMM.

    ``recipe``: Float8CurrentScaling or DelayedScaling (FP8 with per-group scales),
    Float8BlockScaling (FP8 with 1x128 / 128x128 block scales), or None:
    the recipe of the enclosing :func:`lowbit.autocast` at trace time, BF16 outside one.
    ``precision`` is ignored (the recipe decides); ``group_offset`` is not supported.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowbit recipe or None, got {type(recipe).__name__}")

    class RaggedDot(nn.Module):
        @nn.compact
        def __call__(
            self,
            lhs: jax.Array,
            rhs: jax.Array,
            group_sizes: jax.Array,
            precision=None,
            preferred_element_type=None,
            group_offset=None,
        ) -> jax.Array:
            if group_offset is not None:
                raise NotImplementedError("lowbit ragged_dot: group_offset is not supported")
            r = recipe if recipe is not None else get_recipe()
            state = None
            if isinstance(r, DelayedScaling):
                state = delayed_state_variables(self, r, num_groups=jnp.shape(rhs)[0])
            return grouped_gemm(
                lhs,
                rhs,
                group_sizes,
                recipe=r,
                state=state,
                preferred_element_type=preferred_element_type,
                fast_accum=fast_accum,
            )

    return RaggedDot
