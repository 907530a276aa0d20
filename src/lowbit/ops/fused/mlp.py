"""mlp: ``act(x . kernel_1 + bias_1) . kernel_2 + bias_2`` as one custom VJP.

Under tensor scaling (DelayedScaling, Float8CurrentScaling) the activation kernel writes the
second GEMM's FP8 input itself, and in the backward the activation-gradient kernel writes the
first GEMM's FP8 gradient (with its bias gradient): the 2 x (M, F) BF16 round trips and the two
quantize passes of ``dense(activation(dense(x)))`` go away. The results equal that composition
bit for bit (the fused FP8 copies equal ``lowbit.quantize`` of the rounded activation).
Float8BlockScaling runs the same VJP: the kernels write the 1x128 (or 128x128) block-scaled
copies and their scales where the tensor is whole 16x16 tiles (``LOWBIT_BLOCK_FUSION=0``: the
composition). Other recipes, activations the kernel lacks, and sharded GEMMs take the
composition.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Union

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike, DTypeLike

from lowbit import delayed_scaling as ds
from lowbit.autocast import get_recipe
from lowbit.ops import collective_dense
from lowbit.ops import dense as dense_mod
from lowbit.ops.activation import act_backward, act_forward, activation, parse_activations
from lowbit.ops.fused import dense_norm
from lowbit.ops.nonfinite import poison_nonfinite
from lowbit.quantization.checks import check_input
from lowbit.quantization.tensor import prod
from lowbit.recipe import Recipe
from lowbit.sharding import plan_dense


@dataclasses.dataclass(frozen=True)
class _MlpConfig:
    first: dense_mod._Config
    second: dense_mod._Config
    act: int
    gated: bool
    hidden_name: str
    norm: Optional[dense_norm.NormConfig] = None  # a norm in front of the first GEMM


def _forward(cfg: _MlpConfig, x, k1, b1, k2, b2, s1, s2, gamma, beta):
    qx, y_norm, norm_res = dense_norm.quantize_input(cfg.first, cfg.norm, x, gamma, beta, s1)
    h, qk1 = dense_mod.forward_quantized(cfg.first, qx, k1, b1, s1)
    h = checkpoint_name(h, cfg.hidden_name)  # a residual: remat policies may save it by name
    qz = poison_nonfinite(
        act_forward(h, cfg.act, cfg.gated, dense_mod.fused_spec(cfg.second, s2, "x", h.dtype), False)
    )
    y, qk2 = dense_mod.forward_quantized(cfg.second, qz, k2, b2, s2)
    res1 = dense_mod.backward_residuals(qx, qk1, cfg.first.checkpoint_name)
    res = (*res1, s1, h, *dense_mod.backward_residuals(qz, qk2, cfg.second.checkpoint_name), s2)
    return (y, y_norm), (*res, norm_res)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp_2d(cfg: _MlpConfig, x, k1, b1, k2, b2, s1, s2, gamma, beta):
    return _forward(cfg, x, k1, b1, k2, b2, s1, s2, gamma, beta)[0]


def _mlp_2d_fwd(cfg: _MlpConfig, x, k1, b1, k2, b2, s1, s2, gamma, beta):
    return _forward(cfg, x, k1, b1, k2, b2, s1, s2, gamma, beta)


def _mlp_2d_bwd(cfg: _MlpConfig, res, cts):
    qx_c, qk1_r, s1, h, qz_c, qk2_r, s2, norm_res = res
    dy, ct_norm = cts
    qd2, db2 = dense_mod.quantize_grad(cfg.second, dy, s2, None)
    dz, dk2, ct2 = dense_mod.backward_quantized(cfg.second, qz_c, qk2_r, s2, qd2)
    has_b1 = cfg.first.bias_dtype is not None
    qd1, db1 = act_backward(
        dz, h, cfg.act, cfg.gated, dense_mod.fused_spec(cfg.first, s1, "grad", h.dtype), has_b1
    )
    qd1 = poison_nonfinite(qd1)
    dx, dk1, ct1 = dense_mod.backward_quantized(cfg.first, qx_c, qk1_r, s1, qd1)
    dx, dgamma, dbeta = dense_norm.input_grad(cfg.norm, norm_res, dx, ct_norm)
    db1 = None if db1 is None else db1.astype(cfg.first.bias_dtype)
    return dx, dk1, db1, dk2, db2, ct1, ct2, dgamma, dbeta


_mlp_2d.defvjp(_mlp_2d_fwd, _mlp_2d_bwd)


def fusable(recipe: Optional[Recipe], activations) -> bool:
    """Whether :func:`mlp` runs fused for this recipe and activation (tensor-scaled or FP8
    block-scaled input and gradient, an activation lowbit's kernel computes)."""
    if not dense_mod.kernel_fused(recipe):
        return False
    try:
        parse_activations(activations)
    except (TypeError, ValueError):
        return False
    return True


def runs_fused(recipe: Optional[Recipe], activations, M: int, K: int, W: int) -> bool:
    """Whether :func:`mlp` of x (M, K) and kernel_1 (K, W) runs fused: :func:`fusable`, and no
    MeshResource shards the GEMMs (sharded, it runs the two GEMMs' own shard plans)."""
    return fusable(recipe, activations) and plan_dense(recipe, M, K, W) is None


def _check_vector(b, n: int, name: str):
    if b is None:
        return None
    b = check_input(b, f"mlp: {name}")
    if tuple(b.shape) != (n,):
        raise ValueError(f"mlp: {name} must have shape ({n},), got {tuple(b.shape)}")
    return b


def mlp(
    x: ArrayLike,
    kernel_1: ArrayLike,
    bias_1: Optional[ArrayLike],
    kernel_2: ArrayLike,
    bias_2: Optional[ArrayLike],
    activations: Union[str, Sequence[str]] = ("gelu",),
    *,
    recipe: Optional[Recipe] = None,
    states: tuple = (None, None),
    out_dtype: Optional[DTypeLike] = None,
    hidden_checkpoint_name: str = "ffn1",
    norm: Optional[dense_norm.NormInput] = None,
    tp_overlap: bool = False,
):
    """``act(x . kernel_1 + bias_1) . kernel_2 + bias_2``, fused where :func:`fusable`.

    Args:
      x: ``(..., K)``. kernel_1: ``(K, W)``; a gated activation's W holds the ``(act, linear)``
        halves. bias_1: ``(W,)`` or None. kernel_2: ``(F, N)`` with F = W (gated: W / 2).
        bias_2: ``(N,)`` or None.
      activations: as :func:`lowbit.activation`.
      recipe: default: the one of the enclosing :func:`lowbit.autocast`.
      states: DelayedScaling: the two GEMMs' states (``lowbit.init_delayed_state``).
      out_dtype: of the hidden activation and the output; default x's dtype.
      hidden_checkpoint_name: ``checkpoint_name`` of the first GEMM's output (TE's ffn1).
      norm: a :class:`lowbit.ops.fused.dense_norm.NormInput`: the first GEMM reads ``layernorm(x,
        ...)``, the norm fused into its input quantization.
      tp_overlap: under ``tpsp_resource``, both GEMMs' sequence collectives overlapped with
        their GEMMs (:func:`lowbit.dense`'s ``tp_overlap``).
    Returns ``(..., N)``; gradients flow to x, both kernels, both biases (and the states, as
    :func:`lowbit.dense`). With ``norm``: ``(out, norm_output)``, norm_output None unless
    ``norm.return_output``.
    """
    act, gated = parse_activations(activations)
    x = check_input(x, "mlp: x")
    k1 = check_input(kernel_1, "mlp: kernel_1")
    k2 = check_input(kernel_2, "mlp: kernel_2")
    if x.ndim < 1 or k1.ndim != 2 or k2.ndim != 2:
        raise ValueError(
            f"mlp: x must be (..., K), kernel_1 (K, W) and kernel_2 (F, N); got shapes "
            f"{tuple(x.shape)}, {tuple(k1.shape)}, {tuple(k2.shape)}"
        )
    K, W = k1.shape
    F = W // 2 if gated else W
    if x.shape[-1] != K or (gated and W % 2) or k2.shape[0] != F:
        raise ValueError(
            f"mlp: x (..., {K}) and kernel_1 ({K}, W) must agree on K, and kernel_2 must be "
            f"({F}, N) for W={W}{' gated' if gated else ''}; got x {tuple(x.shape)}, kernel_1 "
            f"{tuple(k1.shape)}, kernel_2 {tuple(k2.shape)}"
        )
    N = k2.shape[1]
    ncfg, gamma, beta = dense_norm.check_norm_input(norm, x, "mlp")
    b1 = _check_vector(bias_1, W, "bias_1")
    b2 = _check_vector(bias_2, N, "bias_2")
    out_dtype = np.dtype(out_dtype if out_dtype is not None else x.dtype)
    if recipe is None:
        recipe = get_recipe()
    if not isinstance(states, (tuple, list)) or len(states) != 2:
        raise TypeError(f"mlp: states must be a pair (one state per GEMM), got {states!r}")
    lead, M = tuple(x.shape[:-1]), prod(x.shape[:-1])
    if not runs_fused(recipe, activations, M, K, W) or (tp_overlap and collective_dense.sequence_parallel()):
        # Under tensor parallelism kernel_1 is column-parallel and kernel_2 row-parallel (as in
        # TransformerEngine): no gather between the GEMMs.
        kw = dict(recipe=recipe, out_dtype=out_dtype, tp_overlap=tp_overlap)
        y_norm = dense_norm.apply_norm(ncfg, x, gamma, beta)
        h = checkpoint_name(dense_mod.dense(y_norm, k1, b1, state=states[0], **kw), hidden_checkpoint_name)
        out = dense_mod.dense(activation(h, activations), k2, b2, state=states[1], tp_layout="row", **kw)
        return dense_norm.with_norm_output(ncfg, out, y_norm)
    s1 = ds.check_state_arg("mlp", recipe, states[0], "lowbit.init_delayed_state(recipe)")
    s2 = ds.check_state_arg("mlp", recipe, states[1], "lowbit.init_delayed_state(recipe)")

    first = dense_mod.make_config(recipe, out_dtype, x.dtype, k1, b1, True)
    second = dense_mod.make_config(recipe, out_dtype, out_dtype, k2, b2, True)
    cfg = _MlpConfig(first, second, act, gated, hidden_checkpoint_name, ncfg)
    y, y_norm = _mlp_2d(cfg, x.reshape(M, K), k1, b1, k2, b2, s1, s2, gamma, beta)
    y_norm = None if y_norm is None else y_norm.reshape(x.shape)
    return dense_norm.with_norm_output(ncfg, y.reshape(lead + (N,)), y_norm)


__all__ = ["fusable", "mlp", "runs_fused"]
