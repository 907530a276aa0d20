"""TE's mesh helpers (``transformer_engine.jax.sharding``'s functions), over the mesh in context
(:func:`lowbit.sharding.current_mesh`) and the global MeshResource. Re-exported by
:mod:`lowbit.te.sharding`."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

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
    current_mesh,
    global_mesh_resource,
)

Rules = Tuple[Tuple[str, Optional[str]], ...]


def te_logical_axis_rules(resource: Optional[MeshResource] = None) -> Rules:
    """TE's logical axes -> mesh axes for ``resource`` (default: the global MeshResource)."""
    r = resource or global_mesh_resource()
    tp = r.tpsp_resource or r.tp_resource
    return (
        (BATCH_AXES, r.fsdp_resource or r.dp_resource),
        (SEQLEN_AXES, None),
        (SEQLEN_TP_AXES, r.tpsp_resource),
        (SEQLEN_CP_AXES, r.cp_resource),
        (HEAD_AXES, tp),
        (HIDDEN_AXES, None),
        (HIDDEN_TP_AXES, tp),
        (JOINED_AXES, None),
        (W_NO_SHARD_AXES, None),
        (W_FSDP_AXES, r.fsdp_resource),
        (W_TP_AXES, tp),
        (W_JOINED_AXES, None),
    )


def _mesh(mesh=None):
    return mesh if mesh is not None else current_mesh()


def is_mesh_available() -> bool:
    """Whether a mesh is in context."""
    m = current_mesh()
    return m is not None and not m.empty


def get_all_mesh_axes() -> tuple:
    """The axis names of the mesh in context (() without one)."""
    m = current_mesh()
    return tuple(m.axis_names) if m is not None else ()


def num_of_devices() -> int:
    return len(jax.devices())


def get_num_devices_in_mesh(mesh=None) -> int:
    m = _mesh(mesh)
    return 1 if m is None or m.empty else math.prod(m.shape.values())


def get_mesh_axis_size(axis, mesh=None) -> int:
    """The size of mesh axis ``axis`` (1 for None)."""
    if axis is None:
        return 1
    m = _mesh(mesh)
    if m is None or axis not in m.shape:
        raise ValueError(
            f"axis {axis!r} is not an axis of the mesh in context ({None if m is None else m.shape})"
        )
    return m.shape[axis]


def get_mesh_axis_rank(axis: str, mesh=None):
    """This shard's index along ``axis`` (inside shard_map); 0 without a mesh."""
    if mesh is None:
        return 0
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of {mesh.shape}")
    return jax.lax.axis_index(axis)


def get_mesh_axis_rank_host(axis, mesh) -> int:
    """This process's index along ``axis`` of ``mesh``, as a Python int (outside any trace): the
    coordinate of the first of this process's devices that ``mesh`` holds."""
    if axis not in mesh.axis_names:
        raise ValueError(f"Axis {axis!r} not found in mesh axis names: {mesh.axis_names}")
    devices = mesh.devices
    for d in jax.local_devices():
        coords = np.argwhere(devices == d)
        if coords.size:
            return int(coords[0][mesh.axis_names.index(axis)])
    raise ValueError(f"none of this process's devices {jax.local_devices()} is in the mesh")


def get_padded_spec(spec, ndim: int) -> tuple:
    """``spec`` padded with None to ``ndim`` entries (None: all None)."""
    if spec is None:
        return (None,) * ndim
    if len(spec) > ndim:
        raise ValueError(f"spec {spec} has more entries than ndim={ndim}")
    return tuple(spec) + (None,) * (ndim - len(spec))


def lax_paral_op(x, ops: Callable, mesh_resource: Optional[str], mesh, **kwargs):
    """``ops(x, mesh_resource, **kwargs)`` (a ``lax.p*`` collective) when the resource is set."""
    if mesh_resource is None:
        return x
    if mesh_resource not in mesh.axis_names:
        raise ValueError(f"{mesh_resource!r} is not an axis of {mesh.shape}")
    return ops(x, mesh_resource, **kwargs)


def with_sharding_constraint(x, pspec: Optional[PartitionSpec]):
    """``jax.lax.with_sharding_constraint`` that does nothing without a mesh, and leaves out the
    axes a surrounding shard_map made manual."""
    m = current_mesh()
    if pspec is None or m is None or m.empty:
        return x
    abstract = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    manual = set(getattr(abstract, "manual_axes", ()) or ())

    def keep(entry):
        if isinstance(entry, tuple):
            kept = tuple(n for n in entry if n not in manual)
            return kept or None
        return None if entry in manual else entry

    cleaned = tuple(keep(e) for e in pspec)
    if all(e is None for e in cleaned):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*cleaned))


def with_sharding_constraint_by_logical_axes(x, logical_axis_names):
    """The constraint of ``logical_axis_names`` under the Flax logical axis rules in context, or
    TE's own axis names (BATCH_AXES, ...) under the global MeshResource without rules."""
    if not logical_axis_names:
        return x
    rules = nn.get_logical_axis_rules()
    if not rules:
        rules = te_logical_axis_rules()
    with nn.logical_axis_rules(rules):
        pspec = nn.logical_to_mesh_axes(tuple(logical_axis_names))
    return with_sharding_constraint(x, pspec)


def get_active_resource_axis(resource_name: str) -> Optional[str]:
    """The mesh axis of MeshResource field ``resource_name`` when a mesh is in context and that
    axis has more than one device, else None."""
    axis = getattr(global_mesh_resource(), resource_name)
    if not is_mesh_available() or axis is None or get_mesh_axis_size(axis) <= 1:
        return None
    return axis


def _psum_over(x, mesh, *fields):
    for f in fields:
        x = lax_paral_op(x, jax.lax.psum, getattr(global_mesh_resource(), f), mesh)
    return x


def all_reduce_sum_along_dp_fsdp(x, mesh):
    return _psum_over(x, mesh, "dp_resource", "fsdp_resource")


def all_reduce_sum_along_dp_fsdp_tpsp(x, mesh):
    return _psum_over(x, mesh, "tpsp_resource", "dp_resource", "fsdp_resource")


def all_reduce_max_along_all_axes_except_PP(x, mesh):  # noqa: N802 - TE's name
    pp = global_mesh_resource().pp_resource
    for axis in get_all_mesh_axes():
        if axis != pp:
            x = lax_paral_op(x, jax.lax.pmax, axis, mesh)
    return x


def tpsp_axis_size() -> int:
    return get_mesh_axis_size(global_mesh_resource().tpsp_resource)


def dp_or_fsdp_axis_size() -> int:
    r = global_mesh_resource()
    dp = get_mesh_axis_size(r.dp_resource)
    return dp if dp > 1 else get_mesh_axis_size(r.fsdp_resource)


def ep_axis_size() -> int:
    return get_mesh_axis_size(global_mesh_resource().ep_resource)


__all__ = [
    "all_reduce_max_along_all_axes_except_PP",
    "all_reduce_sum_along_dp_fsdp",
    "all_reduce_sum_along_dp_fsdp_tpsp",
    "dp_or_fsdp_axis_size",
    "ep_axis_size",
    "get_active_resource_axis",
    "get_all_mesh_axes",
    "get_mesh_axis_rank",
    "get_mesh_axis_rank_host",
    "get_mesh_axis_size",
    "get_num_devices_in_mesh",
    "get_padded_spec",
    "is_mesh_available",
    "lax_paral_op",
    "num_of_devices",
    "tpsp_axis_size",
    "with_sharding_constraint",
    "with_sharding_constraint_by_logical_axes",
]
