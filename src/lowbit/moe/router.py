"""The MoE router: scores, top-k (plain or grouped), expert bias, scaling; the aux loss.

Semantics follow TransformerEngine's fused router (``fused_topk_with_score_function`` and
``fused_moe_aux_loss``), in float32, as plain JAX (XLA fuses it; no host sync):

* ``softmax``: ``use_pre_softmax``: softmax over all experts, then top-k of the probabilities;
  otherwise top-k of the logits, then softmax over the chosen k.
* ``sigmoid`` / ``sqrtsoftplus`` (``sqrt(softplus(logit))``): top-k of the scores (plus
  ``expert_bias`` for the choice only: the weights are the unbiased scores), then, when k > 1,
  normalised to sum to 1 (``+ 1e-20`` in the denominator).
* grouped top-k (``num_groups`` / ``group_topk``, DeepSeek-V3): the experts form ``num_groups``
  equal groups; a group scores the sum of its ``topk // group_topk`` best (biased) scores; the
  top-k is taken among the experts of the ``group_topk`` best groups.
* ``scaling_factor`` multiplies the final weights.

The gradient reaches the logits through the chosen weights (the choice itself is a constant);
``expert_bias`` gets none, as in TE. The compact form (weights and expert ids, (T, k)) is what
dispatch reads; :func:`to_dense` gives TE's (T, E) probabilities and routing map.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from lowbit.moe.router_fused import FusedRouter, route_fused
from lowbit.ops.fused.permutation_fused import check_impl

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def score_function_name(score_function) -> str:
    """A score function's lowercase name from a string or an enum member (``.name``)."""
    name = getattr(score_function, "name", score_function)
    if not isinstance(name, str) or name.lower() not in SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be one of {SCORE_FUNCTIONS} (or the enum), got {score_function!r}"
        )
    return name.lower()


def _scores(logits, fn):
    if fn == "sigmoid":
        return jax.nn.sigmoid(logits)
    if fn == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    return jax.nn.softmax(logits, axis=-1)


