"""Quantized tensors and their scaling modes (the function is :func:`lowbit.quantize`)."""

from lowbit.quantization.scaling_modes import ScalingMode
from lowbit.quantization.tensor import ScaledTensor

__all__ = ["ScaledTensor", "ScalingMode"]
