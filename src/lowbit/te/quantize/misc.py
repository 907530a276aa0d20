"""``transformer_engine.jax.quantize.misc``."""

from lowbit.te.quantize._impl import QuantizeLayout

__all__ = ["QuantizeLayout"]
