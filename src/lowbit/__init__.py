"""lowbit: low-precision (FP8, MXFP8, NVFP4) training building blocks for JAX."""

from lowbit import recipe
from lowbit.ops.quantize import dequantize, grouped_dequantize, grouped_quantize, quantize, quantize_dbias
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.quantize.tensor import ScaledTensor
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

__version__ = "0.1.0"

__all__ = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "ScaledTensor",
    "ScalingMode",
    "dequantize",
    "grouped_dequantize",
    "grouped_quantize",
    "quantize",
    "quantize_dbias",
    "recipe",
]