def _grouped_mask(scores, topk, num_groups, group_topk):
    """(T, E) bool: the experts of each token's ``group_topk`` best groups."""
    T, E = scores.shape
    per_group = topk // group_topk
    grouped = scores.reshape(T, num_groups, E // num_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, per_group)[0], axis=-1)
    chosen = jax.lax.top_k(group_score, group_topk)[1]
    gmask = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], chosen].set(True)
    return jnp.repeat(gmask, E // num_groups, axis=1)


def _select(choice, topk, num_groups, group_topk):
    """Indices (T, k) of the top-k of ``choice`` (within the best groups when grouped)."""
    if num_groups:
        choice = jnp.where(_grouped_mask(choice, topk, num_groups, group_topk), choice, -jnp.inf)
    return jax.lax.top_k(choice, topk)[1]


def check_routing_args(name, num_experts, topk, num_groups, group_topk, score_function, expert_bias):
    """Checks the static routing arguments; returns (num_groups, group_topk) with None for off."""
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"{name}: topk must be an integer in [1, num_experts={num_experts}], got {topk!r}")
    groups = num_groups if num_groups is not None and num_groups > 0 else None
    gtopk = group_topk if group_topk is not None and group_topk > 0 else None
    if (groups is None) != (gtopk is None):
        raise ValueError(
            f"{name}: grouped top-k needs both num_groups and group_topk > 0, got "
            f"num_groups={num_groups!r}, group_topk={group_topk!r}"
        )
    if groups is not None:
        if num_experts % groups:
            raise ValueError(f"{name}: num_groups={groups} must divide num_experts={num_experts}")
        if not 1 <= gtopk <= groups:
            raise ValueError(f"{name}: group_topk must be in [1, num_groups={groups}], got {gtopk}")
        if topk % gtopk or topk // gtopk > num_experts // groups:
            raise ValueError(
                f"{name}: topk={topk} must be a multiple of group_topk={gtopk} with topk // group_topk "
                f"<= experts per group ({num_experts // groups})"
            )
        if topk > gtopk * (num_experts // groups):
            raise ValueError(f"{name}: topk={topk} exceeds the experts of group_topk={gtopk} groups")
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError(
                f"{name}: expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus', not 'softmax'"
            )
        if tuple(jnp.shape(expert_bias)) != (num_experts,):
            raise ValueError(
                f"{name}: expert_bias must have shape (num_experts,) = ({num_experts},), "
                f"got {tuple(jnp.shape(expert_bias))}"
            )
    return groups, gtopk


def _check_logits(name, logits):
    if jnp.ndim(logits) != 2 or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise ValueError(
            f"{name}: logits must be a 2-D float array (num_tokens, num_experts), got shape "
            f"{tuple(jnp.shape(logits))} dtype {jnp.result_type(logits)}"
        )


def topk_routing(
    logits: jax.Array,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: float = 1.0,
    expert_bias: Optional[jax.Array] = None,
    impl: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
    """Routes (T, E) ``logits``: returns ``(weights (T, topk) float32, experts (T, topk) int32)``,
    each row's experts in descending order of their (biased) score. See the module docstring.
    ``impl``: "xla" (plain JAX), "fused" (one kernel, :mod:`lowbit.moe.router_fused`) or None
    (the default ``lowbit.moe.kernels`` sets; initially "xla")."""
    _check_logits("topk_routing", logits)
    impl = check_impl("topk_routing", impl)
    fn = score_function_name(score_function)
    groups, gtopk = check_routing_args(
        "topk_routing", logits.shape[1], topk, num_groups, group_topk, fn, expert_bias
    )
    z = logits.astype(jnp.float32)
    if impl == "fused":
        if topk > 64 or logits.shape[1] > 1024 or (groups or 0) > 64:
            raise ValueError(
                f"topk_routing: impl='fused' handles topk <= 64, num_experts <= 1024 and num_groups <= 64, "
                f"got topk={topk}, num_experts={logits.shape[1]}, num_groups={groups}"
            )
        cfg = FusedRouter(topk, fn, bool(use_pre_softmax), groups, gtopk, float(scaling_factor))
        bias = None if expert_bias is None else jax.lax.stop_gradient(expert_bias).astype(jnp.float32)
        return route_fused(cfg, z, bias)
    if fn == "softmax" and not use_pre_softmax:
        idx = _select(z, topk, groups, gtopk)
        weights = jax.nn.softmax(jnp.take_along_axis(z, idx, axis=1), axis=-1)
    else:
        scores = _scores(z, fn)
        choice = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
        idx = _select(jax.lax.stop_gradient(choice), topk, groups, gtopk)
        weights = jnp.take_along_axis(scores, idx, axis=1)
        if fn != "softmax" and topk > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scaling_factor != 1.0:
        weights = weights * jnp.float32(scaling_factor)
    return weights, idx.astype(jnp.int32)


def to_dense(weights: jax.Array, experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(T, k) weights and expert ids -> (T, E) probabilities (zero where not routed) and the
    (T, E) bool routing map."""
    T = weights.shape[0]
    rows = jnp.arange(T)[:, None]
    probs = jnp.zeros((T, num_experts), weights.dtype).at[rows, experts].set(weights)
    routing_map = jnp.zeros((T, num_experts), bool).at[rows, experts].set(True)
    return probs, routing_map


def aux_scores(logits: jax.Array, topk: int, score_function: str = "softmax") -> tuple[jax.Array, jax.Array]:
    """The aux loss's view of the router: ``(scores (T, E) float32, routing_map (T, E) bool)``:
    softmax, or sigmoid / sqrtsoftplus normalised over all experts; the map marks the plain top-k
    (no bias, groups or scaling)."""
    _check_logits("aux_scores", logits)
    fn = score_function_name(score_function)
    check_routing_args("aux_scores", logits.shape[1], topk, None, None, fn, None)
    scores = _scores(logits.astype(jnp.float32), fn)
    if fn != "softmax":
        scores = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    idx = jax.lax.top_k(jax.lax.stop_gradient(scores), topk)[1]
    T = scores.shape[0]
    routing_map = jnp.zeros(scores.shape, bool).at[jnp.arange(T)[:, None], idx].set(True)
    return scores, routing_map


def aux_loss(probs: jax.Array, tokens_per_expert: jax.Array, topk: int, coeff: float) -> jax.Array:
    """Load-balancing loss ``E * coeff / (k * T^2) * sum_e(sum_t probs[t, e] * tokens_per_expert[e])``
    (T, E from probs' shape), float32; its gradient reaches ``probs`` only."""
    if jnp.ndim(probs) != 2:
        raise ValueError(
            f"aux_loss: probs must be 2-D (num_tokens, num_experts), got shape {tuple(jnp.shape(probs))}"
        )
    T, E = probs.shape
    if tuple(jnp.shape(tokens_per_expert)) != (E,):
        raise ValueError(
            f"aux_loss: tokens_per_expert must have shape (num_experts,) = ({E},), "
            f"got {tuple(jnp.shape(tokens_per_expert))}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"aux_loss: topk must be a positive integer, got {topk!r}")
    counts = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    per_expert = jnp.sum(probs.astype(jnp.float32), axis=0)
    return jnp.sum(per_expert * counts) * jnp.float32(E * coeff / (topk * T * T))


__all__ = ["SCORE_FUNCTIONS", "aux_loss", "aux_scores", "check_routing_args", "to_dense", "topk_routing"]
