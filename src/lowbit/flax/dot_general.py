"""``make_dot_general_cls(recipe)``: the quantized ``dot_general`` for ``nn.Dense(...,
dot_general=cls())``, running :func:`lowbit.dense` inside a state module."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.flax.state_module import QuantizeContext, wrap_function_in_state_module
from lowbit.ops.dense import dense
from lowbit.recipe import Recipe


def _check_dimension_numbers(dimension_numbers, lhs_ndim: int):
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            f"lowbit dot_general: dimension_numbers must be ((lhs_contract, rhs_contract), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    if tuple(lb) or tuple(rb):
        raise ValueError(
            f"lowbit dot_general: batch dimensions are not supported (got lhs_batch={tuple(lb)}, "
            f"rhs_batch={tuple(rb)}); use DenseGeneral without batch_dims, "
            "or lax.dot_general for batched matmuls"
        )
    lc = tuple(d + lhs_ndim if d < 0 else d for d in lc)
    if sorted(lc) != list(range(lhs_ndim - len(lc), lhs_ndim)):
        raise ValueError(
            f"lowbit dot_general: lhs must be contracted over its trailing axes "
            f"(got {tuple(lc)} for rank {lhs_ndim})"
        )
    return tuple(lc), tuple(rc)


def make_dot_general_cls(
    quantization_recipe: Optional[Recipe] = None, *, fast_accum: bool = True
) -> type[nn.Module]:
    """A Flax module class for ``nn.Dense(..., dot_general=cls())`` (or ``dot_general_cls=cls``).

    Its instance is called like ``lax.dot_general(lhs, rhs, dimension_numbers, precision,
    preferred_element_type)`` and runs :func:`lowbit.dense` (quantized forward and backward);
    ``precision`` is ignored (the recipe decides). It creates no parameters. The recipe argument
    is ``quantization_recipe``, TransformerEngine's name (None: the enclosing autocast's).
    """

    def dot_general(
        ctx: QuantizeContext,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        **unused: Any,
    ) -> jax.Array:
        contracting = _check_dimension_numbers(dimension_numbers, jnp.ndim(lhs))
        return dense(
            lhs,
            rhs,
            contracting_dims=contracting,
            out_dtype=preferred_element_type,
            fast_accum=fast_accum,
            **ctx.dense_kwargs(),
        )

    return wrap_function_in_state_module(dot_general, quantization_recipe, "dot_general")


def layer_dot_general_cls(recipe: Recipe | None, layer: int, num_layers: int, *, fast_accum: bool = True):
    """What to pass as ``dot_general_cls`` for transformer layer ``layer`` of ``num_layers``.

    ``make_dot_general_cls(recipe.layer_recipe(layer, num_layers))``, or ``lambda: None``
    (Flax's own ``dot_general``, unquantized) where that layer stays in BF16 or ``recipe`` is
    None; so ``nn.Dense(..., dot_general=cls())`` works either way.
    """
    r = None if recipe is None else recipe.layer_recipe(layer, num_layers)
    if r is None:
        return lambda: None
    return make_dot_general_cls(r, fast_accum=fast_accum)
