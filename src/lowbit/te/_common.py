"""Small helpers shared by the lowbit.te adapters."""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn


def refuse(name: str, value, default, why: str) -> None:
    """An argument lowbit cannot honour, set to something other than its default: say so."""
    if value is not default and value != default:
        raise NotImplementedError(f"{name}={value!r} is not supported by lowbit.te ({why})")


def constrain(x, axes: Optional[Sequence[Optional[str]]]):
    """TE's logical-axis sharding constraint: applied when Flax logical axis rules are active."""
    if not axes or not nn.get_logical_axis_rules():
        return x
    return nn.with_logical_constraint(x, tuple(axes))


def canonical_norm_type(norm_type: str) -> str:
    """TE accepts 'LayerNorm', 'rms_norm' ...: compare without case, '-' or '_'."""
    t = str(norm_type).lower().strip().replace("-", "").replace("_", "")
    if t not in ("layernorm", "rmsnorm"):
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return t
