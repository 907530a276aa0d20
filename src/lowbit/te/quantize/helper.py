"""``transformer_engine.jax.quantize.helper``: autocast and the configuration queries."""

from typing import Optional, Tuple

from lowbit.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from lowbit.te.quantize._impl import (
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
from lowbit.te.quantize.scale_padding import apply_padding_to_scale_inv, remove_padding_from_scale_inv

_RECIPES_BY_NAME = {
    cls.__name__: cls for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling)
}


def get_quantization_recipe(name: str) -> Recipe:
    """A default recipe from its class name ("DelayedScaling", "Float8CurrentScaling",
    "MXFP8BlockScaling" or "NVFP4BlockScaling")."""
    cls = _RECIPES_BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"Invalid quantization recipe {name!r}. Valid options: {list(_RECIPES_BY_NAME)}")
    return cls()


def is_quantize_recipe_supported(recipe_name: str) -> Tuple[bool, Optional[str]]:
    """(supported, reason) for the recipe named ``recipe_name`` on every local device."""
    config = get_quantize_config_with_recipe(get_quantization_recipe(recipe_name))
    for source in TensorSource:
        ok, reason = is_scaling_mode_supported(config.get_scaling_mode(source))
        if not ok:
            return ok, reason
    return True, None


__all__ = [
    "apply_padding_to_scale_inv",
    "remove_padding_from_scale_inv",
    "get_quantization_recipe",
    "is_quantize_recipe_supported",
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
