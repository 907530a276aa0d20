"""Attention at the JAX level: packed sequences (:mod:`.descriptor`), the shared math with
attention sinks (:mod:`.core`), context parallelism (:mod:`.context_parallel`) and the one
function that picks the implementation (:mod:`.dispatch`)."""

from lowbit.ops.attention import context_parallel_fused as _cp_fused  # noqa: F401  (registers "cudnn_cp")
from lowbit.ops.attention import cudnn_impl as _cudnn_impl  # noqa: F401  (registers "cudnn_ffi")
from lowbit.ops.attention import cudnn_packed as _cudnn_packed  # noqa: F401  (registers "cudnn_thd")
from lowbit.ops.attention.context_parallel import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from lowbit.ops.attention.core import SOFTMAX_TYPES, softmax_type_name
from lowbit.ops.attention.descriptor import Segments, SequenceDescriptor, to_segments
from lowbit.ops.attention.dispatch import (
    AttentionArrays,
    AttentionSpec,
    attention,
    cp_active,
    implementations,
    make_spec,
    pick_implementation,
    register_implementation,
)

__all__ = [
    "SOFTMAX_TYPES",
    "AttentionArrays",
    "AttentionSpec",
    "ReorderStrategy",
    "Segments",
    "SequenceDescriptor",
    "attention",
    "cp_active",
    "implementations",
    "make_spec",
    "inverse_reorder_causal_load_balancing",
    "pick_implementation",
    "register_implementation",
    "reorder_causal_load_balancing",
    "softmax_type_name",
    "to_segments",
]
