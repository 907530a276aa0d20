"""``transformer_engine.jax.dense``: TE's functional dense over :func:`lowbit.dense`."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

import lowbit
from lowbit.ops.dense import quantized_checkpoint_name
from lowbit.te._common import constrain, refuse
from lowbit.te.cpp_extensions.gemm import is_noop_collective, noop_collective_op_set
from lowbit.te.grouped_dense import grouped_dense  # noqa: F401 (TE's name)
from lowbit.te.quantize._impl import QuantizerSet, noop_quantizer_set, recipe_of


def _dims(contracting_dims, x_ndim: int, k_ndim: int):
    lhs, rhs = contracting_dims
    lhs = tuple(int(d) % x_ndim for d in (lhs if isinstance(lhs, (tuple, list)) else (lhs,)))
    rhs = tuple(int(d) % k_ndim for d in (rhs if isinstance(rhs, (tuple, list)) else (rhs,)))
    return lhs, rhs


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: Optional[jax.Array] = None,
    contracting_dims: Tuple[Sequence[int], Sequence[int]] = ((1,), (0,)),
    transpose_batch_sequence: bool = False,
    input_axes: Optional[Tuple[str, ...]] = None,
    kernel_axes: Optional[Tuple[str, ...]] = None,
    output_axes: Optional[Tuple[str, ...]] = None,
    collective_op_set=noop_collective_op_set,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """``x . kernel (+ bias)`` contracting ``contracting_dims``, quantized as ``quantizer_set`` says.

    The output has x's free axes, then the kernel's (``lax.dot_general`` order). A noop set
    runs in x's dtype (the kernel is cast to it), as in TE, whatever the enclosing autocast says.
    """
    refuse("transpose_batch_sequence", transpose_batch_sequence, False, "inputs are batch-first")
    if not is_noop_collective(collective_op_set):
        raise NotImplementedError(
            f"collective_op_set={collective_op_set!r} is not supported by lowbit.te (no collective GEMMs: "
            "lowbit's dense gathers and reduce-scatters itself under a MeshResource)"
        )
    lhs, rhs = _dims(contracting_dims, x.ndim, kernel.ndim)
    # lowbit contracts x's trailing axes: move the contracted ones there (free axes keep order).
    free = [d for d in range(x.ndim) if d not in lhs]
    if free + list(lhs) != list(range(x.ndim)):
        x = jnp.transpose(x, free + list(lhs))
        lhs = tuple(range(len(free), x.ndim))
    x = constrain(x, input_axes)
    kernel = constrain(kernel, kernel_axes)
    recipe, state = recipe_of(quantizer_set)
    if recipe is None:
        kernel = kernel.astype(x.dtype)
        y = jax.lax.dot_general(x, kernel, ((lhs, rhs), ((), ())))
        if bias is not None:
            y = y + bias.astype(y.dtype).reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
    else:
        rng = getattr(quantizer_set.dgrad, "rng", None)
        with quantized_checkpoint_name(quantizer_set.x.checkpoint_name):  # TE names the quantized x, kernel
            y = lowbit.dense(
                x, kernel, bias, recipe=recipe, contracting_dims=(lhs, rhs), state=state, rng=rng
            )
    return constrain(y, output_axes)
