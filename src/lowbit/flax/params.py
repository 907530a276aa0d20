"""Parameter and norm helpers shared by lowbit's Flax modules (lowbit.flax.modules,
.dense_general, .layernorm_mlp, .attention): logical-axis annotated parameters, the norm's
parameters and its input stage of a fused dense, and the no-recipe dtype rule."""

from __future__ import annotations

from typing import Any, Callable, Tuple

import flax.linen as nn
import numpy as np

from lowbit.autocast import get_recipe
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.norm import NORM_TYPES
from lowbit.ops.norm import layernorm as _layernorm

Initializer = Callable[..., Any]


def canon_tuple(v, name) -> Tuple[int, ...]:
    if isinstance(v, (int, np.integer)):
        return (int(v),)
    try:
        return tuple(int(i) for i in v)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {v!r}") from None


def param(module, name, init, shape, dtype, axes):
    """A parameter, annotated with logical axis names when given."""
    axes = tuple(axes or ())
    if axes:
        if len(axes) != len(shape):
            raise ValueError(
                f"{type(module).__name__}: {name} axes {axes} must name each of its {len(shape)} "
                f"dimensions (shape {tuple(shape)})"
            )
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, tuple(shape), dtype)


def check_norm_type(layernorm_type: str) -> None:
    """Refuses a ``layernorm_type`` other than "layernorm" or "rmsnorm" when the module is built."""
    if layernorm_type not in NORM_TYPES:
        raise ValueError(f"layernorm_type must be 'layernorm' or 'rmsnorm', got {layernorm_type!r}")


def norm_params(
    module, C, layernorm_type, zero_centered_gamma, scale_init, bias_init, scale_axes, bias_axes, dtype
):
    check_norm_type(layernorm_type)
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    gamma = param(module, "scale", scale_init, (C,), dtype, scale_axes)
    beta = None
    if layernorm_type == "layernorm":
        beta = param(module, "ln_bias", bias_init, (C,), dtype, bias_axes)
    return gamma, beta


def ln_params(m, C):
    """The norm parameters of a LayerNorm* module (fields ``scale_init``, ``ln_bias_init``,
    ``scale_axes``, ``ln_bias_axes``)."""
    return norm_params(
        m,
        C,
        m.layernorm_type,
        m.zero_centered_gamma,
        m.scale_init,
        m.ln_bias_init,
        m.scale_axes,
        m.ln_bias_axes,
        m.dtype,
    )


def apply_norm(x, gamma, beta, layernorm_type, zero_centered_gamma, epsilon):
    return _layernorm(
        x,
        gamma,
        beta,
        norm_type=layernorm_type,
        zero_centered_gamma=bool(zero_centered_gamma),
        epsilon=float(epsilon),
    )


def norm_input(m, gamma, beta, return_output: bool) -> NormInput:
    """Module m's norm as the input stage of a fused dense (``lowbit.ops.fused.dense_norm``)."""
    return NormInput(
        gamma, beta, m.layernorm_type, bool(m.zero_centered_gamma), float(m.epsilon), bool(return_output)
    )


def cast_for_math(x, *arrays):
    """Without a recipe the GEMM runs in x's dtype; with one, lowbit.dense quantizes the
    full-precision parameters directly."""
    if get_recipe() is not None:
        return arrays
    return tuple(None if a is None else a.astype(x.dtype) for a in arrays)
