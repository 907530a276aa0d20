"""``transformer_engine.jax.cpp_extensions.attention``: the attention enums TE re-exports here."""

from lowbit.te.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat, QKVLayout

__all__ = ["AttnBiasType", "AttnMaskType", "AttnSoftmaxType", "QKVFormat", "QKVLayout"]
