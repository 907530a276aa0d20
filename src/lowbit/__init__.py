"""lowbit: low-precision (FP8, MXFP8, NVFP4) training building blocks for JAX."""

from lowbit import checkpoint_policies, flax, recipe
from lowbit.autocast import autocast, get_recipe
from lowbit.capabilities import (
    get_supported_quantization_recipes,
    get_supported_scaling_modes,
    is_fp8_available,
    is_scaling_mode_supported,
)
from lowbit.delayed_scaling import init_delayed_state, init_grouped_delayed_state, update_delayed_scale
from lowbit.ops.activation import activation
from lowbit.ops.dense import dense
from lowbit.ops.gemm import gemm
from lowbit.ops.grouped_gemm import grouped_gemm
from lowbit.ops.norm import layernorm
from lowbit.ops.quantize import dequantize, grouped_dequantize, grouped_quantize, quantize, quantize_dbias
from lowbit.ops.softmax import softmax
from lowbit.quantization import ScaledTensor, ScalingMode
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from lowbit.sharding import MeshResource, global_mesh_resource, global_shard_guard

__version__ = "0.1.0"

__all__ = [
    "grouped_gemm",
    "init_grouped_delayed_state",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "ScaledTensor",
    "ScalingMode",
    "dequantize",
    "grouped_dequantize",
    "grouped_quantize",
    "quantize",
    "quantize_dbias",
    "recipe",
    "gemm",
    "dense",
    "init_delayed_state",
    "update_delayed_scale",
    "MeshResource",
    "global_mesh_resource",
    "global_shard_guard",
    "autocast",
    "get_recipe",
    "get_supported_quantization_recipes",
    "get_supported_scaling_modes",
    "is_fp8_available",
    "is_scaling_mode_supported",
    "checkpoint_policies",
    "flax",
    "layernorm",
    "activation",
    "softmax",
]
