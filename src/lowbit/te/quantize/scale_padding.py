"""TE's padded block-scale layout (``transformer_engine.jax.quantize.helper``'s
``apply_padding_to_scale_inv`` / ``remove_padding_from_scale_inv``).

TE pads MXFP8 and NVFP4 scale_inv to multiples of (128, 4) blocks (rowwise; (4, 128) colwise);
lowbit's ScaledTensor keeps them unpadded, ``(rows, cols / block)``. These convert between the
two, e.g. to exchange quantized tensors with TE. Tensor scaling has one scale, never padded.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from lowbit.quantization.scaling_modes import ScalingMode

# TE's block dims (rows, cols) per scaling mode and its (128, 4) alignment.
_BLOCKS = {
    ScalingMode.MXFP8_1D_SCALING: (1, 32),
    ScalingMode.NVFP4_1D_SCALING: (1, 16),
    ScalingMode.NVFP4_2D_SCALING: (16, 16),
}
_ALIGN = (128, 4)


def _split_shape(dims: Sequence[int], n_blocks: int, block: int, what: str) -> tuple:
    # The block count of a flattened run of axes, spread back over them as TE does: the last
    # axis divided by the block, middle axes whole, the first takes the (padded) rest.
    if len(dims) == 1:
        return (n_blocks,)
    if dims[-1] % block:
        raise ValueError(f"{what}: axis of size {dims[-1]} is not a multiple of the block {block}")
    inner = (dims[-1] // block,)
    for d in reversed(dims[1:-1]):
        inner = (d,) + inner
    if n_blocks % math.prod(inner):
        raise ValueError(f"{what}: {n_blocks} scale rows do not split over the axes {tuple(dims)}")
    return (n_blocks // math.prod(inner),) + inner


def scale_shape(scaling_mode, data_shape, is_colwise: bool, is_padded: bool, flatten_axis: int) -> tuple:
    """TE's ``ScalingMode.get_scale_shape`` for ``data_shape`` (N layout)."""
    mode = ScalingMode(int(scaling_mode))
    data_shape = tuple(int(d) for d in data_shape)
    if mode == ScalingMode.NO_SCALING:
        return (0,)
    if mode.is_tensor_scaling:
        return (0,) if math.prod(data_shape) == 0 else (1,)
    if mode not in _BLOCKS:
        raise NotImplementedError(
            f"scaling_mode={mode.name}: TE's JAX package has no such mode; lowbit's FP8 block scales "
            "are cuBLASLt's layout (lowbit.quantization.scaling_modes.fp8_block_scale_shape)"
        )
    if is_colwise and mode.is_nvfp4:
        raise ValueError(
            f"scaling_mode={mode.name}: the colwise copy is stored transposed ('T' layout); give the "
            "transposed data shape with is_colwise=False"
        )
    nd = len(data_shape)
    axis = flatten_axis % nd if nd else 0
    if not 0 < axis < nd:
        raise ValueError(f"flatten_axis {flatten_axis} is out of bounds for data shape {data_shape}")
    bx, by = _BLOCKS[mode][::-1] if is_colwise else _BLOCKS[mode]
    ax, ay = (_ALIGN[::-1] if is_colwise else _ALIGN) if is_padded else (1, 1)
    rows, cols = math.prod(data_shape[:axis]), math.prod(data_shape[axis:])
    if data_shape[axis - 1] % bx or rows % bx or cols % by:
        raise ValueError(f"data shape {data_shape} is not whole ({bx}, {by}) blocks of {mode.name}")
    n_x = -(-(rows // bx) // ax) * ax
    n_y = -(-(cols // by) // ay) * ay
    what = f"{mode.name} scale of {data_shape}"
    return (*_split_shape(data_shape[:axis], n_x, bx, what), *_split_shape(data_shape[axis:], n_y, by, what))


def _layouts(fn: str, scale_inv, scaling_mode, data_shape, is_colwise, flatten_axis, to_padded: bool):
    """(source shape, target shape) of a conversion, or None when ``scale_inv`` needs none."""
    target = scale_shape(scaling_mode, data_shape, is_colwise, to_padded, flatten_axis)
    if ScalingMode(int(scaling_mode)) == ScalingMode.NO_SCALING or scale_inv.shape == target:
        return None
    source = scale_shape(scaling_mode, data_shape, is_colwise, not to_padded, flatten_axis)
    if scale_inv.shape != source:
        raise ValueError(f"{fn}: scale_inv must have shape {source} or {target}, got {scale_inv.shape}")
    return source, target


def remove_padding_from_scale_inv(
    scale_inv: jax.Array,
    scaling_mode: ScalingMode,
    data_shape: Sequence[int],
    is_colwise: bool = False,
    flatten_axis: int = -1,
) -> jax.Array:
    """``scale_inv`` in TE's padded layout without its padding (as it is when already unpadded)."""
    shapes = _layouts("remove_padding_from_scale_inv", scale_inv, scaling_mode, data_shape, is_colwise,
                      flatten_axis, to_padded=False)  # fmt: skip
    if shapes is None:
        return scale_inv
    padded, unpadded = shapes
    axis = flatten_axis % len(data_shape)
    two_d = lambda s: (math.prod(s[:axis]), math.prod(s[axis:]))  # noqa: E731
    (pr, pc), (ur, uc) = two_d(padded), two_d(unpadded)
    # Flatten in two stages (leading axes, then trailing) so the flatten axis is kept.
    flat = scale_inv.reshape((pr, *padded[axis:])).reshape(pr, pc)[:ur, :uc]
    return flat.reshape((*unpadded[:axis], uc)).reshape(unpadded)


def apply_padding_to_scale_inv(
    scale_inv: jax.Array,
    scaling_mode: ScalingMode,
    data_shape: Sequence[int],
    is_colwise: bool = False,
    flatten_axis: int = -1,
) -> jax.Array:
    """``scale_inv`` padded to TE's layout with 2**-127 (the smallest E8M0 scale), as TE pads."""
    shapes = _layouts("apply_padding_to_scale_inv", scale_inv, scaling_mode, data_shape, is_colwise,
                      flatten_axis, to_padded=True)  # fmt: skip
    if shapes is None:
        return scale_inv
    unpadded, padded = shapes
    widths = tuple((0, p - u) for p, u in zip(padded, unpadded))
    return jnp.pad(scale_inv, widths, constant_values=jnp.asarray(2.0**-127, scale_inv.dtype))
