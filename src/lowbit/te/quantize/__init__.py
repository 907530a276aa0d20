"""``transformer_engine.jax.quantize`` for lowbit: the quantizer objects TE's functional ops take,
and TE's configuration queries.

A :class:`QuantizerSet` here is a description of one GEMM's quantization (a lowbit recipe plus,
for DelayedScaling, the scales and amax histories as pytree leaves); lowbit's ops do the
quantizing. Differentiating through an op with respect to a delayed set gives the updated set,
as in TransformerEngine.
"""

from lowbit.te.quantize import _impl
from lowbit.te.quantize._impl import (  # noqa: F401 - the package's names and lowbit's set helpers
    NVTE_FP8_COLLECTION_NAME,
    AmaxComputeAlgo,
    QuantizeConfig,
    QuantizeLayout,
    Quantizer,
    QuantizerFactory,
    QuantizerSet,
    ScalingMode,
    TensorSource,
    autocast,
    compute_scale_from_amax,
    fp8_autocast,
    get_delayed_scaling,
    get_global_quantize_recipe,
    get_quantize_config,
    get_quantize_config_with_recipe,
    get_supported_quantization_recipes,
    get_supported_scaling_modes,
    is_fp8_available,
    is_scaling_mode_supported,
    noop_quantizer_set,
    quantizer_set_for_recipe,
    recipe_of,
    update_collections,
)
from lowbit.te.quantize.helper import (
    apply_padding_to_scale_inv,
    get_quantization_recipe,
    is_quantize_recipe_supported,
    remove_padding_from_scale_inv,
)
from lowbit.te.quantize.scaling_modes import TensorUsage

__all__ = [
    *_impl.__all__,  # the package's body (lowbit.te.quantize._impl)
    "TensorUsage",
    "apply_padding_to_scale_inv",
    "get_quantization_recipe",
    "remove_padding_from_scale_inv",
    "is_quantize_recipe_supported",
]
