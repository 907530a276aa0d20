"""``transformer_engine.jax.dense.grouped_dense`` and ``flax.make_grouped_dense_cls`` on
:func:`lowbit.grouped_gemm`, and ``flax._MoEBlock`` (:class:`lowbit.flax.MoEBlock`): the
grouped names lowbit.te.dense and lowbit.te.flax re-export (one import line each)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from lowbit.flax.moe import MoEBlock as _MoEBlock
from lowbit.flax.ragged_dot import make_ragged_dot_cls
from lowbit.moe.permutation import row_experts
from lowbit.ops.grouped_gemm import grouped_gemm
from lowbit.te._common import refuse
from lowbit.te.quantize import QuantizerSet, noop_quantizer_set, recipe_of

__all__ = ["_MoEBlock", "grouped_dense", "make_grouped_dense_cls"]


def grouped_dense(
    x: jnp.ndarray,
    kernel: jnp.ndarray,
    group_sizes: jnp.ndarray,
    contracting_dims: Tuple[Sequence[int], Sequence[int]] = ((1,), (1,)),
    bias: jnp.ndarray = None,
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT,
    preferred_element_type: jnp.dtype = None,
    group_offset: jnp.array = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    kernel_fsdp_info: Tuple[str, int] = (None, -1),
):
    """Rows of group g of x (M, K) times kernel[g] (G, K, N) (+ bias[g], (G, N)). A noop set runs
    lowbit's BF16 grouped GEMM (float32 inputs rounded to bfloat16, float32 accumulation); a
    quantizer set its recipe with per-group scales. Group sizes stay on the device."""
    dims = tuple(tuple(d) if isinstance(d, (tuple, list)) else (d,) for d in contracting_dims)
    refuse("contracting_dims", dims, ((1,), (1,)), "x (M, K) and kernel (G, K, N) only")
    refuse("group_offset", group_offset, None, "no group offset")
    refuse("kernel_fsdp_info", tuple(kernel_fsdp_info), (None, -1), "no FSDP gather inside the GEMM")
    recipe, state = recipe_of(quantizer_set)
    out_dtype = preferred_element_type if preferred_element_type is not None else x.dtype
    y = grouped_gemm(x, kernel, group_sizes, recipe=recipe, state=state, preferred_element_type=out_dtype)
    if bias is not None:
        if bias.shape != (kernel.shape[0], kernel.shape[2]):
            raise ValueError(
                f"grouped_dense: bias must be (G, N) = {(kernel.shape[0], kernel.shape[2])}, got {bias.shape}"
            )
        b = jnp.concatenate([bias, jnp.zeros((1, bias.shape[1]), bias.dtype)])
        y = y + b[row_experts(group_sizes, x.shape[0])].astype(y.dtype)
    return y


def make_grouped_dense_cls(quantization_recipe, quantization_checkpoint_name: Optional[str] = None):
    """TE's factory: an instance to call as ``ragged_dot(x, kernel, group_sizes)`` with the
    recipe's grouped GEMM (lowbit: Float8CurrentScaling, DelayedScaling, Float8BlockScaling or
    None; MXFP8 is not implemented in lowbit's grouped GEMM)."""
    refuse(
        "quantization_checkpoint_name",
        quantization_checkpoint_name,
        None,
        "no named quantization checkpoints",
    )
    return make_ragged_dot_cls(quantization_recipe)()
