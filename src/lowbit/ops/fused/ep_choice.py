"""Which expert-parallel exchange a ``moe_mlp`` call runs (lowbit.ops.fused.moe): ``"auto"``
picks the capacity dispatch; ``"ragged"`` is checked against what XLA can run where the mesh is."""

from __future__ import annotations

import os

import jax

DISPATCHES = ("auto", "ragged", "capacity")
RAGGED_NCCL_FLAG = "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback"
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # XLA:CPU has no ragged-all-to-all


def platform_of(mesh):
    try:
        return mesh.devices.flat[0].platform
    except ValueError:  # an abstract mesh (jax.set_mesh inside jit) has no devices
        return jax.default_backend()


def pick_dispatch(dispatch, mesh):
    """The EP exchange a moe_mlp call runs (``dispatch`` as given, checked against the mesh's
    platform and the process count)."""
    platform = platform_of(mesh)
    if dispatch == "auto":
        # Measured (2 x H200, jax 0.11.2, T 8192 d 1024 E 8 top-2): the dense all-to-all with a
        # capacity factor of 1.25 took 1.48 ms, ragged_all_to_all of the same rows 3.93 ms.
        return "capacity"
    if dispatch == "ragged" and platform not in RAGGED_PLATFORMS:
        raise ValueError(
            f"moe_mlp: dispatch='ragged' needs a GPU mesh (XLA on {platform!r} has no "
            "ragged-all-to-all); use dispatch='capacity' or 'auto'"
        )
    if (
        dispatch == "ragged"
        and jax.process_count() > 1
        and RAGGED_NCCL_FLAG not in os.environ.get("XLA_FLAGS", "")
    ):
        # Measured (2 x H200, one process per GPU, jax 0.11.2): XLA refuses the exchange at run
        # time ("RaggedAllToAll fallback to NCCL is not allowed") unless the flag allows it.
        raise ValueError(
            f"moe_mlp: dispatch='ragged' across {jax.process_count()} processes needs "
            f"XLA_FLAGS=--{RAGGED_NCCL_FLAG}=true (XLA's ragged all-to-all falls back to NCCL "
            "send/recv between processes and refuses to unless allowed); or use "
            "dispatch='capacity' or 'auto'"
        )
    return dispatch
