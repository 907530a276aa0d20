"""``lowbit.autocast(enabled, recipe, mesh_resource)``: the recipe lowbit's GEMMs use where none
is given, with TransformerEngine's argument order and defaults.

Read at trace time; the recipe is part of ``jax.jit``'s cache key, so a function traced under
one recipe is traced again under another (or with quantization off).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Union

from lowbit._trace_context import TraceKeyedContext
from lowbit.recipe import DelayedScaling, Recipe
from lowbit.sharding import MeshResource, global_shard_guard

_RECIPE = TraceKeyedContext(None)


def get_recipe() -> Optional[Recipe]:
    """The active recipe, or None outside an enabled :func:`autocast` (no quantization)."""
    return _RECIPE.value


def _resolve(enabled, recipe) -> Optional[Recipe]:
    """The recipe the block runs with, or None (quantization off)."""
    if isinstance(enabled, Recipe):  # lowbit's earlier short form: autocast(recipe, ...)
        if recipe is not None:
            raise TypeError("autocast: the recipe was given twice (as the first argument and as recipe=)")
        enabled, recipe = True, enabled
    elif enabled is None and recipe is None:  # the same short form with no recipe: off
        enabled = False
    if not isinstance(enabled, bool):
        raise TypeError(
            f"autocast: enabled must be a bool (TransformerEngine's order is "
            f"autocast(enabled, recipe, mesh_resource)), got {enabled!r}"
        )
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast: recipe must be a lowbit recipe, got {type(recipe).__name__}")
    if not enabled:
        if recipe is not None:
            warnings.warn(
                "autocast(enabled=False, recipe=...): quantization is off inside this block; "
                "pass enabled=True to use the recipe",
                UserWarning,
                stacklevel=4,
            )
        return None
    recipe = DelayedScaling() if recipe is None else recipe  # TransformerEngine's default
    from lowbit.capabilities import is_scaling_mode_supported

    for role in ("x", "kernel", "grad"):
        ok, reason = is_scaling_mode_supported(recipe.scaling_mode(role))
        if not ok:
            raise RuntimeError(f"autocast: {type(recipe).__name__} cannot run here: {reason}")
    return recipe


@contextlib.contextmanager
def autocast(
    enabled: Union[bool, Recipe] = False,
    recipe: Optional[Recipe] = None,
    mesh_resource: Optional[MeshResource] = None,
) -> Iterator[Optional[Recipe]]:
    """Makes ``recipe`` the default of lowbit's dense/dot_general and Flax modules in the block.

    ``enabled=True`` without a recipe uses ``DelayedScaling()``; ``enabled=False`` turns
    quantization off in the block. ``autocast(recipe)`` (a recipe as the first argument) is
    short for ``autocast(enabled=True, recipe=recipe)``, ``autocast(None)`` for off. ``mesh_resource`` sets
    :func:`lowbit.sharding.global_mesh_resource` for the block as well (None keeps the outer one).
    Yields the active recipe (None when off).
    """
    active = _resolve(enabled, recipe)
    with _RECIPE(active):
        if mesh_resource is not None:
            with global_shard_guard(mesh_resource):
                yield active
        else:
            yield active
