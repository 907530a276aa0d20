"""TransformerEngine's JAX API on lowbit: ``import lowbit.te as te`` where TE code has
``import transformer_engine.jax as te`` (and ``from lowbit import recipe`` for
``from transformer_engine.common import recipe``).

The module tree mirrors ``transformer_engine.jax``: ``lowbit.te.flax``, ``.quantize``,
``.sharding``, ``.dense``, ``.layernorm``, ``.layernorm_dense``, ``.layernorm_mlp``,
``.activation``, ``.softmax``, ``.checkpoint_policies``, ``.router``, ``.permutation``,
``.moe``. What lowbit cannot do raises an error that says so; docs/te_compat.md lists every
name with its status.
"""

from lowbit.te import (
    activation,
    attention,
    checkpoint,
    checkpoint_policies,
    cpp_extensions,
    dense,
    flax,
    layernorm,
    layernorm_dense,
    layernorm_mlp,
    moe,
    permutation,
    quantize,
    router,
    sharding,
    softmax,
)
from lowbit.te.quantize import (
    NVTE_FP8_COLLECTION_NAME,
    autocast,
    fp8_autocast,
    get_delayed_scaling,
    get_supported_quantization_recipes,
    is_fp8_available,
    is_scaling_mode_supported,
    update_collections,
)
from lowbit.te.sharding import MeshResource

__all__ = [
    "activation",
    "attention",
    "checkpoint",
    "checkpoint_policies",
    "cpp_extensions",
    "dense",
    "flax",
    "layernorm",
    "layernorm_dense",
    "layernorm_mlp",
    "moe",
    "permutation",
    "quantize",
    "router",
    "sharding",
    "softmax",
    "NVTE_FP8_COLLECTION_NAME",
    "autocast",
    "fp8_autocast",
    "get_delayed_scaling",
    "get_supported_quantization_recipes",
    "is_fp8_available",
    "is_scaling_mode_supported",
    "update_collections",
    "MeshResource",
]
