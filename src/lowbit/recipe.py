"""Quantization recipes, with TransformerEngine's names and defaults.

A recipe says which formats and scaling modes the quantized GEMMs use; it holds no state.
Recipes are frozen dataclasses (hashable, usable as static arguments) validated on construction.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from lowbit.quantization.scaling_modes import ScalingMode


class Format(enum.Enum):
    """FP8 formats for the forward (activations, weights) and backward (gradients) tensors."""

    E4M3 = ("E4M3", "E4M3")
    E5M2 = ("E5M2", "E5M2")
    HYBRID = ("E4M3", "E5M2")

    @property
    def fwd_dtype(self):
        return jnp.float8_e4m3fn if self.value[0] == "E4M3" else jnp.float8_e5m2

    @property
    def bwd_dtype(self):
        return jnp.float8_e4m3fn if self.value[1] == "E4M3" else jnp.float8_e5m2


def _check_format(fmt, name="fp8_format"):
    if not isinstance(fmt, Format):
        raise TypeError(f"{name} must be a lowbit.recipe.Format (E4M3, E5M2 or HYBRID), got {fmt!r}")


class Recipe:
    """Base class: every recipe names its scaling modes."""

    def scaling_mode(self, role: str) -> ScalingMode:  # role: "x", "kernel" or "grad"
        raise NotImplementedError

    def q_dtype(self, role: str):
        raise NotImplementedError

    @property
    def stateful(self) -> bool:
        return False


class _FP8FormatRecipe(Recipe):
    """A recipe with an ``fp8_format``: gradients in its backward dtype, the rest forward."""

    fp8_format: Format

    def __post_init__(self):
        _check_format(self.fp8_format)

    def q_dtype(self, role):
        return self.fp8_format.bwd_dtype if role == "grad" else self.fp8_format.fwd_dtype


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_FP8FormatRecipe):
    """Per-tensor scales from a history of past amaxes (state in ``_overwrite_with_gradient``).

    scale = (fp8_max / amax) / 2**margin, amax = max of the history ("max") or its newest entry
    ("most_recent"); the previous scale is kept while amax is 0 or not finite.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")

    def scaling_mode(self, role):
        return ScalingMode.DELAYED_TENSOR_SCALING

    @property
    def stateful(self):
        return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_FP8FormatRecipe):
    """Per-tensor scales from each tensor's own amax, computed on the device every step."""

    fp8_format: Format = Format.HYBRID

    def scaling_mode(self, role):
        return ScalingMode.CURRENT_TENSOR_SCALING


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_FP8FormatRecipe):
    """OCP MXFP8: one E8M0 scale per 32 elements along the contraction axis."""

    fp8_format: Format = Format.E4M3

    def scaling_mode(self, role):
        return ScalingMode.MXFP8_1D_SCALING


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, E4M3 scale per 16 elements, FP32 tensor scale.

    Gradients use stochastic rounding (needs the ``sr_rng`` RNG stream), the inputs of the
    weight-gradient GEMM a random Hadamard transform, and weights 16x16 2-D blocks, unless
    disabled.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self):
        for f in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{f} must be a bool, got {getattr(self, f)!r}")

    def scaling_mode(self, role):
        if role == "kernel" and not self.disable_2d_quantization:
            return ScalingMode.NVFP4_2D_SCALING
        return ScalingMode.NVFP4_1D_SCALING

    def q_dtype(self, role):
        return jnp.float4_e2m1fn
