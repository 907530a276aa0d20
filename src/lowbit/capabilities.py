"""What this machine can run: TransformerEngine's capability queries, answered for lowbit.

lowbit runs every scaling mode on CPU (C++ reference kernels) and on Hopper or newer GPUs (its
CUDA kernels are built for sm_90a), so the answer depends on the device, never on the recipe.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax

from lowbit.quantization.scaling_modes import ScalingMode
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

_MIN_CC = (9, 0)


def compute_capability(device) -> Optional[Tuple[int, int]]:
    """(major, minor) of a GPU ``device``; None where it reports none or an unreadable one."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(v) for v in str(cc).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _device_reason(device) -> str:
    """'' when lowbit's ops run on ``device``, else why not."""
    if device.platform == "cpu":
        return ""
    if device.platform not in ("gpu", "cuda"):
        return f"lowbit has no kernels for {device.platform} devices"
    cc = compute_capability(device)
    if cc is None:
        return f"cannot read the compute capability of {device.device_kind}"
    if cc < _MIN_CC:
        have = f"{device.device_kind} has {cc[0]}.{cc[1]}"
        return f"lowbit's CUDA kernels need compute capability 9.0 or higher, {have}"
    from lowbit import _native

    if _native.ensure_loaded()["cuda"] is None:
        return "lowbit was built without its CUDA library (no nvcc at build time)"
    return ""


def _check_mode(scaling_mode) -> ScalingMode:
    try:
        return ScalingMode(int(scaling_mode))
    except (TypeError, ValueError):
        raise ValueError(f"scaling_mode must be a lowbit.ScalingMode, got {scaling_mode!r}") from None


def is_scaling_mode_supported(scaling_mode: ScalingMode) -> Tuple[bool, str]:
    """(True, "") when every local device runs ``scaling_mode``, else (False, reason)."""
    mode = _check_mode(scaling_mode)
    if mode == ScalingMode.NO_SCALING:
        return True, ""
    for d in jax.local_devices():
        reason = _device_reason(d)
        if reason:
            return False, reason
    return True, ""


def is_fp8_available(scaling_mode: Optional[ScalingMode] = None) -> Tuple[bool, str]:
    """TransformerEngine's query: (available, reason) for ``scaling_mode`` (default: delayed)."""
    return is_scaling_mode_supported(
        ScalingMode.DELAYED_TENSOR_SCALING if scaling_mode is None else scaling_mode
    )


def get_supported_scaling_modes() -> List[ScalingMode]:
    """Every scaling mode this machine runs (all of them on CPU and Hopper)."""
    return [m for m in ScalingMode if is_scaling_mode_supported(m)[0]]


def get_supported_quantization_recipes() -> List[Recipe]:
    """One default instance of every recipe this machine runs: all five on CPU and Hopper."""
    recipes = [
        DelayedScaling(),
        Float8CurrentScaling(),
        MXFP8BlockScaling(),
        Float8BlockScaling(),
        NVFP4BlockScaling(),
    ]
    return [
        r
        for r in recipes
        if all(is_scaling_mode_supported(r.scaling_mode(role))[0] for role in ("x", "kernel", "grad"))
    ]
