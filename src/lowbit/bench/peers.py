"""TransformerEngine as a peer in the benchmarks: the same TE-API code run on lowbit.te and, where
``transformer_engine`` is importable (the device: ../shared/tepeer), on TransformerEngine itself,
in one process. Rows of a peer that cannot run here are left out, never faked."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from types import ModuleType
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True)
class Peer:
    """One implementation of TE's JAX API: its package, Flax modules and recipe module."""

    name: str
    te: ModuleType
    flax: ModuleType
    recipe: ModuleType

    def make_recipe(self, name: str):
        """ "delayed" | "current" | "none" -> the recipe object (None for BF16)."""
        cls = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "none": None}[name]
        return getattr(self.recipe, cls)() if cls else None

    @contextlib.contextmanager
    def context(self, mesh=None, resource: Optional[dict] = None, recipe=None, rules=None) -> Iterator[None]:
        """The mesh, the MeshResource (as keyword arguments), the recipe and the logical axis rules
        (extended by the peer's own), around a trace or a call."""
        import flax.linen as nn
        import jax

        with contextlib.ExitStack() as stack:
            if mesh is not None:
                stack.enter_context(jax.set_mesh(mesh))
            mr = self.te.sharding.MeshResource(**(resource or {}))
            stack.enter_context(self.te.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=mr))
            if rules is not None:
                stack.enter_context(nn.logical_axis_rules(self.flax.extend_logical_axis_rules(tuple(rules))))
            yield


def lowbit_peer() -> Peer:
    """lowbit.te as the peer: the TE rows' code path where TransformerEngine is not installed
    (tests/test_multi_device.py runs it so)."""
    import lowbit.te
    import lowbit.te.flax
    from lowbit import recipe

    return Peer("lowbit", lowbit.te, lowbit.te.flax, recipe)


def te_peer() -> Optional[Peer]:
    """TransformerEngine's JAX side, or None where it is not installed or cannot load."""
    try:
        te = importlib.import_module("transformer_engine.jax")
        te_flax = importlib.import_module("transformer_engine.jax.flax")
        recipe = importlib.import_module("transformer_engine.common.recipe")
    except Exception:  # not installed, or its extension does not load on this machine
        return None
    return Peer("te", te, te_flax, recipe)
