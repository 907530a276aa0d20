"""``MoEBlock``: a Flax mixture-of-experts layer on :func:`lowbit.moe.moe_block` (TE's
``_MoEBlock`` fields, order and defaults; lowbit.te.flax exports it under that name too).

Parameters: ``gate_kernel`` (H, E), ``wi`` (E, H, 2 F) (the gate half first), ``wo`` (E, F, H);
``wi_0_bias`` / ``wi_1_bias`` (E, F) and ``wo_bias`` (E, H) with ``use_ffn_bias``;
``expert_bias`` (E,) float32 with ``use_expert_routing_bias``. DelayedScaling keeps one amax
history and scale per expert for each GEMM (submodules ``fc1_state`` / ``fc2_state``, in the
``_overwrite_with_gradient`` collection). Expert parallelism runs over the mesh axis that the
global MeshResource names ``ep_resource`` (when the mesh in context has it with size > 1).

FP8 primary weights (``fp8_primary_weights=True``, lowbit's field, off by default so ``init``
returns TE's collections; one device): under an FP8 recipe
``init`` declares the ``"fp8_weights"`` collection; once the training loop fills it with
:func:`lowbit.flax.refresh_fp8_weights` after each optimizer update, the block reads those FP8
copies of ``wi`` / ``wo`` and casts no weight in the step (:mod:`lowbit.flax.fp8_weights`).
Without the refresh it casts in the step, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax.fp8_weights import expert_copies
from lowbit.flax.state_module import delayed_state_variables
from lowbit.moe.block import moe_block
from lowbit.recipe import DelayedScaling, Recipe
from lowbit.sharding import current_mesh, global_mesh_resource

__all__ = ["MoEBlock"]


class _GroupedState(nn.Module):
    """One GEMM's per-expert DelayedScaling state."""

    @nn.compact
    def __call__(self, recipe: DelayedScaling, num_groups: int) -> dict:
        return delayed_state_variables(self, recipe, num_groups=num_groups)


def _ep_mesh(data_parallelism_axes):
    axis = global_mesh_resource().ep_resource
    mesh = current_mesh()
    if axis is None or mesh is None or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None, None
    if data_parallelism_axes:
        raise NotImplementedError(
            "MoEBlock: data_parallelism_axes is not supported with expert parallelism yet"
        )
    return mesh, axis


class MoEBlock(nn.Module):
    """A top-k MoE layer: ``(output, aux_loss or None, routed pairs)`` from ``(B, S, H)`` inputs."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    intermediate_size: int = 2048
    activation_type: str = "silu"
    score_function: Union[str, Any] = "softmax"
    use_pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: float = 1.0
    use_expert_routing_bias: bool = False
    aux_loss_coeff: float = 0.0
    gate_kernel_axes: Tuple[Optional[str], ...] = ()
    wi_kernel_axes: Tuple[Optional[str], ...] = ("exp", "embed", "mlp")
    wo_kernel_axes: Tuple[Optional[str], ...] = ("exp", "mlp", "embed")
    input_axes: Tuple[Optional[str], ...] = ()
    data_parallelism_axes: Tuple[str, ...] = ()
    apply_topk_weights_early: bool = False
    recv_capacity_per_rank: Optional[int] = None
    dtype: Any = jnp.float32
    kernel_init: Optional[Callable] = None
    bias_init: Callable = nn.initializers.zeros
    expert_bias_init: Callable = nn.initializers.zeros
    use_ffn_bias: bool = False
    quantization_recipe: Optional[Recipe] = None
    fp8_primary_weights: bool = False  # lowbit's: declare "fp8_weights"; read the copies when filled

    @nn.compact
    def __call__(self, inputs: jax.Array):
        if inputs.ndim != 3:
            raise ValueError(f"MoEBlock: inputs must be (batch, sequence, hidden), got shape {inputs.shape}")
        H, E, F = inputs.shape[-1], self.num_experts, self.intermediate_size
        init = self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        part = nn.with_logical_partitioning
        gate = self.param("gate_kernel", part(init, self.gate_kernel_axes), (H, E), self.dtype)
        wi = self.param("wi", part(init, self.wi_kernel_axes), (E, H, 2 * F), self.dtype)
        wo = self.param("wo", part(init, self.wo_kernel_axes), (E, F, H), self.dtype)
        wi_bias = wo_bias = expert_bias = None
        if self.use_ffn_bias:
            b0 = self.param("wi_0_bias", part(self.bias_init, ("exp", "mlp")), (E, F), self.dtype)
            b1 = self.param("wi_1_bias", part(self.bias_init, ("exp", "mlp")), (E, F), self.dtype)
            wi_bias = jnp.concatenate([b0, b1], axis=-1)
            wo_bias = self.param("wo_bias", part(self.bias_init, ("exp", "embed")), (E, H), self.dtype)
        if self.use_expert_routing_bias:
            expert_bias = self.param("expert_bias", part(self.expert_bias_init, ("exp",)), (E,), jnp.float32)
        recipe = self.quantization_recipe if self.quantization_recipe is not None else get_recipe()
        state = None
        if isinstance(recipe, DelayedScaling):
            state = (_GroupedState(name="fc1_state")(recipe, E), _GroupedState(name="fc2_state")(recipe, E))
        mesh, axis = _ep_mesh(self.data_parallelism_axes)
        capacity_factor = None
        if self.recv_capacity_per_rank is not None:
            tokens = inputs.shape[0] * inputs.shape[1] // (1 if mesh is None else mesh.shape[axis])
            capacity_factor = self.recv_capacity_per_rank / (tokens * self.num_experts_per_tok)
        qws = expert_copies(self, recipe, wi, wo, self.fp8_primary_weights and mesh is None)
        return moe_block(
            inputs, gate, wi, wo, wi_bias, wo_bias, expert_bias,
            num_experts_per_tok=self.num_experts_per_tok, activation=self.activation_type,
            score_function=self.score_function, use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups, group_topk=self.group_topk, scaling_factor=self.scaling_factor,
            aux_loss_coeff=self.aux_loss_coeff, apply_topk_weights_early=self.apply_topk_weights_early,
            recipe=recipe, state=state, mesh=mesh, expert_axis=axis, capacity_factor=capacity_factor,
            quantized_weights=qws,
        )  # fmt: skip
