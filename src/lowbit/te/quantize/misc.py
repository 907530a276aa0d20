"""``transformer_engine.jax.quantize.misc``."""

from lowbit.te.quantize import QuantizeLayout

__all__ = ["QuantizeLayout"]
