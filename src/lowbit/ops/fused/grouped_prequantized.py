"""The grouped GEMM with expert weights quantized once per step, not once per call.

:func:`quantize_experts` makes both FP8 copies of every expert (rowwise for dgrad, colwise for
the forward) in one pass; :func:`grouped_gemm_prequantized` then runs the forward and the
backward of :func:`lowbit.grouped_gemm` on those copies and returns the weight gradient to the
float master ``w`` (which the forward never reads).

Inside one jitted step the plain grouped GEMM already casts each weight once: its forward
writes both copies in one pass, the backward reuses the rowwise one, XLA merges identical casts
of one weight, and JAX's scan partial evaluation hoists a loop-invariant cast out of a
micro-batch loop. What remains is the cast itself, once per step: at 128 experts of 128 tokens
the weights are 8x the tokens and the cast costs about as much as the three FP8 GEMMs. This
module moves it out of the step: FP8 primary weights, where the optimizer update that writes
``w`` also writes ``quantize_experts(w)`` (in its jit, next to the update's own pass over the
weights), and the step reads the copies.

Same numerics as :func:`lowbit.grouped_gemm` for the same quantized weights: current scaling
(per-expert tensor scales), DelayedScaling (the weights' scales from ``state``; the amaxes the
copies saw go into the state update) and Float8BlockScaling (128x128 or 1x128 weight blocks).

``qlhs`` (per-tensor recipes): lhs already quantized, e.g. by the fused FP8 dispatch
(:func:`lowbit.moe.permute_quantize`, which writes the permuted tokens' rowwise and colwise FP8
copies in the gather's pass): the forward reads it and never quantizes lhs; lhs itself only
carries the gradient (dlhs), so XLA drops its computation from the forward when nothing else
reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import delayed_scaling as ds
from lowbit.ops import grouped_gemm as gg
from lowbit.ops.accumulation import config_fields
from lowbit.ops.gemm import pad_to
from lowbit.quantization.tensor import ScaledTensor
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """Both FP8 copies of (G, K, N) expert weights (K, N padded as the GEMMs need): ``row``
    (G*K, N) and its scales as dgrad reads them, ``col`` (N, G*K) and its scales as the forward
    reads them; ``amax`` (G,) per expert (DelayedScaling's state update; zeros for block
    scaling, which needs none)."""

    row: jax.Array
    row_s: jax.Array
    col: jax.Array
    col_s: jax.Array
    amax: jax.Array
    kn: tuple = dataclasses.field(metadata=dict(static=True))  # the unpadded (K, N)

    def spec(self, axis):
        """PartitionSpecs that split the experts over mesh axis ``axis`` (every array is
        expert-major; the colwise copy along its columns)."""
        from jax.sharding import PartitionSpec as P

        return QuantizedExperts(P(axis), P(axis), P(None, axis), P(axis), P(axis), self.kn)


def _block(recipe) -> bool:
    return isinstance(recipe, Float8BlockScaling)


def _check_recipe(recipe):
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
        raise ValueError(
            f"quantize_experts: recipe must be Float8CurrentScaling, DelayedScaling or "
            f"Float8BlockScaling, got {type(recipe).__name__}"
        )


def quantize_experts(w: jax.Array, recipe: Recipe, state: Optional[dict] = None) -> QuantizedExperts:
    """Both FP8 copies of ``w`` (G, K, N) for ``recipe`` (DelayedScaling: with ``state``'s
    kernel scales, ``lowbit.init_grouped_delayed_state(recipe, G)``-shaped)."""
    _check_recipe(recipe)
    if jnp.ndim(w) != 3:
        raise ValueError(f"quantize_experts: w must be (G, K, N), got shape {tuple(jnp.shape(w))}")
    # The gradients reach w (and the new state reaches state) through grouped_gemm_prequantized.
    w, state = jax.lax.stop_gradient((w, state))
    G, K, N = w.shape
    if _block(recipe):
        cfg = gg._BlockConfig(recipe=recipe, out_dtype=None, lhs_dtype=None, rhs_dtype=None)
        wp = pad_to(pad_to(w, 1, 128), 2, 16)
        qw = gg._block_weight(cfg, wp, "both")
        Kp, Np = wp.shape[1:]
        row_s = gg._w_scales_dgrad(cfg.w_2d, qw.scale_inv, G, Kp, Np)
        col_s = gg._w_scales_fprop(cfg.w_2d, qw.colwise_scale_inv, G, Kp, Np)
        return QuantizedExperts(qw.data, row_s, qw.colwise_data, col_s, jnp.zeros((G,), jnp.float32), (K, N))
    if isinstance(recipe, DelayedScaling):
        state = ds.check_state_arg(
            "quantize_experts", recipe, state, "lowbit.init_grouped_delayed_state(recipe, G)", G
        )
    cfg = gg._Fp8Config(recipe=recipe, out_dtype=None, lhs_dtype=None, rhs_dtype=None, fast_accum=True)
    wp = pad_to(pad_to(w, 1, 16), 2, 16)
    qw = gg._quantize(cfg, "kernel", wp.reshape(-1, wp.shape[2]), gg._expert_sizes(wp), state, "both")
    return QuantizedExperts(qw.data, qw.scale_inv, qw.colwise_data, qw.colwise_scale_inv, qw.amax, (K, N))


@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: Recipe
    out_dtype: Any
    lhs_dtype: Any
    w_dtype: Any
    w_shape: tuple  # unpadded (G, K, N)
    fast_accum: bool
    fast_accum_dgrad: bool = True  # as grouped_gemm's _Fp8Config
    fast_accum_wgrad: bool = True


def _act(cfg, role, x, gs, state, layout):
    if _block(cfg.recipe):
        return gg._block_act(cfg, role, x, gs, layout)
    return gg._quantize(cfg, role, x, gs, state, layout)


def _forward(cfg, x, qw, gs, state, layout, qx=None):
    if qx is None:
        qx = _act(cfg, "x", x, gs, state, layout)
    if _block(cfg.recipe):
        bn = 128 if cfg.recipe.scaling_mode("kernel").name == "BLOCK_2D_SCALING" else 1
        y = gg.block_fprop(qx.data, qx.scale_inv, qw.col, qw.col_s, gs, bn)
    else:
        y = gg.fp8_fprop(qx.data, qx.scale_inv, qw.col, qw.col_s, gs, cfg.fast_accum)
    return y.astype(cfg.out_dtype), qx


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gemm(cfg, x, w, qw, gs, state, qx):
    return _forward(cfg, x, qw, gs, state, "rowwise", qx)[0]


def _gemm_fwd(cfg, x, w, qw, gs, state, qx):
    y, qx = _forward(cfg, x, qw, gs, state, "both", qx)
    return y, (qx.colwise_data, qx.colwise_scale_inv, qx.amax, qw, gs, state)


def _gemm_bwd(cfg, res, dout):
    x_col, x_col_s, ax, qw, gs, state = res
    qg = _act(cfg, "grad", dout, gs, state, "both")
    if _block(cfg.recipe):
        bn = 128 if cfg.recipe.scaling_mode("kernel").name == "BLOCK_2D_SCALING" else 1
        dx = gg.block_dgrad(qg.data, qg.scale_inv, qw.row, qw.row_s, gs, bn)
        dw = gg.block_wgrad(x_col, x_col_s, qg.colwise_data, qg.colwise_scale_inv, gs)
    else:
        dx = gg.ragged_dgrad(qg.data, qg.scale_inv, qw.row, qw.row_s, gs, cfg.fast_accum_dgrad)
        dw = gg.fp8_wgrad(x_col, x_col_s, qg.colwise_data, qg.colwise_scale_inv, gs, cfg.fast_accum_wgrad)
    G, K, N = cfg.w_shape
    state_ct = None
    if isinstance(cfg.recipe, DelayedScaling):
        amaxes = {"x": ax, "kernel": qw.amax, "grad": qg.amax}
        state_ct = ds.advance_step(cfg.recipe, state, amaxes, grouped=True)
    qw_ct = jax.tree_util.tree_map(jnp.zeros_like, qw)
    # qx (when given) is made without a gradient (stop_gradient): its cotangent is dropped.
    return dx.astype(cfg.lhs_dtype), dw[:, :K, :N].astype(cfg.w_dtype), qw_ct, None, state_ct, None


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def grouped_gemm_prequantized(
    lhs: jax.Array,
    w: jax.Array,
    qw: QuantizedExperts,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    preferred_element_type=None,
    state: Optional[dict] = None,
    fast_accum: bool = True,
    qlhs: Optional[ScaledTensor] = None,
) -> jax.Array:
    """``lowbit.grouped_gemm(lhs, w, group_sizes, recipe=recipe)`` reading ``qw`` (=
    ``quantize_experts(w, recipe, state)``, made earlier in the step) instead of quantizing w;
    the gradient goes to ``w``. ``qlhs``: None, or lhs quantized for ``recipe``'s "x" role
    (per-tensor recipes; both layouts, per-group scales: ``grouped_quantize(lhs, group_sizes,
    ..., layout="both")`` or ``permute_quantize``'s equal output; DelayedScaling: with
    ``state``'s x scales), read instead of quantizing lhs (see the module docstring)."""
    _check_recipe(recipe)
    if not isinstance(qw, QuantizedExperts) or (qw.amax.shape[0], *qw.kn) != tuple(w.shape):
        got = (qw.amax.shape[0], *qw.kn) if isinstance(qw, QuantizedExperts) else type(qw).__name__
        raise ValueError(
            f"grouped_gemm_prequantized: qw must be quantize_experts(w) for w {tuple(w.shape)}, got {got}"
        )
    if _block(recipe):
        for role, dim in (("x", recipe.x_block_scaling_dim), ("grad", recipe.grad_block_scaling_dim)):
            if dim != 1:
                raise ValueError(f"grouped_gemm_prequantized: {role}_block_scaling_dim must be 1, got {dim}")
    (M, K), N = lhs.shape, w.shape[2]
    if K != w.shape[1]:
        raise ValueError(
            f"grouped_gemm_prequantized: lhs {tuple(lhs.shape)} and w {tuple(w.shape)} differ in K"
        )
    if isinstance(recipe, DelayedScaling):
        state = ds.check_state_arg(
            "grouped_gemm_prequantized",
            recipe,
            state,
            "lowbit.init_grouped_delayed_state(recipe, G)",
            w.shape[0],
        )
    gs = gg.group_sizes_int32(jnp.asarray(group_sizes), M)
    out = np.dtype(preferred_element_type or jnp.result_type(lhs, w))
    cfg = _Config(
        recipe, out, np.dtype(lhs.dtype), np.dtype(w.dtype), tuple(w.shape), **config_fields(fast_accum)
    )
    kp = qw.row.shape[0] // w.shape[0]  # K padded as the weights'
    x = pad_to(pad_to(lhs, 0, 16), 1, kp)
    if qlhs is not None:
        qlhs = _padded_lhs(_check_qlhs(qlhs, recipe, lhs.shape), x.shape)
    y = _gemm(cfg, x, w, qw, gs, state, qlhs)
    return y[:M, :N]


def _check_qlhs(qlhs, recipe, shape):
    name = "grouped_gemm_prequantized: qlhs"
    if _block(recipe):
        raise ValueError(f"{name} is only supported with per-tensor recipes, not Float8BlockScaling")
    if not isinstance(qlhs, ScaledTensor) or qlhs.data is None or qlhs.colwise_data is None:
        raise ValueError(f"{name} must be a ScaledTensor with both layouts (layout='both')")
    mode, q = recipe.scaling_mode("x"), np.dtype(recipe.q_dtype("x"))
    if qlhs.scaling_mode != mode or np.dtype(qlhs.q_dtype) != q:
        raise ValueError(
            f"{name} must be quantized as the recipe's x ({mode.name}, {q.name}), "
            f"got {qlhs.scaling_mode.name}, {np.dtype(qlhs.q_dtype).name}"
        )
    M, K = shape
    if qlhs.data.shape[0] != M or qlhs.data.shape[1] < K or qlhs.colwise_data.shape != qlhs.data.shape[::-1]:
        raise ValueError(
            f"{name} must hold lhs's (M, K) = {tuple(shape)} rows (K may be zero-padded), got data "
            f"{tuple(qlhs.data.shape)} and colwise {tuple(qlhs.colwise_data.shape)}"
        )
    return qlhs


def _padded_lhs(q, shape):
    """q's copies zero-padded as lhs is (M to a multiple of 16, K to the weights' padding): the
    padded rows are in no group, the padded columns zero (as the quantized zeros would be)."""
    (M, K), (Mp, Kp) = q.data.shape, shape
    if (M, K) == (Mp, Kp):
        return q
    if K > Kp:
        raise ValueError(f"grouped_gemm_prequantized: qlhs has K={K}, more than the weights' {Kp}")
    data = jnp.pad(q.data, ((0, Mp - M), (0, Kp - K)))
    col = jnp.pad(q.colwise_data, ((0, Kp - K), (0, Mp - M)))
    return dataclasses.replace(q, data=data, colwise_data=col, shape=(Mp, Kp))


__all__ = ["QuantizedExperts", "grouped_gemm_prequantized", "quantize_experts"]
