"""The recipes' ``fp8_mha=True``: the fused QKV projection, FP8 attention and the output
projection in one VJP, the tensors between them handed over in FP8.

Forward: the QKV GEMM writes float32 (no BF16 copy) and q, k, v are quantized once from it with
the attention's own scales (their amaxes from the same float32), the attention kernel takes them
as they are; its FP8 output o (scale: the attention's o scale) is the output projection's
quantized input, rowwise as the kernel wrote it, colwise its transpose (per-tensor scaling: the
same values), so o is rounded once where fp8_dpa rounds it twice (the attention's o, then the
projection's x). Backward: the output projection's dgrad writes do in float32 and the attention
quantizes it once; dq, dk and dv come out of the kernel in FP8 with one shared scale (the
smallest of their three: none saturates) and are the QKV projection's quantized gradient as they
are (concatenated, and transposed for the weight gradient), where fp8_dpa decodes them to the
input dtype and quantizes them again with the projection's gradient scale. The QKV bias gradient
is the column sum of those FP8 gradients.

k and v are centered over the sequence in float32 before their quantization, as fp8_attention
does (``fp8.py``'s ``_centered``: trained keys and values share a large common component that
the rounded dS turns into dq errors several times dq's norm); v's mean (not under dropout) comes
back as its share of the output projection, ``v_mean . w_out`` per batch (a float32 GEMV added
to the projection's output), o stays centered in FP8. The centering's VJP (dk less its mean over
the sequence; dv less its mean plus the mean of do) is a row per batch added to every row of
the QKV output's gradient: it goes into dx (that row through w_qkv), dw_qkv (``sum_s x`` times
it) and db_qkv as float32 rank-one terms, the FP8 gradient handed over as it is.

The DelayedScaling states stay those of the modules (the two dense states and the attention
state). The roles the handover makes unused take the handed tensor's amax, so their histories
stay meaningful: the output projection's x (= o), the QKV projection's grad (= dq, dk, dv).

GPU: the QKV GEMM writes float32 and XLA quantizes it (lowbit's GEMM has no FP8 output
epilogue; cuBLASLt's D scale + D amax would write q, k, v in FP8 directly); the FP8 kernel
outputs are decoded and re-encoded with the same scale inside one XLA fusion (an exact identity
on the FP8 bytes that feed the concatenation). One device only (a mesh falls back to fp8_dpa).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from lowbit import delayed_scaling as ds
from lowbit.ops import dense as dense_mod
from lowbit.ops import fused_attention as fa
from lowbit.ops.attention import fp8 as att
from lowbit.ops.attention import fp8_scales as fs
from lowbit.ops.fused import dense_norm
from lowbit.quantization.tensor import ScaledTensor

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
_QKV = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class MhaConfig:
    qkv: Any  # dense _Config of the QKV projection (float32 output)
    out: Any  # dense _Config of the output projection (float32 input gradient)
    norm: Any  # dense_norm.NormConfig or None
    att: Any  # fp8 attention _Config
    heads: int
    head_dim: int


def _scaled(data, scale, amax, recipe, role, dq_dtype):
    """A per-tensor ScaledTensor of 2-D FP8 ``data`` (both layouts: the colwise copy is its
    transpose) with encode scale ``scale``."""
    inv = (1.0 / scale).astype(F32).reshape(1)
    return ScaledTensor(
        data=data, scale_inv=inv, colwise_data=data.T, colwise_scale_inv=inv,
        amax=jnp.reshape(amax, (1,)).astype(F32), global_scale_inv=None,
        scaling_mode=recipe.scaling_mode(role), q_dtype=data.dtype, dq_dtype=dq_dtype,
        shape=tuple(data.shape), flatten_axis=1,
    )  # fmt: skip


def _heads(cfg, y, b):  # (M, F) -> (b, s, h, d)
    return y.reshape(b, -1, cfg.heads, cfg.head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mha(cfg: MhaConfig, x, w_qkv, b_qkv, gamma, beta, w_out, b_out, st_qkv, st_out, st_att, rng):
    return _mha_fwd(cfg, x, w_qkv, b_qkv, gamma, beta, w_out, b_out, st_qkv, st_out, st_att, rng)[0]


def _mha_fwd(cfg, x, w_qkv, b_qkv, gamma, beta, w_out, b_out, st_qkv, st_out, st_att, rng):
    b = x.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    qx, _, norm_res = dense_norm.quantize_input(cfg.qkv, cfg.norm, x2, gamma, beta, st_qkv)
    ys, qk = dense_mod.forward_quantized(cfg.qkv, qx, w_qkv, b_qkv, st_qkv, parts=3)  # float32
    q, k, v = (_heads(cfg, y, b) for y in ys)
    k, v, v_mean = att._centered(k, v, cfg.att.rate)  # float32 in, float32 out
    a = {"q": fs.amax(q), "k": fs.amax(k), "v": fs.amax(v)}
    c = cfg.att
    sc = att._current_fwd_outputs(c, att._fwd_scales(c, st_att, a), a, q.shape)
    run = att._cudnn_fwd if c.cudnn else att._emulate_fwd
    o, res, a["s"], a["o"] = run(c, q, k, v, sc, rng)  # q, k, v quantized once, inside
    f, _ = fs.dtypes(c.recipe)
    o8 = (res[3] if c.cudnn else fa._quantize(o, sc["o"], f)).reshape(x2.shape[0], -1)
    qo = _scaled(o8, sc["o"], a["o"], cfg.out.recipe, "x", F32)
    y, qk_out = dense_mod.forward_quantized(cfg.out, qo, w_out, b_out, st_out)
    dense_res = (*dense_mod.backward_residuals(qx, qk), *dense_mod.backward_residuals(qo, qk_out))
    out = y.reshape(x.shape[:-1] + (y.shape[-1],))
    if v_mean is not None:  # o = o_centered + v_mean: its share of the projection, per batch
        v_mean = v_mean.reshape(b, -1)
        out = (out.astype(F32) + _gemv(v_mean, w_out)[:, None]).astype(out.dtype)
    # sum_s x for dw_qkv's rank-one term; qx.data comes from the quantize kernel (an astype of
    # it is no f32 -> f8 -> f32 pair XLA could delete)
    cen = (_seq_sum(qx.data.astype(F32) * qx.scale_inv, b), v_mean, w_qkv, w_out)
    return out, (dense_res, norm_res, res, sc, a, st_qkv, st_out, st_att, rng, cen)


def _mha_bwd(cfg, res, ct):
    (qx_c, qk_r, qo_c, qko_r), norm_res, att_res, sc, a, st_qkv, st_out, st_att, rng, cen = res
    c = cfg.att
    ct2 = ct.reshape(-1, ct.shape[-1])
    qdy, db_out = dense_mod.quantize_grad(cfg.out, ct2, st_out, None)
    do, dw_out, st_out_ct = dense_mod.backward_quantized(cfg.out, qo_c, qko_r, st_out, qdy)  # do float32
    do = _heads(cfg, do, ct.shape[0])
    a_do = fs.amax(do)
    sc = att._bwd_scales(c, sc, a, a_do, att_res[0].shape)
    shared = jnp.minimum(jnp.minimum(sc["dq"], sc["dk"]), sc["dv"])  # one dqkv scale: none saturates
    sc = dict(sc, dq=shared, dk=shared, dv=shared)
    run = att._cudnn_bwd if c.cudnn else att._emulate_bwd
    grads, a_bwd = run(c, att_res, sc, do, rng)  # do quantized once, inside
    _, bdt = fs.dtypes(c.recipe)
    g8 = jnp.concatenate([fa._quantize(g, shared, bdt).reshape(ct2.shape[0], -1) for g in grads], axis=1)
    a_g = jnp.maximum(jnp.maximum(a_bwd["dq"], a_bwd["dk"]), a_bwd["dv"])
    qdg = _scaled(g8, shared, a_g, cfg.qkv.recipe, "grad", F32)
    # grads are g8's values (the same scale): their per-batch sums give the centering's terms
    g_sum = jnp.concatenate([_seq_sum(g.reshape(ct2.shape[0], -1), ct.shape[0]) for g in grads], axis=1)
    rank1, dw_out = _centering_grads(cen, g_sum, ct, dw_out)
    db_qkv = None
    if cfg.qkv.bias_dtype is not None:  # the FP8 gradient's column sum plus s times the rank-one row
        db_qkv = jnp.sum(g_sum + ct.shape[1] * rank1, axis=0).astype(cfg.qkv.bias_dtype)
    dx, dw_qkv, st_qkv_ct = dense_mod.backward_quantized(cfg.qkv, qx_c, qk_r, st_qkv, qdg)
    xs, _, w_qkv, _ = cen  # the centering's rank-one terms of the QKV projection's gradients
    dx = _add_rows(dx, _gemv(rank1, w_qkv.T), ct.shape[0])
    dw_qkv = (dw_qkv.astype(F32) + jnp.einsum("bk,bf->kf", xs, rank1, precision=_HI)).astype(dw_qkv.dtype)
    dx, dgamma, dbeta = dense_norm.input_grad(cfg.norm, norm_res, dx)
    st_att_ct = None
    if c.delayed:
        st_att_ct = fs.step_state(c.recipe, st_att, a | a_bwd | {"do": a_do})
    dx = dx.reshape(ct.shape[:-1] + (dx.shape[-1],))
    return dx, dw_qkv, db_qkv, dgamma, dbeta, dw_out, db_out, st_qkv_ct, st_out_ct, st_att_ct, None


def _seq_sum(x2, b):  # (b * s, n) -> (b, n) float32: the sum over each batch's rows
    return jnp.sum(x2.reshape(b, -1, x2.shape[-1]).astype(F32), axis=1)


def _gemv(rows, w):  # (b, k) . (k, n) in float32
    return jnp.dot(rows.astype(F32), w.astype(F32), precision=_HI)


def _add_rows(x2, rows, b):  # x2 (b * s, n) plus rows (b, n) on each batch's rows, in float32
    y = x2.reshape(b, -1, x2.shape[-1]).astype(F32) + rows[:, None]
    return y.reshape(x2.shape).astype(x2.dtype)


def _centering_grads(cen, g_sum, ct, dw_out):
    """The VJP of the centering as a per-batch row ``rank1 (b, 3F)`` to add to every row of the
    QKV output's gradient (g8's values), and dw_out with v_mean's share.

    k_c = k - mean_s(k): dk = dk_c - mean_s(dk_c). v_c = v - mean_s(v), o = o_c + mean_s(v):
    dv = dv_c - mean_s(dv_c) + mean_s(do), with sum_s(do) = sum_s(ct) . w_out^T (float32)."""
    _, v_mean, _, w_out = cen
    s, F = ct.shape[1], g_sum.shape[1] // 3
    zero, mean_dk, mean_dv = jnp.zeros_like(g_sum[:, :F]), g_sum[:, F : 2 * F] / s, g_sum[:, 2 * F :] / s
    if v_mean is None:  # dropout: v is not centered
        return jnp.concatenate([zero, -mean_dk, zero], axis=1), dw_out
    ct_sum = jnp.sum(ct.astype(F32), axis=1)  # (b, N)
    rank1 = jnp.concatenate([zero, -mean_dk, _gemv(ct_sum, w_out.T) / s - mean_dv], axis=1)
    dw_v = jnp.einsum("bf,bn->fn", v_mean, ct_sum, precision=_HI)
    return rank1, (dw_out.astype(F32) + dw_v).astype(dw_out.dtype)


_mha.defvjp(_mha_fwd, _mha_bwd)


def mha_fp8(
    x,
    w_qkv,
    b_qkv,
    w_out,
    b_out,
    *,
    recipe,
    heads: int,
    norm=None,
    qkv_state=None,
    out_state=None,
    attention_state=None,
    causal: bool = False,
    scale: float,
    dropout_rate: float = 0.0,
    rng=None,
    implementation=None,
):
    """Self-attention block ``out(attention(split(norm(x) . w_qkv + b_qkv)))`` with FP8 handed
    across both boundaries. ``x (b, s, K)``; ``w_qkv (K, 3, heads * d)``, ``b_qkv (3, heads * d)``
    or None; ``w_out (heads * d, N)``, ``b_out (N,)`` or None; ``norm`` a
    :class:`lowbit.ops.fused.dense_norm.NormInput` or None; ``recipe`` DelayedScaling (the three
    states: ``lowbit.init_delayed_state`` for the projections, ``fp8_scales.init_state`` for the
    attention) or Float8CurrentScaling. Returns ``(b, s, N)`` in x's dtype."""
    fs.check_recipe(recipe)
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"mha_fp8: x must be (batch, seq, hidden), got {getattr(x, 'shape', x)}")
    if getattr(w_qkv, "ndim", None) != 3 or w_qkv.shape[:2] != (x.shape[-1], 3) or w_qkv.shape[2] % heads:
        got = getattr(w_qkv, "shape", w_qkv)
        raise ValueError(f"mha_fp8: w_qkv must be (hidden={x.shape[-1]}, 3, heads * head_dim), got {got}")
    F = w_qkv.shape[2]
    if getattr(w_out, "ndim", None) != 2 or w_out.shape[0] != F:
        raise ValueError(
            f"mha_fp8: w_out must be (heads * head_dim={F}, N), got {getattr(w_out, 'shape', w_out)}"
        )
    if b_qkv is not None and tuple(b_qkv.shape) not in ((3, F), (3 * F,)):
        raise ValueError(f"mha_fp8: b_qkv must be (3, {F}), got {tuple(b_qkv.shape)}")
    if b_out is not None and tuple(b_out.shape) != (w_out.shape[1],):
        raise ValueError(f"mha_fp8: b_out must be ({w_out.shape[1]},), got {tuple(b_out.shape)}")
    ncfg, gamma, beta = dense_norm.check_norm_input(norm, x, "mha_fp8")
    # The attention's checks (shapes, rate, rng, implementation, state) on stand-ins of q, k, v.
    d = F // heads
    probe = jax.ShapeDtypeStruct((x.shape[0], x.shape[1], heads, d), F32)
    att_cfg = att.config(
        probe, probe, recipe=recipe, causal=causal, scale=scale, dropout_rate=dropout_rate,
        rng=rng, implementation=implementation,
    )  # fmt: skip
    if att_cfg.plan is not None:
        raise NotImplementedError(
            "mha_fp8: runs on one device; under a mesh that splits the batch or heads use fp8_dpa "
            "(the Flax modules fall back to it)"
        )
    st_att = fs.check_state(recipe, attention_state)
    st_qkv = ds.check_state_arg("mha_fp8", recipe, qkv_state, "lowbit.init_delayed_state(recipe)")
    st_out = ds.check_state_arg("mha_fp8", recipe, out_state, "lowbit.init_delayed_state(recipe)")
    w2 = w_qkv.reshape(x.shape[-1], 3 * F)
    b2 = None if b_qkv is None else b_qkv.reshape(3 * F)
    qcfg = dense_mod.make_config(recipe, F32, x.dtype, w2, b2, True)
    ocfg = dense_mod.make_config(recipe, x.dtype, F32, w_out, b_out, True)
    cfg = MhaConfig(qcfg, ocfg, ncfg, att_cfg, int(heads), int(d))
    return _mha(cfg, x, w2, b2, gamma, beta, w_out, b_out, st_qkv, st_out, st_att, rng)


__all__ = ["mha_fp8"]
