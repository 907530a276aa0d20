"""``transformer_engine.jax.sharding``: lowbit's MeshResource and shard guard, TE's logical axis
names (defined in lowbit.sharding, where lowbit's Flax modules take them from) and the rules
mapping them onto the mesh axes of the active MeshResource."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from lowbit.sharding import (
    BATCH_AXES,
    HEAD_AXES,
    HIDDEN_AXES,
    HIDDEN_TP_AXES,
    JOINED_AXES,
    SEQLEN_AXES,
    SEQLEN_CP_AXES,
    SEQLEN_TP_AXES,
    W_FSDP_AXES,
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    W_TP_AXES,
    MeshResource,
    global_mesh_resource,
    global_shard_guard,
)
from lowbit.te.sharding_helpers import *  # noqa: E402,F401,F403 - TE's mesh helpers
from lowbit.te.sharding_helpers import Rules, is_mesh_available, te_logical_axis_rules
from lowbit.te.sharding_helpers import __all__ as _helpers


def get_sharding_map_logic_axis_to_mesh_axis() -> dict:
    """TE's logical axes -> mesh axes under the global MeshResource ({} without a mesh)."""
    return dict(te_logical_axis_rules()) if is_mesh_available() else {}


def extend_logical_axis_rules(rules: Sequence[Tuple[str, Optional[str]]]) -> Rules:
    """``rules`` followed by TE's axis rules for the global MeshResource.

    A rule of ``rules`` naming one of TE's axes must map it as TE does (else ValueError).
    """
    rules = tuple((str(k), v) for k, v in rules)
    te_rules = te_logical_axis_rules()
    te_map = dict(te_rules)
    for k, v in rules:
        if k in te_map and v != te_map[k]:
            raise ValueError(
                f"extend_logical_axis_rules: rule ({k!r}, {v!r}) conflicts with TE's "
                f"({k!r}, {te_map[k]!r}) under the active MeshResource"
            )
    given = {k for k, _ in rules}
    return rules + tuple((k, v) for k, v in te_rules if k not in given)


__all__ = [
    "MeshResource",
    "global_mesh_resource",
    "global_shard_guard",
    "extend_logical_axis_rules",
    "te_logical_axis_rules",
    "get_sharding_map_logic_axis_to_mesh_axis",
    "BATCH_AXES",
    "SEQLEN_AXES",
    "SEQLEN_TP_AXES",
    "SEQLEN_CP_AXES",
    "HEAD_AXES",
    "HIDDEN_AXES",
    "HIDDEN_TP_AXES",
    "JOINED_AXES",
    "W_NO_SHARD_AXES",
    "W_FSDP_AXES",
    "W_TP_AXES",
    "W_JOINED_AXES",
    *_helpers,
]
