"""``transformer_engine.jax.quantize.scaling_modes``."""

import enum

from lowbit.te.quantize._impl import ScalingMode


class TensorUsage(enum.Enum):
    """How a GEMM reads a quantized operand: left/right-hand side, normal or transposed."""

    LHS = 0
    LHS_TRANS = 1
    RHS = 2
    RHS_TRANS = 3


__all__ = ["ScalingMode", "TensorUsage"]
