"""grouped_gemm: ``jax.lax.ragged_dot`` on lowbit's grouped GEMM (BF16, or FP8 with per-group scales).

``lhs`` (M, K) holds G groups of consecutive rows (``group_sizes`` int32 (G,), on the device);
``rhs`` (G, K, N) holds one matrix per group; rows of group g of the output are
``lhs[rows_g] @ rhs[g]``. Rows after the last group are zero. The group offsets are computed on
the device inside the kernels: no host copy, no sync, no ``jax_enable_x64``.

Custom VJP: dlhs is the same grouped GEMM with rhs transposed; drhs (G, K, N) is the
ragged-contraction GEMM ``lhs_g^T @ dout_g`` (zero for empty groups).

FP8 (Float8CurrentScaling / DelayedScaling): each group of lhs, each expert of rhs and each group
of dout is quantized as its own tensor by :func:`lowbit.grouped_quantize` (both layouts, in one
pass), and the product of the two groups' decode scales is applied per group in the GEMM's
epilogue. Hopper's FP8 tensor cores read K-major operands, so the forward reads rhs's colwise
copy, dgrad rhs's rowwise copy and wgrad the colwise copies of lhs and dout.

Float8BlockScaling: lhs and dout take 1x128 block scales along the contraction (the colwise
copies for the weight gradient: 1x128 along each group's tokens, restarting at every group),
rhs 128x128 tiles (or 1x128 with ``w_block_scaling_dim=1``); on the GPU, CUTLASS's sm90 grouped
blockwise-scaled kernel applies them per 128-deep k-block (see _BlockConfig below).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from lowbit import delayed_scaling as ds
from lowbit.ops._ffi import grouped_gemm as ffi
from lowbit.ops.accumulation import config_fields
from lowbit.ops.gemm import pad_to
from lowbit.ops.nonfinite import poison_nonfinite
from lowbit.ops.quantize import group_sizes_int32, grouped_quantize, host_group_sizes, quantize
from lowbit.quantization.checks import as_array, as_dtype
from lowbit.quantization.scaling_modes import ScalingMode
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe

_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(jnp.float32)
_IN_DTYPES = (_BF16, _F32)


# BF16: lhs (M, K), rhs (G, K, N), dout (M, N), all row-major.
def _bf16_fwd(lhs, rhs, gs):
    (M, K), (_G, _, N) = lhs.shape, rhs.shape
    return ffi.grouped_gemm(
        ffi.RAGGED_M,
        lhs,
        rhs,
        gs,
        None,
        None,
        m=M,
        n=N,
        k=K,
        lda=K,
        ldb=N,
        bgs=K * N,
        a_kmajor=True,
        b_kmajor=False,
    )


def _bf16_dlhs(dout, rhs, gs):
    # The same K-major layout as the FP8 dgrad, rhs viewed as (G*K, N), no scales.
    return ragged_dgrad(dout, None, rhs.reshape(-1, rhs.shape[-1]), None, gs)


def _bf16_drhs(lhs, dout, gs):
    # lhs_g^T . dout_g, contraction over the group's rows: A(i, c) = lhs[c, i] (M-major).
    (M, K), (_, N) = lhs.shape, dout.shape
    return ffi.grouped_gemm(
        ffi.RAGGED_K,
        lhs,
        dout,
        gs,
        None,
        None,
        m=K,
        n=N,
        k=M,
        lda=K,
        ldb=N,
        a_kmajor=False,
        b_kmajor=False,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_bf16(lhs, rhs, gs, out_dtype):
    return _bf16_fwd(lhs, rhs, gs).astype(out_dtype)


def _grouped_bf16_fwd(lhs, rhs, gs, out_dtype):
    return _bf16_fwd(lhs, rhs, gs).astype(out_dtype), (lhs, rhs, gs)


def _grouped_bf16_bwd(out_dtype, res, dout):
    lhs, rhs, gs = res
    dout = dout.astype(jnp.bfloat16)
    return _bf16_dlhs(dout, rhs, gs), _bf16_drhs(lhs, dout, gs), None


_grouped_bf16.defvjp(_grouped_bf16_fwd, _grouped_bf16_bwd)


# ---------------------------------------------------------------------------------------------
# FP8: per-group tensor scaling
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Fp8Config:
    recipe: Recipe
    out_dtype: Any
    lhs_dtype: Any
    rhs_dtype: Any
    fast_accum: bool
    # The gradients' GEMMs (ops/accumulation.py: TE's switches, fast unless they say split).
    fast_accum_dgrad: bool = True
    fast_accum_wgrad: bool = True

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)


def _quantize(cfg, role, x, gs, state, layout):
    # A group with a non-finite amax gets NaN decode scales: its output rows are NaN, not saturated.
    return poison_nonfinite(
        grouped_quantize(
            x,
            gs,
            cfg.recipe.scaling_mode(role),
            cfg.recipe.q_dtype(role),
            scale=ds.scale_of(state, role),
            layout=layout,
        )
    )


def _expert_sizes(rhs):
    G, K, _ = rhs.shape
    return jnp.full((G,), K, jnp.int32)


# GEMMs over quantized operands (both K-major, as Hopper's FP8 tensor cores need); the op and
# the benchmark's "gemm only" rows share them, and the BF16 dgrad has the same layout.
def fp8_fprop(x, x_s, w_col, w_col_s, gs, fast_accum: bool = True):
    """y (M, N) = x (M, K) . rhs[g]; w_col is the (N, G*K) colwise copy of rhs viewed as (G*K, N):
    B(c, j) = w_col[j, g*K + c], row stride G*K, group stride K."""
    (M, K), (N, GK) = x.shape, w_col.shape
    return ffi.grouped_gemm(
        ffi.RAGGED_M,
        x,
        w_col,
        gs,
        x_s,
        w_col_s,
        m=M,
        n=N,
        k=K,
        lda=K,
        ldb=GK,
        bgs=K,
        a_kmajor=True,
        b_kmajor=True,
        fast_accum=fast_accum,
    )


def ragged_dgrad(g, g_s, w_row, w_row_s, gs, fast_accum: bool = False):
    """dlhs (M, K) = g (M, N) . rhs[g]^T, FP8 or BF16 (empty scales); w_row is rhs viewed as
    (G*K, N) (FP8: its rowwise copy): B(c, j) = w_row[g*K + j, c], K-major with row stride N."""
    (M, N), K = g.shape, w_row.shape[0] // gs.shape[0]
    return ffi.grouped_gemm(
        ffi.RAGGED_M,
        g,
        w_row,
        gs,
        g_s,
        w_row_s,
        m=M,
        n=K,
        k=N,
        lda=N,
        ldb=N,
        bgs=K * N,
        a_kmajor=True,
        b_kmajor=True,
        fast_accum=fast_accum,
    )


def fp8_wgrad(x_col, x_col_s, g_col, g_col_s, gs, fast_accum: bool = False):
    """drhs (G, K, N) = x_g^T . g_g, contracted over each group's rows: A(i, c) = x_col[i, c],
    B(c, j) = g_col[j, c], both K-major with row stride M."""
    (K, M), N = x_col.shape, g_col.shape[0]
    return ffi.grouped_gemm(
        ffi.RAGGED_K,
        x_col,
        g_col,
        gs,
        x_col_s,
        g_col_s,
        m=K,
        n=N,
        k=M,
        lda=M,
        ldb=M,
        a_kmajor=True,
        b_kmajor=True,
        fast_accum=fast_accum,
    )


def _fp8_forward(cfg, lhs, rhs, gs, state, both):
    G, K, N = rhs.shape
    qx = _quantize(cfg, "x", lhs, gs, state, "both" if both else "rowwise")
    # Each expert's (K, N) matrix is one group of rows of the (G*K, N) view.
    qw = _quantize(
        cfg, "kernel", rhs.reshape(G * K, N), _expert_sizes(rhs), state, "both" if both else "colwise"
    )
    y = fp8_fprop(qx.data, qx.scale_inv, qw.colwise_data, qw.colwise_scale_inv, gs, cfg.fast_accum)
    return y.astype(cfg.out_dtype), qx, qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_fp8(cfg, lhs, rhs, gs, state):
    return _fp8_forward(cfg, lhs, rhs, gs, state, both=False)[0]


def _grouped_fp8_fwd(cfg, lhs, rhs, gs, state):
    y, qx, qw = _fp8_forward(cfg, lhs, rhs, gs, state, both=True)
    # The backward reads lhs's colwise copy (wgrad) and rhs's rowwise copy (dgrad) only.
    res = (qx.colwise_data, qx.colwise_scale_inv, qw.data, qw.scale_inv, gs, state, (qx.amax, qw.amax))
    return y, res


def _grouped_fp8_bwd(cfg, res, dout):
    x_col, x_col_s, w_row, w_row_s, gs, state, (ax, aw) = res
    qg = _quantize(cfg, "grad", dout, gs, state, "both")
    dlhs = ragged_dgrad(qg.data, qg.scale_inv, w_row, w_row_s, gs, cfg.fast_accum_dgrad)
    drhs = fp8_wgrad(x_col, x_col_s, qg.colwise_data, qg.colwise_scale_inv, gs, cfg.fast_accum_wgrad)
    state_ct = None
    if cfg.delayed:
        state_ct = ds.advance_step(cfg.recipe, state, {"x": ax, "kernel": aw, "grad": qg.amax}, grouped=True)
    return dlhs.astype(cfg.lhs_dtype), drhs.astype(cfg.rhs_dtype), None, state_ct


_grouped_fp8.defvjp(_grouped_fp8_fwd, _grouped_fp8_bwd)


# ---------------------------------------------------------------------------------------------
# FP8 block scaling (Float8BlockScaling): 1x128 activations / gradients, 128x128 (or 1x128) weights
# ---------------------------------------------------------------------------------------------
# The GEMM reads every block scale in the per-group, M-major layout of CUTLASS's grouped
# blockwise kernel (csrc/include/lowbit/grouped_gemm.h): grouped_quantize(BLOCK_1D) writes the
# activations' and gradients' scales so; the weights are quantized as one (G*K, N) tensor (K a
# multiple of 128, so no block straddles two experts) and their small scale arrays are
# rearranged here (G*K*N/16384 floats for 128x128 tiles).
@dataclasses.dataclass(frozen=True)
class _BlockConfig:
    recipe: Recipe
    out_dtype: Any
    lhs_dtype: Any
    rhs_dtype: Any

    @property
    def w_2d(self) -> bool:
        return self.recipe.scaling_mode("kernel") == ScalingMode.BLOCK_2D_SCALING


def _qp(cfg, role):
    q = cfg.recipe.qparams(role)
    return dict(power_2_scale=bool(q.power_2_scale), amax_epsilon=float(q.amax_epsilon))


def _block_act(cfg, role, x, gs, layout):
    return poison_nonfinite(
        grouped_quantize(
            x, gs, ScalingMode.BLOCK_1D_SCALING, cfg.recipe.q_dtype(role), layout=layout, **_qp(cfg, role)
        )
    )


def _block_weight(cfg, rhs, layout):
    G, K, N = rhs.shape
    return poison_nonfinite(
        quantize(
            rhs.reshape(G * K, N),
            cfg.recipe.scaling_mode("kernel"),
            cfg.recipe.q_dtype("kernel"),
            layout=layout,
            **_qp(cfg, "kernel"),
        )
    )


def _w_scales_fprop(w_2d, cs, G, K, N):
    """B = rhs[g] (k=K, n=N): (G, K/128, ceil(N/bn)) from the colwise copy's scales."""
    nkb = K // 128
    if w_2d:  # cs (ceil(N/128), round_up(G*K/128, 4)): entry [nb, g*nkb + kb]
        return cs[:, : G * nkb].T.reshape(-1)
    return cs[:, :N].reshape(-1)  # cs (G*K/128, round_up(N, 4)): entry [g*nkb + kb, n]


