"""``transformer_engine.jax.cpp_extensions`` (``tex``): the user-facing names only, the
collective-GEMM sets and the softmax helpers. TE's primitive classes and per-kernel entry points
(``quantize``, ``normalization_fwd`` ...) are internals lowbit does not mirror: use
``lowbit.dense``, ``lowbit.quantize``, ``lowbit.layernorm`` (docs/te_compat.md)."""

from lowbit.te.cpp_extensions import attention, misc, softmax
from lowbit.te.cpp_extensions.gemm import (
    CollectiveOp,
    CollectiveOpSet,
    collective_gemm_bootstrap,
    gemm,  # the function, as in TE (its ``from .gemm import *`` rebinds the submodule's name)
    noop_collective_op_set,
)
from lowbit.te.cpp_extensions.softmax import (
    is_softmax_kernel_available,
    jax_scaled_masked_softmax,
    jax_scaled_softmax,
    jax_scaled_upper_triang_masked_softmax,
)

__all__ = [
    "attention",
    "misc",
    "gemm",
    "softmax",
    "CollectiveOp",
    "CollectiveOpSet",
    "collective_gemm_bootstrap",
    "noop_collective_op_set",
    "is_softmax_kernel_available",
    "jax_scaled_masked_softmax",
    "jax_scaled_softmax",
    "jax_scaled_upper_triang_masked_softmax",
]
