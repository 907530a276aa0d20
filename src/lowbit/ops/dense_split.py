"""split_dense: ``x . kernel (+ bias)`` for a kernel (K, n, F), returned as the n slots (..., F).

The fused QKV projection's path: its three outputs feed attention as q, k and v, and their
gradients come back as three arrays. Under tensor scaling the forward GEMM writes the n slots as
n arrays (``gemm(parts=n)``: no slicing copies) and the backward quantizes the gradients where
they lie (``quantize_parts``) instead of concatenating them first (a (M, 3F) copy per step); the
results equal ``dense`` followed by slicing (bit for bit on the CPU; on the GPU cuBLASLt may pick
another algorithm for the narrower GEMMs, so the outputs agree to rounding). Other recipes and
sharded GEMMs take that composition.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax.typing import ArrayLike, DTypeLike

from lowbit import delayed_scaling as ds
from lowbit.autocast import get_recipe
from lowbit.ops import dense as dense_mod
from lowbit.ops.quantize import check_input, parts_fusable
from lowbit.quantization.tensor import prod
from lowbit.recipe import Recipe
from lowbit.sharding import plan_dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split_2d(cfg, n: int, x, k, b, state):
    return _forward(cfg, n, x, k, b, state)[0]


def _forward(cfg, n, x, k, b, state):
    qx = dense_mod.quantize_input(cfg, x, state)
    ys, qk = dense_mod.forward_quantized(cfg, qx, k, b, state, parts=n)  # the n slots, in place
    return ys, (*dense_mod.backward_residuals(qx, qk), state)


def _split_2d_fwd(cfg, n, x, k, b, state):
    return _forward(cfg, n, x, k, b, state)


def _split_2d_bwd(cfg, n, res, cts):
    qx_c, qk_r, state = res
    qdy, db = dense_mod.quantize_grad(cfg, tuple(cts), state, None)  # the n parts, not concatenated
    dx, dk, state_ct = dense_mod.backward_quantized(cfg, qx_c, qk_r, state, qdy)
    return dx, dk, db, state_ct


_split_2d.defvjp(_split_2d_fwd, _split_2d_bwd)


def split_dense(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: Optional[ArrayLike] = None,
    *,
    recipe: Optional[Recipe] = None,
    state: Optional[dict] = None,
    out_dtype: Optional[DTypeLike] = None,
) -> tuple:
    """``x (..., K) . kernel (K, n, F) (+ bias (n, F))`` as a tuple of n arrays (..., F): slot
    i is ``dense(x, kernel, bias)[..., i, :]``. Arguments as :func:`lowbit.dense`."""
    x = check_input(x, "split_dense: x")
    kernel = check_input(kernel, "split_dense: kernel")
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
    if recipe is None:
        recipe = get_recipe()
    lead = tuple(x.shape[:-1])
    M = prod(lead)
    probe = [jax.ShapeDtypeStruct((M, F), out_dtype or x.dtype)] * n
    fused = (
        dense_mod.tensor_scaled(recipe)
        and plan_dense(recipe, M, K, n * F) is None
        and parts_fusable(probe, recipe.scaling_mode("grad"))
    )
    if not fused:
        y = dense_mod.dense(x, kernel, bias, recipe=recipe, state=state, out_dtype=out_dtype)
        return tuple(y[..., i, :] for i in range(n))
    state = ds.check_state_arg("split_dense", recipe, state, "lowbit.init_delayed_state(recipe)")
    out_dtype = out_dtype if out_dtype is not None else x.dtype
    k2 = kernel.reshape(K, n * F)
    b2 = None if bias is None else bias.reshape(n * F)
    cfg = dense_mod.make_config(recipe, out_dtype, x.dtype, k2, b2, True)
    outs = _split_2d(cfg, n, x.reshape(M, K), k2, b2, state)
    return tuple(o.reshape(lead + (F,)) for o in outs)


__all__ = ["split_dense"]
