"""``transformer_engine.jax.router`` on :mod:`lowbit.moe.router` (plain JAX; XLA fuses it)."""

from __future__ import annotations

import enum
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from lowbit.moe import router as _router

__all__ = ["ScoreFunction", "RoutingMapFormat", "fused_topk_with_score_function", "fused_moe_aux_loss"]


class ScoreFunction(enum.IntEnum):
    SIGMOID = 0
    SOFTMAX = 1
    SQRTSOFTPLUS = 2


class RoutingMapFormat(enum.IntEnum):
    BYTEMAP = 0  # bool (T, E)
    BITMAP_U8 = 1  # uint8 (T, ceil(E / 8)), bit e % 8 of byte e // 8, LSB first


def _map_format(fmt) -> RoutingMapFormat:
    if isinstance(fmt, RoutingMapFormat):
        return fmt
    if isinstance(fmt, int) and not isinstance(fmt, bool):
        try:
            return RoutingMapFormat(fmt)
        except ValueError:
            pass
    elif isinstance(fmt, str) and fmt.upper() in RoutingMapFormat.__members__:
        return RoutingMapFormat[fmt.upper()]
    raise ValueError(
        f"routing_map_format must be 'bytemap', 'bitmap_u8', a RoutingMapFormat or its int; got {fmt!r}"
    )


def pack_bitmap(routing_map: jax.Array) -> jax.Array:
    """bool (T, E) -> uint8 (T, ceil(E / 8)), LSB first along the experts."""
    T, E = routing_map.shape
    bits = jnp.pad(routing_map.astype(jnp.uint8), ((0, 0), (0, -E % 8))).reshape(T, -1, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def fused_topk_with_score_function(
    logits: jnp.ndarray,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: Union[str, ScoreFunction] = ScoreFunction.SOFTMAX,
    expert_bias: Optional[jnp.ndarray] = None,
    compute_aux_scores: bool = False,
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
) -> Tuple[jnp.ndarray, jnp.ndarray]:
    """TE's router: ``(probs (T, E), routing_map)``; probs are sparse (zero off the top-k) or,
    with ``compute_aux_scores``, the dense scores of the aux loss (bias, groups and scaling
    ignored). float32 math; probs in the logits' dtype."""
    if not isinstance(scaling_factor, (int, float)):
        raise TypeError(
            f"scaling_factor must be a Python float or int, not {type(scaling_factor).__name__} "
            "(use math.sqrt, not jnp.sqrt)"
        )
    fn = _router.score_function_name(score_function)
    fmt = _map_format(routing_map_format)
    E = jnp.shape(logits)[-1]
    if compute_aux_scores:
        probs, routing_map = _router.aux_scores(logits, topk, fn)
    else:
        w, idx = _router.topk_routing(
            logits, topk, score_function=fn, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
            group_topk=group_topk, scaling_factor=scaling_factor, expert_bias=expert_bias,
        )  # fmt: skip
        probs, routing_map = _router.to_dense(w, idx, E)
    probs = probs.astype(logits.dtype)
    return probs, pack_bitmap(routing_map) if fmt == RoutingMapFormat.BITMAP_U8 else routing_map


def fused_moe_aux_loss(
    probs: jnp.ndarray, tokens_per_expert: jnp.ndarray, topk: int, coeff: float
) -> jnp.ndarray:
    """``E * coeff / (k * T^2) * sum_e(sum_t probs[t, e] * tokens_per_expert[e])``."""
    return _router.aux_loss(probs, tokens_per_expert, topk, coeff)
