"""The MoE block: gate -> router (top-k) -> dispatch -> grouped fc1 -> GLU -> grouped fc2 ->
combine, on one device or expert-parallel, with the load-balancing aux loss.

The routing is :mod:`lowbit.moe.router`'s; the experts, the dispatch and the expert-parallel
exchange are :func:`lowbit.ops.fused.moe.moe_experts`' (dropless by default; ``capacity_factor``
caps each expert (one device) or each receive buffer (a mesh)). The router runs inside the
expert-parallel shard_map on each device's own tokens; the aux loss's two per-expert totals
(summed scores, routed pairs) are summed over the devices there, so the loss is the global one
(TE's ``fused_moe_aux_loss`` over all tokens). Group sizes never leave the device.

Numerics: the gate in float32 (full-precision dot); tokens enter the grouped GEMMs as bfloat16
or FP8 (the recipe's); fc1's output bfloat16, the activation in float32 rounded once; the
weighted combine in float32; the output in x's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from lowbit.moe import router as _router
from lowbit.ops.fused.moe import moe_experts
from lowbit.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The static routing arguments (TE's names)."""

    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: float = 1.0
    aux_loss: bool = False


def gate_logits(x, gate_kernel):
    """(T, E) float32 router logits, full-precision dot."""
    return jnp.dot(
        x.astype(jnp.float32), gate_kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


def route_tokens(cfg: RouterConfig, x, gate_kernel, expert_bias=None):
    """(weights, experts, extra) for ``moe_experts``: extra = (summed aux scores (E,), routed
    pairs per expert (E,)) when the aux loss is on, else ()."""
    logits = gate_logits(x, gate_kernel)
    weights, experts = _router.topk_routing(
        logits,
        cfg.topk,
        score_function=cfg.score_function,
        use_pre_softmax=cfg.use_pre_softmax,
        num_groups=cfg.num_groups,
        group_topk=cfg.group_topk,
        scaling_factor=cfg.scaling_factor,
        expert_bias=expert_bias,
    )
    extra = ()
    if cfg.aux_loss:
        scores, _ = _router.aux_scores(logits, cfg.topk, cfg.score_function)
        counts = jnp.bincount(experts.reshape(-1), length=cfg.num_experts).astype(jnp.int32)
        extra = (jnp.sum(scores, axis=0), counts)
    return weights, experts, extra


def glu_activation(activation_type: Union[str, Sequence[str]]):
    """TE's ``activation_type`` ("silu", "gelu", ...) on the GLU halves -> lowbit's activations
    tuple; a tuple (lowbit's form) passes through."""
    if isinstance(activation_type, str):
        return (activation_type.lower(), "linear")
    return tuple(activation_type)


def moe_block(
    x: jax.Array,
    gate_kernel: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    wi_bias: Optional[jax.Array] = None,
    wo_bias: Optional[jax.Array] = None,
    expert_bias: Optional[jax.Array] = None,
    *,
    num_experts_per_tok: int,
    activation: Union[str, Sequence[str]] = "silu",
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: float = 1.0,
    aux_loss_coeff: float = 0.0,
    apply_topk_weights_early: bool = False,
    recipe: Optional[Recipe] = None,
    state: Optional[tuple] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    expert_axis: Optional[str] = None,
    dispatch: str = "auto",
    capacity_factor: Optional[float] = None,
    quantized_weights: Optional[tuple] = None,
) -> tuple[jax.Array, Optional[jax.Array], jax.Array]:
    """A mixture-of-experts block (see the module docstring).

    Args:
      x: (..., hidden) tokens (leading axes flattened).
      gate_kernel: (hidden, E) router weights.
      wi: (E, hidden, 2F) fc1, the gate half first, then the up half (``act(gate) * up``); a
        plain activation (``activation=("gelu",)``) takes (E, hidden, F). wo: (E, F, hidden).
      wi_bias: None or (E, 2F) (or (E, F)); wo_bias: None or (E, hidden).
      expert_bias: None or (E,): added to the scores for the choice only (sigmoid /
        sqrtsoftplus), no gradient.
      num_experts_per_tok: top-k. ``activation``: TE's name of the GLU's activation, or a
        lowbit activations tuple. Routing arguments as :func:`lowbit.moe.topk_routing`.
      aux_loss_coeff: > 0: also return the load-balancing loss (TE's formula, all tokens).
      apply_topk_weights_early: the routing weights scale fc2's input (one device only).
      recipe, state: the grouped GEMMs' recipe (None: BF16); DelayedScaling state
        ``(fc1_state, fc2_state)``, each ``lowbit.init_grouped_delayed_state(recipe, E)``.
      mesh, expert_axis, dispatch, capacity_factor: as :func:`lowbit.ops.fused.moe.moe_mlp`.
      quantized_weights: FP8 primary weights: ``(quantize_experts(wi, recipe, fc1_state),
        quantize_experts(wo, recipe, fc2_state))`` made outside the step (e.g. by the optimizer
        update); the GEMMs read these copies and never cast wi / wo (their gradients still
        reach wi and wo). None: each step casts the weights.

    Returns:
      ``(y, aux_loss, routed)``: y like x; aux_loss a float32 scalar, or None when
      ``aux_loss_coeff`` is 0; routed: int32 scalar, the (token, expert) pairs routed (before
      any capacity drop; T * k).
    """
    if jnp.ndim(x) < 2:
        raise ValueError(f"moe_block: x must be (..., hidden), got shape {tuple(jnp.shape(x))}")
    if jnp.ndim(gate_kernel) != 2 or gate_kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"moe_block: gate_kernel must be (hidden, num_experts) = ({x.shape[-1]}, E), "
            f"got {tuple(jnp.shape(gate_kernel))}"
        )
    E = gate_kernel.shape[1]
    if jnp.ndim(wi) != 3 or wi.shape[0] != E:
        raise ValueError(
            f"moe_block: wi must be (num_experts, hidden, 2F) with num_experts = {E}, "
            f"got {tuple(jnp.shape(wi))}"
        )
    fn = _router.score_function_name(score_function)
    _router.check_routing_args("moe_block", E, num_experts_per_tok, num_groups, group_topk, fn, expert_bias)
    if not isinstance(scaling_factor, (int, float)):
        raise TypeError(
            f"moe_block: scaling_factor must be a Python float, got {type(scaling_factor).__name__}"
        )
    cfg = RouterConfig(
        num_experts=E,
        topk=int(num_experts_per_tok),
        score_function=fn,
        use_pre_softmax=bool(use_pre_softmax),
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=float(scaling_factor),
        aux_loss=aux_loss_coeff > 0,
    )
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    bias = None if wi_bias is None and wo_bias is None else (wi_bias, wo_bias)
    route = (functools.partial(route_tokens, cfg), (gate_kernel, expert_bias))
    y, extra = moe_experts(
        x2, route, wi, wo, activation=glu_activation(activation), recipe=recipe, state=state,
        mesh=mesh, expert_axis=expert_axis, dispatch=dispatch, capacity_factor=capacity_factor,
        bias=bias, quantized_weights=quantized_weights, weights_early=apply_topk_weights_early,
        name="moe_block",
    )  # fmt: skip
    T, k = x2.shape[0], cfg.topk
    loss = None
    if cfg.aux_loss:
        score_sum, counts = extra
        loss = jnp.sum(score_sum * counts.astype(jnp.float32)) * jnp.float32(E * aux_loss_coeff / (k * T * T))
    return y.reshape(shape), loss, jnp.int32(T * k)


__all__ = ["RouterConfig", "gate_logits", "glu_activation", "moe_block", "route_tokens"]
