"""split_dense: ``x . kernel (+ bias)`` for a kernel (K, n, F), returned as the n slots (..., F).

The fused QKV projection's path: its three outputs feed attention as q, k and v, and their
gradients come back as three arrays. Under tensor scaling the forward GEMM writes the n slots as
n arrays (``gemm(parts=n)``: no slicing copies) and the backward quantizes the gradients where
they lie (``quantize_parts``) instead of concatenating them first (a (M, 3F) copy per step); the
results equal ``dense`` followed by slicing (bit for bit on the CPU; on the GPU cuBLASLt may pick
another algorithm for the narrower GEMMs, so the outputs agree to rounding). Other recipes and
sharded GEMMs take that composition. A LayerNorm in front (``norm=``) runs inside the same VJP
(``lowbit.ops.fused.dense_norm``): its kernel writes the GEMM's FP8 input.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from lowbit import delayed_scaling as ds
from lowbit.autocast import get_recipe
from lowbit.ops import dense as dense_mod
from lowbit.ops.fused import dense_norm
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.quantize import parts_fusable
from lowbit.quantization.checks import check_input
from lowbit.quantization.tensor import prod
from lowbit.recipe import Recipe
from lowbit.sharding import check_tp_layout, plan_dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _split_2d(cfg, n: int, ncfg, x, k, b, state, gamma, beta):
    ys, y_norm, _ = _forward(cfg, n, ncfg, x, k, b, state, gamma, beta)
    return ys, y_norm


def _forward(cfg, n, ncfg, x, k, b, state, gamma, beta):
    qx, y_norm, norm_res = dense_norm.quantize_input(cfg, ncfg, x, gamma, beta, state)
    ys, qk = dense_mod.forward_quantized(cfg, qx, k, b, state, parts=n)  # the n slots, in place
    return ys, y_norm, (*dense_mod.backward_residuals(qx, qk, cfg.checkpoint_name), state, norm_res)


def _split_2d_fwd(cfg, n, ncfg, x, k, b, state, gamma, beta):
    ys, y_norm, res = _forward(cfg, n, ncfg, x, k, b, state, gamma, beta)
    return (ys, y_norm), res


def _split_2d_bwd(cfg, n, ncfg, res, cts):
    qx_c, qk_r, state, norm_res = res
    cts, ct_norm = cts
    qdy, db = dense_mod.quantize_grad(cfg, tuple(cts), state, None)  # the n parts, not concatenated
    dx, dk, state_ct = dense_mod.backward_quantized(cfg, qx_c, qk_r, state, qdy)
    dx, dgamma, dbeta = dense_norm.input_grad(ncfg, norm_res, dx, ct_norm)
    return dx, dk, db, state_ct, dgamma, dbeta


_split_2d.defvjp(_split_2d_fwd, _split_2d_bwd)


def split_dense(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: Optional[ArrayLike] = None,
    *,
    recipe: Optional[Recipe] = None,
    state: Optional[dict] = None,
    rng: Optional[jax.Array] = None,
    out_dtype: Optional[DTypeLike] = None,
    norm: Optional[NormInput] = None,
    tp_layout: Optional[str] = None,
) -> tuple:
    """``x (..., K) . kernel (K, n, F) (+ bias (n, F))`` as a tuple of n arrays (..., F): slot
    i is ``dense(x, kernel, bias)[..., i, :]``. Arguments as :func:`lowbit.dense` (``rng``:
    NVFP4's stochastic rounding of the gradient).

    ``norm`` (a :class:`lowbit.ops.fused.dense_norm.NormInput`): the GEMM reads ``layernorm(x, ...)``
    instead of x, the norm fused into the GEMM's input quantization; the result is then
    ``(slots, norm_output)``, norm_output None unless ``norm.return_output``."""
    x = check_input(x, "split_dense: x")
    kernel = check_input(kernel, "split_dense: kernel")
    check_tp_layout(tp_layout, "split_dense")
    if kernel.ndim != 3 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"split_dense: x must be (..., K) and kernel (K, n, F); got x {tuple(x.shape)}, "
            f"kernel {tuple(kernel.shape)}"
        )
    K, n, F = kernel.shape
    if bias is not None:
        bias = check_input(bias, "split_dense: bias")
        if tuple(bias.shape) not in ((n, F), (n * F,)):
            raise ValueError(f"split_dense: bias must have shape ({n}, {F}), got {tuple(bias.shape)}")
    ncfg, gamma, beta = dense_norm.check_norm_input(norm, x, "split_dense")
    if recipe is None:
        recipe = get_recipe()
    lead = tuple(x.shape[:-1])
    M = prod(lead)
    probe = [jax.ShapeDtypeStruct((M, F), out_dtype or x.dtype)] * n
    fused = (
        dense_mod.kernel_fused(recipe)
        and plan_dense(recipe, M, K, n * F, tp_layout) is None
        and (not dense_mod.tensor_scaled(recipe) or parts_fusable(probe, recipe.scaling_mode("grad")))
    )
    if not fused:
        y_norm = dense_norm.apply_norm(ncfg, x, gamma, beta)
        kw = dict(recipe=recipe, state=state, rng=rng, out_dtype=out_dtype, tp_layout=tp_layout)
        t = _column_shards(plan_dense(recipe, M, K, n * F, tp_layout))
        if t > 1 and F % t == 0:
            return dense_norm.with_norm_output(ncfg, _per_slot_columns(y_norm, kernel, bias, t, kw), y_norm)
        y = dense_mod.dense(y_norm, kernel, bias, **kw)
        return dense_norm.with_norm_output(ncfg, tuple(y[..., i, :] for i in range(n)), y_norm)
    state = ds.check_state_arg("split_dense", recipe, state, "lowbit.init_delayed_state(recipe)")
    out_dtype = out_dtype if out_dtype is not None else x.dtype
    k2 = kernel.reshape(K, n * F)
    b2 = None if bias is None else bias.reshape(n * F)
    cfg = dense_mod.make_config(recipe, out_dtype, x.dtype, k2, b2, True)
    outs, y_norm = _split_2d(cfg, n, ncfg, x.reshape(M, K), k2, b2, state, gamma, beta)
    slots = tuple(o.reshape(lead + (F,)) for o in outs)
    return dense_norm.with_norm_output(ncfg, slots, None if y_norm is None else y_norm.reshape(x.shape))


def _column_shards(plan) -> int:
    """How many shards a column-parallel plan splits the output features into (1: none)."""
    if plan is None or not plan.n_axes:
        return 1
    return int(np.prod([plan.mesh.shape[a] for a in plan.n_axes]))


def _per_slot_columns(x, kernel, bias, t: int, kw) -> tuple:
    """The column-parallel split dense with each of the ``t`` shards holding its 1/t of every
    slot's F (the layout of a (K, n, F) kernel sharded on F), not 1/t of the flat n*F columns:
    the kernel's columns are ordered (shard, slot, F/t) before the GEMM, so the sharded GEMM's
    output regroups into slots without moving data between devices (the flat order made XLA
    all-gather the kernel and the output)."""
    K, n, F = kernel.shape
    k2 = kernel.reshape(K, n, t, F // t).swapaxes(1, 2).reshape(K, n * F)
    b2 = None if bias is None else bias.reshape(n, t, F // t).swapaxes(0, 1).reshape(n * F)
    y = dense_mod.dense(x, k2, b2, **kw)
    y = y.reshape(y.shape[:-1] + (t, n, F // t))
    return tuple(y[..., i, :].reshape(y.shape[:-3] + (F,)) for i in range(n))


__all__ = ["split_dense"]
