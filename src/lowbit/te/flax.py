"""``transformer_engine.jax.flax``: lowbit's Flax modules, and TE's state-module wrapper.

:func:`wrap_function_in_te_state_module` gives the wrapped function TE's first argument, a
quantizer-set generator (lowbit's own :func:`lowbit.flax.wrap_function_in_state_module` passes a
QuantizeContext instead).
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax import (
    OVERWRITE_WITH_GRADIENT,
    SR_RNG,
    DenseGeneral,
    DotProductAttention,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    Softmax,
    TransformerLayer,
    TransformerLayerType,
    make_dot_general_cls,
    make_ragged_dot_cls,
)
from lowbit.flax.positions import RelativePositionBiases
from lowbit.flax.state_module import call_index, state_variable_name
from lowbit.recipe import DelayedScaling, NVFP4BlockScaling, Recipe
from lowbit.te.grouped_dense import _MoEBlock, make_grouped_dense_cls  # noqa: F401 (TE's names)
from lowbit.te.quantize import QuantizerSet, quantizer_set_for_recipe
from lowbit.te.sharding import extend_logical_axis_rules

_ROLES = ("x", "kernel", "grad")


def _delayed_state(module: nn.Module, recipe: DelayedScaling, postfix: str, collection: str) -> dict:
    # One state per call (lowbit.flax.delayed_state_variables says why): "<name>_call<i>" after the first.
    call, state = call_index(module, postfix), {}
    for role in _ROLES:
        h = module.variable(
            collection,
            state_variable_name(f"{postfix}{role}_amax_history", call),
            jnp.zeros,
            (recipe.amax_history_len,),
            jnp.float32,
        )
        s = module.variable(
            collection, state_variable_name(f"{postfix}{role}_scale", call), jnp.ones, (1,), jnp.float32
        )
        state[f"{role}_amax_history"], state[f"{role}_scale"] = h.value, s.value
    return state


def wrap_function_in_te_state_module(
    f: Callable, quantization_recipe: Optional[Recipe] = None, name: Optional[str] = None
):
    """A Flax module class whose ``__call__(*args, **kwargs)`` is
    ``f(generate_quantizer_set, *args, **kwargs)``, as in TransformerEngine.

    ``generate_quantizer_set(postfix="", variable_collection=None, quantization_checkpoint_name=None,
    fp8_recipe=None)`` returns the :class:`QuantizerSet` of the recipe (``fp8_recipe``, else
    ``quantization_recipe``, else the enclosing autocast's; noop with none). DelayedScaling state
    lives in ``_overwrite_with_gradient`` as ``{postfix}{x,kernel,grad}_{amax_history,scale}``;
    NVFP4 draws its stochastic-rounding key from the ``sr_rng`` stream when one is given.
    """
    if quantization_recipe is not None and not isinstance(quantization_recipe, Recipe):
        raise TypeError(
            f"quantization_recipe must be a lowbit recipe or None, got {type(quantization_recipe).__name__}"
        )
    label = name or getattr(f, "__name__", "function")

    class _TEWrapper(nn.Module):
        @nn.compact
        def __call__(self, *args, **kwargs):
            def generate_quantizer_set(
                postfix: str = "",
                variable_collection: Optional[str] = None,
                quantization_checkpoint_name: Optional[str] = None,
                fp8_recipe: Optional[Recipe] = None,
                n_groups: Optional[int] = None,
            ) -> QuantizerSet:
                del quantization_checkpoint_name  # lowbit names its GEMMs for remat itself
                if n_groups is not None:
                    raise NotImplementedError(
                        "generate_quantizer_set(n_groups=...): grouped quantizer sets "
                        "are not supported by lowbit.te"
                    )
                r = fp8_recipe or quantization_recipe or get_recipe()
                state = None
                if isinstance(r, DelayedScaling):
                    state = _delayed_state(self, r, postfix, variable_collection or OVERWRITE_WITH_GRADIENT)
                qs = quantizer_set_for_recipe(r, state)
                if (
                    isinstance(r, NVFP4BlockScaling)
                    and not r.disable_stochastic_rounding
                    and self.has_rng(SR_RNG)
                ):
                    qs = QuantizerSet(qs.x, qs.kernel, _with_rng(qs.dgrad, self.make_rng(SR_RNG)), qs.recipe)
                return qs

            return f(generate_quantizer_set, *args, **kwargs)

    _TEWrapper.__name__ = _TEWrapper.__qualname__ = f"TEWrapper_{label}"
    return _TEWrapper


def _with_rng(q, key):
    import dataclasses

    return dataclasses.replace(q, rng=key)


__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "make_dot_general_cls",
    "make_ragged_dot_cls",
    "wrap_function_in_te_state_module",
    "extend_logical_axis_rules",
]
