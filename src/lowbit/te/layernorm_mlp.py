"""``transformer_engine.jax.layernorm_mlp``: norm, dense, activation, dense."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax
from jax.ad_checkpoint import checkpoint_name

from lowbit.te._common import canonical_norm_type, constrain, deprecated_batch_first
from lowbit.te.activation import activation
from lowbit.te.cpp_extensions.gemm import noop_collective_op_set
from lowbit.te.dense import dense
from lowbit.te.layernorm import layernorm
from lowbit.te.quantize import QuantizerSet, noop_quantizer_set

Axes = Optional[Tuple[str, ...]]


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    kernels: List[jax.Array],
    biases: List[Optional[jax.Array]],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: Axes = None,
    dot_1_input_axes: Axes = None,
    dot_2_input_axes: Axes = None,
    kernel_1_axes: Axes = None,
    kernel_2_axes: Axes = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[Union[str, Callable]] = ("gelu",),
    activation_params: Optional[dict] = None,
    collective_op_sets: Tuple = (noop_collective_op_set, noop_collective_op_set),
    quantizer_sets: Tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
    *,
    batch_first: Optional[bool] = None,
) -> jax.Array:
    """x (..., H); kernels (H, len(activation_type), I) and (I, H); biases (len(act), I) and (H,)
    or None. Each GEMM quantized by its own set of ``quantizer_sets``. The math is per token:
    ``transpose_batch_sequence`` (``batch_first``, its deprecated pre-2.10 name) changes nothing."""
    deprecated_batch_first(batch_first)
    del transpose_batch_sequence
    if len(kernels) != 2 or len(biases) != 2 or len(quantizer_sets) != 2:
        raise ValueError("layernorm_mlp takes two kernels, two biases (or None) and two quantizer sets")
    k1, k2 = kernels
    if k1.ndim != 3 or k1.shape[1] != len(activation_type) or k2.ndim != 2:
        raise ValueError(
            f"layernorm_mlp: kernels must be (H, {len(activation_type)}, I) and (I, H), "
            f"got {tuple(k1.shape)} and {tuple(k2.shape)}"
        )
    if canonical_norm_type(norm_type) == "rmsnorm" and beta is not None:
        raise ValueError("layernorm_mlp: beta must be None for rmsnorm")
    x = constrain(x, norm_input_axes)
    y = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    h = dense(
        y,
        k1,
        biases[0],
        contracting_dims=((y.ndim - 1,), (0,)),
        input_axes=dot_1_input_axes,
        kernel_axes=kernel_1_axes,
        collective_op_set=collective_op_sets[0],
        quantizer_set=quantizer_sets[0],
    )
    h = checkpoint_name(h, ffn1_ckpt_name)
    a = activation(h, activation_type, act_params=activation_params)
    out = dense(
        a,
        k2,
        biases[1],
        contracting_dims=((a.ndim - 1,), (0,)),
        input_axes=dot_2_input_axes,
        kernel_axes=kernel_2_axes,
        collective_op_set=collective_op_sets[1],
        quantizer_set=quantizer_sets[1],
    )
    return checkpoint_name(out, ffn2_ckpt_name)
