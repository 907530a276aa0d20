"""``transformer_engine.jax.moe`` on :func:`lowbit.moe.moe_block` (gate -> top-k -> dispatch ->
grouped GEMMs -> combine; expert-parallel over ``ep_axis`` of the mesh in context, through
lowbit's all-to-all exchange rather than TE's NCCL EP bootstrap)."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax.numpy as jnp

from lowbit.moe.block import moe_block
from lowbit.sharding import current_mesh
from lowbit.te._common import constrain
from lowbit.te.quantize import QuantizerSet, noop_quantizer_set, recipe_of

__all__ = ["get_moe_recv_capacity_per_rank", "moe"]

_ALIGN_SIZE = 128


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def get_moe_recv_capacity_per_rank(
    *,
    num_experts: int,
    num_experts_per_tok: int,
    max_tokens_per_rank: int,
    ep_size: int,
    recv_capacity_factor: Optional[float] = None,
    alignment: int = _ALIGN_SIZE,
) -> int:
    """TE's aligned receive capacity of one EP rank: the dropless worst case (None), or
    ``recv_capacity_factor`` (>= 1) times a balanced load, capped at the worst case."""
    if min(num_experts, num_experts_per_tok, max_tokens_per_rank) <= 0:
        raise ValueError("num_experts, num_experts_per_tok and max_tokens_per_rank must be positive")
    if ep_size <= 0 or num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep_size}")
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    if recv_capacity_factor is not None:
        f = float(recv_capacity_factor)
        if not math.isfinite(f) or f < 1.0:
            raise ValueError(
                f"recv_capacity_factor must be finite and >= 1.0, or None; got {recv_capacity_factor}"
            )
    local = num_experts // ep_size
    group_tokens = ep_size * max_tokens_per_rank
    assignments = group_tokens * min(num_experts_per_tok, local)
    total_bound = _round_up(assignments + (alignment - 1) * min(local, assignments), alignment)
    worst = min(local * _round_up(group_tokens, alignment), total_bound)
    if recv_capacity_factor is None:
        return worst
    balanced = local * _round_up(-(-max_tokens_per_rank * num_experts_per_tok // local), alignment)
    return min(_round_up(math.ceil(balanced * float(recv_capacity_factor)), alignment), worst)


def moe(
    x: jnp.ndarray,
    gate_kernel: jnp.ndarray,
    wi: jnp.ndarray,
    wo: jnp.ndarray,
    wi_0_bias: Optional[jnp.ndarray] = None,
    wi_1_bias: Optional[jnp.ndarray] = None,
    wo_bias: Optional[jnp.ndarray] = None,
    expert_bias: Optional[jnp.ndarray] = None,
    *,
    num_experts: int,
    num_experts_per_tok: int,
    activation_type: str = "silu",
    score_function: Union[str, object] = "softmax",
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: float = 1.0,
    aux_loss_coeff: float = 0.0,
    apply_topk_weights_early: bool = False,
    quantizer_sets: Tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
    ep_axis: str,
    data_parallelism_axes: Tuple[str, ...] = (),
    input_axes: Tuple[Optional[str], ...] = (),
    gate_kernel_axes: Tuple[Optional[str], ...] = (),
    wi_kernel_axes: Tuple[Optional[str], ...] = ("exp", "embed", "mlp"),
    wo_kernel_axes: Tuple[Optional[str], ...] = ("exp", "mlp", "embed"),
    dtype: jnp.dtype = jnp.float32,
    recv_capacity_per_rank: Optional[int] = None,
    quantized_weights: Optional[tuple] = None,
):
    """TE's MoE block: ``(output, aux_loss or None, total_recv_tokens)`` (``dtype`` and the
    logical kernel axes are accepted and unused: lowbit keeps the weights' dtype). Runs on one device
    when the mesh in context lacks ``ep_axis`` (or it has size 1). ``total_recv_tokens``: the
    routed (token, expert) pairs, T * k. ``recv_capacity_per_rank`` caps each rank's receive
    buffer (pairs past it are dropped); None: dropless. ``quantized_weights`` (lowbit's): FP8
    primary weights, ``(lowbit.moe.quantize_experts(wi, recipe, fc1_state),
    quantize_experts(wo, recipe, fc2_state))`` made outside the step (see
    :func:`lowbit.moe.moe_block`); None: the step casts wi / wo."""
    if gate_kernel.shape[-1] != num_experts or wi.shape[0] != num_experts:
        raise ValueError(
            f"moe: num_experts={num_experts} must match gate_kernel's last dim ({gate_kernel.shape[-1]}) "
            f"and wi's first ({wi.shape[0]})"
        )
    if data_parallelism_axes:
        raise NotImplementedError("moe: data_parallelism_axes is not supported by lowbit.te yet")
    (r1, s1), (r2, s2) = recipe_of(quantizer_sets[0]), recipe_of(quantizer_sets[1])
    if type(r1) is not type(r2):
        raise ValueError(
            f"moe: quantizer_sets must share a recipe, got {type(r1).__name__} and {type(r2).__name__}"
        )
    state = None if s1 is None else (s1, s2)
    mesh = current_mesh()
    if mesh is None or ep_axis not in mesh.axis_names or mesh.shape[ep_axis] == 1:
        mesh, axis, n = None, None, 1
    else:
        axis, n = ep_axis, mesh.shape[ep_axis]
    wi_bias = None
    if wi_0_bias is not None or wi_1_bias is not None:
        if wi_0_bias is None or wi_1_bias is None:
            raise ValueError("moe: wi_0_bias and wi_1_bias go together (both or neither)")
        wi_bias = jnp.concatenate([wi_0_bias, wi_1_bias], axis=-1)
    capacity_factor = None
    if recv_capacity_per_rank is not None:
        tokens = x.size // x.shape[-1] // n
        capacity_factor = recv_capacity_per_rank / (tokens * num_experts_per_tok)
    y, aux, routed = moe_block(
        constrain(x, input_axes), gate_kernel, wi, wo, wi_bias, wo_bias,
        expert_bias, num_experts_per_tok=num_experts_per_tok, activation=activation_type,
        score_function=score_function, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
        group_topk=group_topk, scaling_factor=scaling_factor, aux_loss_coeff=aux_loss_coeff,
        apply_topk_weights_early=apply_topk_weights_early, recipe=r1, state=state, mesh=mesh,
        expert_axis=axis, capacity_factor=capacity_factor, quantized_weights=quantized_weights,
    )  # fmt: skip
    return y.astype(x.dtype), aux, routed
