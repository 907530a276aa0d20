"""``transformer_engine.jax.quantize.scaling_modes``."""

from lowbit.te.quantize import ScalingMode

__all__ = ["ScalingMode"]
