"""The router as one kernel (csrc/kernels/*/moe.*): scores, expert bias, (grouped) top-k and the
normalised weights per token in one pass over the logits, and its backward (the logits'
gradient through the chosen weights) in another. :func:`lowbit.moe.topk_routing` calls it with
``impl="fused"`` (or under ``lowbit.moe.kernels("fused")``).

Against the XLA path: the same experts, in the same order, unless two choice values of a token
are within float32 rounding of each other (the scores' exp / log may differ in the last ulp
between XLA and the kernel; exact ties go to the lower index in both); the weights and the
gradient agree to float32 rounding (sums in another order).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from lowbit.ops._ffi import moe as ffi


@dataclasses.dataclass(frozen=True)
class FusedRouter:
    topk: int
    score: str
    pre_softmax: bool
    num_groups: Optional[int]
    group_topk: Optional[int]
    scaling: float


def _fwd_call(cfg, logits, bias):
    return ffi.router_fwd(
        logits, bias, topk=cfg.topk, score=cfg.score, pre_softmax=cfg.pre_softmax,
        num_groups=cfg.num_groups, group_topk=cfg.group_topk, scaling=cfg.scaling,
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def route_fused(cfg: FusedRouter, logits, bias):
    """(weights (T, k) float32, experts (T, k) int32) of float32 ``logits``; ``bias`` (E,)
    float32 or None gets no gradient."""
    return _fwd_call(cfg, logits, bias)


def _route_fwd(cfg, logits, bias):
    w, e = _fwd_call(cfg, logits, bias)
    return (w, e), (logits, e, bias)


def _route_bwd(cfg, res, cts):
    logits, experts, bias = res
    dw = cts[0]
    dlogits = ffi.router_bwd(
        logits, experts, dw.astype(jnp.float32), score=cfg.score, pre_softmax=cfg.pre_softmax,
        scaling=cfg.scaling,
    )  # fmt: skip
    return dlogits, None if bias is None else jnp.zeros_like(bias)


route_fused.defvjp(_route_fwd, _route_bwd)

__all__ = ["FusedRouter", "route_fused"]
