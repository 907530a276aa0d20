"""ScaledTensor: quantized data plus the scales that decode it, as a JAX pytree."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from lowbit.quantization.scaling_modes import ScalingMode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """A tensor quantized by :func:`lowbit.quantize`.

    Array fields (pytree children); a copy that was not requested is ``None``:

    * ``data`` / ``scale_inv``: the rowwise copy (original shape; blocks along the last axis of
      the 2-D view).
    * ``colwise_data`` / ``colwise_scale_inv``: the colwise copy, the transpose
      ``shape[flatten_axis:] + shape[:flatten_axis]`` (the K-major operand Hopper needs).
    * ``amax``: float32 ``(1,)``, max |x| of the input (NaN ignored).
    * ``global_scale_inv``: NVFP4 only, float32 ``(2,)``: the tensor decode scales of the rowwise
      and the colwise copy.

    ``scale_inv`` is float32 ``(1,)`` for tensor scaling, ``float8_e8m0fnu`` ``(rows, cols/32)``
    for MXFP8 and ``float8_e4m3fn`` ``(rows, cols/16)`` for NVFP4 (rows/cols of that copy's 2-D
    view). See docs/numerics.md.
    """

    data: Optional[jax.Array]
    scale_inv: Optional[jax.Array]
    colwise_data: Optional[jax.Array]
    colwise_scale_inv: Optional[jax.Array]
    amax: jax.Array
    global_scale_inv: Optional[jax.Array]
    scaling_mode: ScalingMode = dataclasses.field(metadata=dict(static=True))
    q_dtype: Any = dataclasses.field(metadata=dict(static=True))
    dq_dtype: Any = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    flatten_axis: int = dataclasses.field(metadata=dict(static=True))
    rht: bool = dataclasses.field(default=False, metadata=dict(static=True))
    rht_sign_mask: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return prod(self.shape[: self.flatten_axis])

    @property
    def cols(self) -> int:
        return prod(self.shape[self.flatten_axis :])

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    def dequantize(self, layout: str = "rowwise") -> jax.Array:
        """:func:`lowbit.dequantize` of this tensor (``layout``: "rowwise" or "colwise")."""
        if _dequantize is None:
            raise RuntimeError("ScaledTensor.dequantize needs the op layer: import lowbit first")
        return _dequantize(self, layout=layout)


# The op that decodes a ScaledTensor (lowbit.ops.quantize.dequantize). The op layer sits above
# this one and registers it when it is imported; importing it from here would be a cycle.
_dequantize: Optional[Callable[..., jax.Array]] = None


def register_dequantize(fn: Callable[..., jax.Array]) -> None:
    """Sets the function :meth:`ScaledTensor.dequantize` calls (the op layer does, once)."""
    global _dequantize
    _dequantize = fn


def prod(xs) -> int:
    """The product of a shape's sizes as a Python int (1 for an empty shape)."""
    out = 1
    for x in xs:
        out *= int(x)
    return out


def fp4_unpack(packed: jax.Array, shape: tuple) -> jax.Array:
    """(rows, cols/2) uint8, two E2M1 codes per byte (even element low) -> float4_e2m1fn."""
    return jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(shape)


def fp4_pack(data: jax.Array, rows: int, cols: int) -> jax.Array:
    """float4_e2m1fn of any shape with rows*cols elements -> packed (rows, cols/2) uint8."""
    return jax.lax.bitcast_convert_type(data.reshape(rows, cols // 2, 2), jnp.uint8)
