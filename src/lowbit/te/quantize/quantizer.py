"""``transformer_engine.jax.quantize.quantizer``: quantizer descriptions and their factory."""

from lowbit.te.quantize._impl import (
    Quantizer,
    QuantizerFactory,
    QuantizerSet,
    compute_scale_from_amax,
    noop_quantizer_set,
)

__all__ = ["Quantizer", "QuantizerFactory", "QuantizerSet", "compute_scale_from_amax", "noop_quantizer_set"]
