"""``transformer_engine.jax.quantize.helper``: autocast and the configuration queries."""

from lowbit.te.quantize import (
    NVTE_FP8_COLLECTION_NAME,
    QuantizeConfig,
    TensorSource,
    autocast,
    fp8_autocast,
    get_global_quantize_recipe,
    get_quantize_config,
    get_quantize_config_with_recipe,
    get_supported_quantization_recipes,
    get_supported_scaling_modes,
    is_fp8_available,
    is_scaling_mode_supported,
    update_collections,
)

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "QuantizeConfig",
    "TensorSource",
    "autocast",
    "fp8_autocast",
    "get_global_quantize_recipe",
    "get_quantize_config",
    "get_quantize_config_with_recipe",
    "get_supported_quantization_recipes",
    "get_supported_scaling_modes",
    "is_fp8_available",
    "is_scaling_mode_supported",
    "update_collections",
]
