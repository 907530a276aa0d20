"""Which mesh axes carry which kind of parallelism, as TransformerEngine's ``MeshResource``.

lowbit's ops read it to name their sharding; a user sets it once, globally, with
:func:`global_shard_guard` or through :func:`lowbit.autocast`'s ``mesh_resource``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Mesh axis names per parallelism kind; ``None`` where that kind is not used."""

    dp_resource: Optional[str] = None    # data parallel (batch)
    tp_resource: Optional[str] = None    # tensor parallel (features)
    fsdp_resource: Optional[str] = None  # fully sharded data parallel (parameters)
    tpsp_resource: Optional[str] = None  # tensor + sequence parallel
    cp_resource: Optional[str] = None    # context parallel (sequence)
    pp_resource: Optional[str] = None    # pipeline stages

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"MeshResource.{f.name} must be a mesh axis name (str) or None, got {v!r}")


_local = threading.local()


def global_mesh_resource() -> MeshResource:
    """The MeshResource in effect (an empty one when none was set)."""
    return getattr(_local, "resource", None) or MeshResource()


@contextlib.contextmanager
def global_shard_guard(resource: Optional[MeshResource]) -> Iterator[MeshResource]:
    """Sets the MeshResource for the enclosed code (restored on exit)."""
    if resource is not None and not isinstance(resource, MeshResource):
        raise TypeError(f"resource must be a lowbit.MeshResource or None, got {type(resource).__name__}")
    prev = getattr(_local, "resource", None)
    _local.resource = resource
    try:
        yield global_mesh_resource()
    finally:
        _local.resource = prev
