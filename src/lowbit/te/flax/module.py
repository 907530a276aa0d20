"""``transformer_engine.jax.flax.module``: the dense/norm/MLP modules, ``TransformerEngineBase``
and TE's state-module wrappers.

:class:`TransformerEngineBase` gives a module TE's ``generate_quantizer_set``; a framework that
subclasses it (MaxText's integration does) gets lowbit's quantizer sets, which
:func:`lowbit.te.dense.dense` and the other functional ops take. DelayedScaling state uses TE's
variable names, ``{x,kernel,grad}{postfix}_{amax_history,scale}``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax import (
    OVERWRITE_WITH_GRADIENT,
    SR_RNG,
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    Softmax,
    make_dot_general_cls,
)
from lowbit.flax.state_module import call_index, state_variable_name
from lowbit.recipe import DelayedScaling, NVFP4BlockScaling, Recipe
from lowbit.te.grouped_dense import make_grouped_dense_cls  # noqa: F401 (TE's name)
from lowbit.te.quantize._impl import NVTE_FP8_COLLECTION_NAME, QuantizerSet, quantizer_set_for_recipe

_ROLES = ("x", "kernel", "grad")


def _delayed_state(module: nn.Module, recipe: DelayedScaling, postfix: str, collection: str) -> dict:
    # TE's names; one state per call (lowbit.flax.delayed_state_variables says why): "<name>_call<i>"
    # after the first.
    call, state = call_index(module, postfix), {}
    for role in _ROLES:
        h = module.variable(
            collection,
            state_variable_name(f"{role}{postfix}_amax_history", call),
            jnp.zeros,
            (recipe.amax_history_len,),
            jnp.float32,
        )
        s = module.variable(
            collection, state_variable_name(f"{role}{postfix}_scale", call), jnp.ones, (1,), jnp.float32
        )
        state[f"{role}_amax_history"], state[f"{role}_scale"] = h.value, s.value
    return state


class TransformerEngineBase(nn.Module):
    """TE's base module: :meth:`generate_quantizer_set` for the GEMMs a subclass runs."""

    def generate_quantizer_set(
        self,
        postfix: str = "",
        variable_collection: Optional[str] = None,
        quantization_checkpoint_name: Optional[str] = None,
        fp8_recipe: Optional[Recipe] = None,
        n_groups: Optional[int] = None,
    ) -> QuantizerSet:
        """The :class:`QuantizerSet` of ``fp8_recipe`` (None: the enclosing autocast's; noop with
        none). DelayedScaling keeps its state in ``variable_collection`` (None:
        ``NVTE_FP8_COLLECTION_NAME``); ``quantization_checkpoint_name`` names the quantized
        tensors the GEMMs keep for the backward (remat policies); NVFP4 draws its
        stochastic-rounding key from the ``sr_rng`` stream when one is given and rounds to
        nearest otherwise, as TE does."""
        if n_groups is not None:
            raise NotImplementedError(
                "generate_quantizer_set(n_groups=...): grouped quantizer sets are not supported by lowbit.te"
            )
        r = fp8_recipe if fp8_recipe is not None else get_recipe()
        if r is not None and not isinstance(r, Recipe):
            raise TypeError(f"fp8_recipe must be a lowbit recipe or None, got {type(r).__name__}")
        state = None
        if isinstance(r, DelayedScaling):
            state = _delayed_state(self, r, postfix, variable_collection or NVTE_FP8_COLLECTION_NAME)
        qs = quantizer_set_for_recipe(r, state, quantization_checkpoint_name)
        if isinstance(r, NVFP4BlockScaling) and not r.disable_stochastic_rounding and self.has_rng(SR_RNG):
            qs = QuantizerSet(
                qs.x, qs.kernel, dataclasses.replace(qs.dgrad, rng=self.make_rng(SR_RNG)), qs.recipe
            )
        return qs


def wrap_function_in_te_state_module(
    f: Callable,
    quantization_recipe: Optional[Recipe] = None,
    name: Optional[str] = None,
    quantization_checkpoint_name: Optional[str] = None,
):
    """A Flax module class whose ``__call__(*args, **kwargs)`` is
    ``f(generate_quantizer_set, *args, **kwargs)``, as in TransformerEngine.

    ``generate_quantizer_set(postfix="", n_groups=None)`` returns the :class:`QuantizerSet` of
    ``quantization_recipe`` (None: the enclosing autocast's); DelayedScaling state lives in
    ``_overwrite_with_gradient`` as ``{x,kernel,grad}{postfix}_{amax_history,scale}``.
    """
    if quantization_recipe is not None and not isinstance(quantization_recipe, Recipe):
        raise TypeError(
            f"quantization_recipe must be a lowbit recipe or None, got {type(quantization_recipe).__name__}"
        )
    label = name or getattr(f, "__name__", "function")

    class TEWrapper(TransformerEngineBase):
        def generate_quantizer_set(self, postfix: str = "", n_groups: Optional[int] = None, **kwargs):
            kwargs.setdefault("variable_collection", OVERWRITE_WITH_GRADIENT)
            kwargs.setdefault("quantization_checkpoint_name", quantization_checkpoint_name)
            kwargs.setdefault("fp8_recipe", quantization_recipe)
            return super().generate_quantizer_set(postfix=postfix, n_groups=n_groups, **kwargs)

        @nn.compact
        def __call__(self, *args, **kwargs):
            return f(self.generate_quantizer_set, *args, **kwargs)

    TEWrapper.__name__ = TEWrapper.__qualname__ = f"TEWrapper_{label}"
    return TEWrapper


__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
    "TransformerEngineBase",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]
