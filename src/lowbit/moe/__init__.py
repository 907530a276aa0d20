"""Mixture of experts: the router (:mod:`.router`), token dispatch / combine
(:mod:`.permutation`), the MoE block (:mod:`.block`) on lowbit's grouped GEMM, one device or
expert-parallel. Layer: above ``lowbit.ops.fused`` (whose ``moe`` engine it drives), below
``lowbit.flax``."""

from lowbit.moe.block import moe_block
from lowbit.moe.permutation import DispatchPlan, permute, plan_dispatch, sort_chunks, unpermute
from lowbit.moe.router import aux_loss, aux_scores, to_dense, topk_routing
from lowbit.ops.fused.expert_copies_jnp import apply_update_with_fp8_copies, delayed_expert_copies
from lowbit.ops.fused.grouped_prequantized import (
    QuantizedExperts,
    grouped_gemm_prequantized,
    quantize_experts,
)
from lowbit.ops.fused.permutation_fused import kernels, permute_quantize

__all__ = [
    "DispatchPlan",
    "QuantizedExperts",
    "apply_update_with_fp8_copies",
    "delayed_expert_copies",
    "grouped_gemm_prequantized",
    "kernels",
    "permute_quantize",
    "quantize_experts",
    "aux_loss",
    "aux_scores",
    "moe_block",
    "permute",
    "plan_dispatch",
    "sort_chunks",
    "to_dense",
    "topk_routing",
    "unpermute",
]