def _w_scales_dgrad(w_2d, rs, G, K, N):
    """B = rhs[g]^T (k=N, n=K): (G, ceil(N/128), ceil(K/bn)) from the rowwise copy's scales."""
    nbn = -(-N // 128)
    if w_2d:  # rs (G*K/128, round_up(nbn, 4)): entry [g*nkb + kb, nb]
        return rs[:, :nbn].reshape(G, K // 128, nbn).transpose(0, 2, 1).reshape(-1)
    return rs[:, : G * K].reshape(nbn, G, K).transpose(1, 0, 2).reshape(-1)  # [nb, g*K + k]


def block_fprop(x, x_s, w_col, w_s, gs, b_block_n):
    """y (M, N) = x . rhs[g], block scales (see _w_scales_fprop); w_col as fp8_fprop's."""
    (M, K), (N, GK) = x.shape, w_col.shape
    return ffi.grouped_gemm(
        ffi.RAGGED_M, x, w_col, gs, x_s, w_s, m=M, n=N, k=K, lda=K, ldb=GK, bgs=K,
        a_kmajor=True, b_kmajor=True, b_block_n=b_block_n,
    )  # fmt: skip


def block_dgrad(g, g_s, w_row, w_s, gs, b_block_n):
    """dlhs (M, K) = g . rhs[g]^T, block scales (see _w_scales_dgrad)."""
    (M, N), K = g.shape, w_row.shape[0] // gs.shape[0]
    return ffi.grouped_gemm(
        ffi.RAGGED_M, g, w_row, gs, g_s, w_s, m=M, n=K, k=N, lda=N, ldb=N, bgs=K * N,
        a_kmajor=True, b_kmajor=True, b_block_n=b_block_n,
    )  # fmt: skip


def block_wgrad(x_col, x_col_s, g_col, g_col_s, gs):
    """drhs (G, K, N) = x_g^T . g_g: both colwise copies with 1x128 blocks along each group's
    tokens (grouped_quantize's grouped colwise layout)."""
    (K, M), N = x_col.shape, g_col.shape[0]
    return ffi.grouped_gemm(
        ffi.RAGGED_K, x_col, g_col, gs, x_col_s.reshape(-1), g_col_s.reshape(-1), m=K, n=N, k=M,
        lda=M, ldb=M, a_kmajor=True, b_kmajor=True, b_block_n=1,
    )  # fmt: skip


def _block_forward(cfg, lhs, rhs, gs, both):
    G, K, N = rhs.shape
    qx = _block_act(cfg, "x", lhs, gs, "both" if both else "rowwise")
    qw = _block_weight(cfg, rhs, "both" if both else "colwise")
    bn = 128 if cfg.w_2d else 1
    w_s = _w_scales_fprop(cfg.w_2d, qw.colwise_scale_inv, G, K, N)
    y = block_fprop(qx.data, qx.scale_inv, qw.colwise_data, w_s, gs, bn)
    return y.astype(cfg.out_dtype), qx, qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_block(cfg, lhs, rhs, gs):
    return _block_forward(cfg, lhs, rhs, gs, both=False)[0]


def _grouped_block_fwd(cfg, lhs, rhs, gs):
    y, qx, qw = _block_forward(cfg, lhs, rhs, gs, both=True)
    G, K, N = rhs.shape
    w_s = _w_scales_dgrad(cfg.w_2d, qw.scale_inv, G, K, N)
    return y, (qx.colwise_data, qx.colwise_scale_inv, qw.data, w_s, gs)


def _grouped_block_bwd(cfg, res, dout):
    x_col, x_col_s, w_row, w_s, gs = res
    qg = _block_act(cfg, "grad", dout, gs, "both")
    dlhs = block_dgrad(qg.data, qg.scale_inv, w_row, w_s, gs, 128 if cfg.w_2d else 1)
    drhs = block_wgrad(x_col, x_col_s, qg.colwise_data, qg.colwise_scale_inv, gs)
    return dlhs.astype(cfg.lhs_dtype), drhs.astype(cfg.rhs_dtype), None


_grouped_block.defvjp(_grouped_block_fwd, _grouped_block_bwd)


def _grouped_block_entry(lhs, rhs, gs, recipe, out_dtype, state):
    if state is not None:
        raise ValueError("grouped_gemm: state is only used with DelayedScaling; pass state=None")
    for role, dim in (("x", recipe.x_block_scaling_dim), ("grad", recipe.grad_block_scaling_dim)):
        if dim != 1:
            raise ValueError(
                f"grouped_gemm: Float8BlockScaling({role}_block_scaling_dim={dim}) is not supported "
                "by the grouped GEMM: activations and gradients take 1x128 blocks "
                "(their 128-row tiles would straddle groups)"
            )
    (M, N) = lhs.shape[0], rhs.shape[2]
    cfg = _BlockConfig(
        recipe=recipe, out_dtype=out_dtype, lhs_dtype=np.dtype(lhs.dtype), rhs_dtype=np.dtype(rhs.dtype)
    )
    # K (every GEMM's k or n) in multiples of 128: no weight block straddles two experts and the
    # kernels see whole blocks; M and N in multiples of 16 (TMA rows of the FP8 copies). Zero
    # padding is exact; padded rows of lhs are in no group.
    x = pad_to(pad_to(lhs, 0, 16), 1, 128)
    w = pad_to(pad_to(rhs, 1, 128), 2, 16)
    y = _grouped_block(cfg, x, w, gs)
    return y[:M, :N] if y.shape != (M, N) else y


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------
def grouped_gemm(
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    recipe: Optional[Recipe] = None,
    preferred_element_type: Optional[DTypeLike] = None,
    state: Optional[dict] = None,
    fast_accum: bool = True,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` through lowbit's grouped GEMM.

    Args:
      lhs: (M, K) float32 or bfloat16; groups of consecutive rows.
      rhs: (G, K, N) float32 or bfloat16; one matrix per group.
      group_sizes: (G,) integer (int32 on the device); a sum below M leaves the trailing rows in
        no group (zero output); a sum above M is clamped (groups end at row M). A wider dtype
        (uint32, int64) is clipped to [0, M] before the int32 narrowing: the same groups.
      recipe: None: BF16 operands (float32 inputs are rounded to bfloat16), float32
        accumulation. Float8CurrentScaling or DelayedScaling: FP8 with per-group tensor scales.
        Float8BlockScaling: FP8 with 1x128 block scales for lhs and the gradient (blocks along
        the contraction; the weight gradient's run along each group's rows) and 128x128 (or,
        with ``w_block_scaling_dim=1``, 1x128) block scales for each expert of rhs.
      preferred_element_type: output dtype (float32 or bfloat16), default the inputs' result
        type. The GEMM rounds its output to bfloat16 once; a float32 output is that value.
      state: DelayedScaling only: :func:`init_grouped_delayed_state`-shaped dict; its gradient is
        the updated state (what Flax's ``_overwrite_with_gradient`` collection expects).
      fast_accum: per-tensor FP8 on the GPU: False keeps split accumulation in the forward GEMM;
        True (default) accumulates fast where TransformerEngine's environment does (every GEMM
        unless ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1``; lowbit.ops.accumulation), the
        gradients as that says. Float8BlockScaling's GEMMs always promote each 128-deep block.

    Returns:
      (M, N) in ``preferred_element_type``.
    """
    lhs, rhs = as_array(lhs, "grouped_gemm: lhs"), as_array(rhs, "grouped_gemm: rhs")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(x.dtype) not in _IN_DTYPES:
            raise TypeError(f"grouped_gemm: {name} must be bfloat16 or float32, got {np.dtype(x.dtype).name}")
    if lhs.ndim != 2:
        raise ValueError(f"grouped_gemm: lhs must be 2-D (M, K), got shape {tuple(lhs.shape)}")
    if rhs.ndim != 3:
        raise ValueError(f"grouped_gemm: rhs must be 3-D (G, K, N), got shape {tuple(rhs.shape)}")
    (M, K), (G, K2, N) = lhs.shape, rhs.shape
    if K != K2:
        raise ValueError(
            f"grouped_gemm: contraction sizes differ: lhs {tuple(lhs.shape)} has K={K}, "
            f"rhs {tuple(rhs.shape)} has K={K2}"
        )
    group_sizes = as_array(host_group_sizes(group_sizes, M), "grouped_gemm: group_sizes")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"grouped_gemm: group_sizes must be an integer array, got {np.dtype(group_sizes.dtype).name}"
        )
    if group_sizes.shape != (G,):
        raise ValueError(
            f"grouped_gemm: group_sizes must have shape (G,) = ({G},) to match rhs "
            f"{tuple(rhs.shape)}, got {tuple(group_sizes.shape)}"
        )
    if G < 1:
        raise ValueError(
            f"grouped_gemm: rhs and group_sizes must hold at least one group (G >= 1), "
            f"got rhs {tuple(rhs.shape)}"
        )
    gs = group_sizes_int32(group_sizes, M)
    out_dtype = as_dtype(
        preferred_element_type if preferred_element_type is not None else jnp.result_type(lhs, rhs),
        "grouped_gemm: preferred_element_type",
    )
    if out_dtype not in _IN_DTYPES:
        raise TypeError(
            f"grouped_gemm: preferred_element_type must be float32 or bfloat16, got {out_dtype.name}"
        )

    if recipe is None:
        if state is not None:
            raise ValueError(
                "grouped_gemm: state is only used with DelayedScaling; with recipe=None (BF16) "
                "pass state=None"
            )
        # 16-byte rows for the GPU's TMA: K and N in multiples of 8 (zero padding is exact).
        x, w = pad_to(lhs.astype(jnp.bfloat16), 1, 8), rhs.astype(jnp.bfloat16)
        w = pad_to(pad_to(w, 1, 8), 2, 8)
        y = _grouped_bf16(x, w, gs, out_dtype)
        return y[:, :N] if y.shape[1] != N else y

    if isinstance(recipe, Float8BlockScaling):
        return _grouped_block_entry(lhs, rhs, gs, recipe, out_dtype, state)
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(
            f"grouped_gemm: recipe must be None (BF16), Float8CurrentScaling, DelayedScaling "
            f"(per-group tensor scales) or Float8BlockScaling (1x128 / 128x128 block scales); "
            f"{type(recipe).__name__} is not supported by the grouped GEMM"
        )
    # All-E5M2 recipes cannot be built (lowbit.recipe refuses fp8_format=Format.E5M2).
    state = ds.check_state_arg(
        "grouped_gemm", recipe, state, "lowbit.init_grouped_delayed_state(recipe, G)", num_groups=G
    )
    cfg = _Fp8Config(
        recipe=recipe,
        out_dtype=out_dtype,
        lhs_dtype=np.dtype(lhs.dtype),
        rhs_dtype=np.dtype(rhs.dtype),
        **config_fields(fast_accum),
    )
    # 16-byte rows of FP8 (K, N) and of the colwise (K, M) copies (M): zero padding; padded
    # rows of lhs belong to no group, padded K/N columns are zero.
    x = pad_to(pad_to(lhs, 0, 16), 1, 16)
    w = pad_to(pad_to(rhs, 1, 16), 2, 16)
    y = _grouped_fp8(cfg, x, w, gs, state)
    return y[:M, :N] if y.shape != (M, N) else y
