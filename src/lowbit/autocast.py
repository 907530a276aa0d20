"""``lowbit.autocast(recipe)``: the recipe that lowbit's GEMMs use where none is given.

Read at trace time: a function jitted inside the context keeps the recipe it was traced with.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from lowbit.recipe import Recipe
from lowbit.sharding import MeshResource, global_shard_guard

_local = threading.local()


def get_recipe() -> Optional[Recipe]:
    """The active recipe, or None outside :func:`autocast` (no quantization)."""
    return getattr(_local, "recipe", None)


@contextlib.contextmanager
def autocast(recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None,
             enabled: bool = True) -> Iterator[Optional[Recipe]]:
    """Makes ``recipe`` the default of lowbit's dense/dot_general inside the block.

    ``enabled=False`` (or ``recipe=None``) turns quantization off inside the block.
    ``mesh_resource`` sets :func:`lowbit.sharding.global_mesh_resource` for the block as well.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast: recipe must be a lowbit recipe, got {type(recipe).__name__}")
    prev = get_recipe()
    _local.recipe = recipe if enabled else None
    try:
        if mesh_resource is not None:
            with global_shard_guard(mesh_resource):
                yield get_recipe()
        else:
            yield get_recipe()
    finally:
        _local.recipe = prev
