"""dense under a mesh: the 2-D op of lowbit.ops.dense run per shard through shard_map.

The FFI calls have no partitioning rule, so without this XLA gathers their operands. The plan
(:func:`lowbit.sharding.plan_dense`) names the axes: the batch axes (dp, fsdp) split M; tp splits
the kernel's N ("column", the default) or K ("row", ``lowbit.dense(..., tp_layout="row")``).
lowbit.ops.dense asks for the plan and calls :func:`dense_2d` with it. Per shard:

* per-tensor scales stay global: a tensor's amax is the pmax of the shard amaxes; current scaling
  quantizes with scale_from_amax(global amax) through the delayed path (the same encode);
* a GEMM whose contraction is split (y over K in "row", dgrad over N in "column", wgrad over M)
  writes its partial sums in ``plan.partial_sum_dtype`` (default: the inputs' dtype, bf16 for
  bf16 activations, the bytes XLA moves for a sharded dot), which are psum'd and cast to the
  output dtype; with "float32" the results match one device's to one rounding of the output.
  The dbias partial sums stay float32 (a vector: no bytes worth saving).

Sequence parallelism (``plan.seq``, the MeshResource's ``tpsp_resource``): x, y and their
gradients cross the shard_map as (B, S, C) (batch, sequence, features), laid out
``P(batch, seq, ...)`` on the sequence-split side. Column layout: each shard quantizes its
(batch, sequence) block of x and all-gathers the FP8 copies along the sequence over tp (the
rowwise copy before the forward GEMM, the colwise one before the wgrad in the backward; per-tensor
scales are global already, block scales travel with their data); the dgrad's partial sums are
reduce-scattered along the sequence. Row layout: y's partial sums are reduce-scattered along the
sequence; in the backward each shard quantizes its block of dy and all-gathers its FP8 copies
before the dgrad and wgrad. The reduce-scatters sum in ``plan.partial_sum_dtype`` as the psums do.

NVFP4 (its per-tensor scale comes from the amax inside the kernel) and shapes whose shards would
split a scaling block run the unsharded op (no plan). FP8 block scaling (Float8BlockScaling)
quantizes each shard on its own: with shards of whole 128-blocks (plan_dense checks) its blocks
are the unsharded op's blocks, and each shard's scale arrays (cuBLASLt's layout of the local
copy) are stored side by side.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lowbit import delayed_scaling as ds
from lowbit.ops.gemm import gemm, gemm_bias, gemm_out_dtype
from lowbit.ops.nonfinite import poison_nonfinite
from lowbit.ops.quantize import quantize, quantize_dbias
from lowbit.quantization.scaling_modes import ScalingMode, fp8_block_scale_shape
from lowbit.quantization.tensor import ScaledTensor
from lowbit.sharding import ShardPlan
from lowbit.sharding import shard_map as _shard_map

_F32 = np.dtype(jnp.float32)
_FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# Per-shard pieces (run inside shard_map)
# ---------------------------------------------------------------------------------------------
def _pmax(a, axes):
    return jax.lax.pmax(a, axes) if axes else a


def _local_amax(v):
    a = jnp.abs(v.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(a), 0.0, a)).reshape(1)  # NaN ignored, as the kernel does


def _scale_from_amax(a, m):
    # docs/numerics.md scale_from_amax: m / a if a finite and > 0, else 1; overflow -> FLT_MAX.
    ok = jnp.isfinite(a) & (a > 0)
    s = jnp.float32(m) / jnp.where(ok, a, jnp.float32(1))
    s = jnp.where(jnp.isinf(s), jnp.float32(_FLT_MAX), s)
    return jnp.where(ok, s, jnp.float32(1)).astype(jnp.float32)


def _current(cfg, role) -> bool:
    return cfg.recipe.scaling_mode(role) == ScalingMode.CURRENT_TENSOR_SCALING


def _global_amaxes(cfg, vals: dict, axes) -> dict:
    """Current scaling's amaxes, needed before quantizing: the roles' local maxima reduced in one
    all-reduce over every axis of the plan (each tensor is replicated over the axes that do not
    split it, so the max over them is its own)."""
    roles = [r for r in vals if _current(cfg, r)]
    if not roles:
        return {}
    g = _pmax(jnp.concatenate([_local_amax(vals[r]) for r in roles]), axes)
    return {r: g[i : i + 1] for i, r in enumerate(roles)}


def _quantize(cfg, role, v, scale, amax=None, dbias=False):
    """Quantizes one shard in both layouts with the global per-tensor scale. Current scaling
    takes its global ``amax`` (the scale follows from it; the delayed path's encode); the
    ScaledTensor's amax is that global one, or the shard's own (reduced by
    :func:`_reduce_amaxes`)."""
    mode, q = cfg.recipe.scaling_mode(role), cfg.recipe.q_dtype(role)
    if mode == ScalingMode.CURRENT_TENSOR_SCALING:
        scale = _scale_from_amax(amax, float(jnp.finfo(q).max))
        mode = ScalingMode.DELAYED_TENSOR_SCALING
    kw = dict(scale=scale, layout="both")
    if mode.is_fp8_block:
        qp = cfg.recipe.qparams(role)
        kw.update(power_2_scale=bool(qp.power_2_scale), amax_epsilon=float(qp.amax_epsilon))
    if dbias:
        qt, db = quantize_dbias(v, mode, q, **kw)
    else:
        qt, db = quantize(v, mode, q, **kw), None
    if amax is not None:
        qt = dataclasses.replace(qt, amax=amax)
    return qt, db


def _reduce_amaxes(cfg, qts: dict, axes) -> tuple:
    """The quantized shards with global amaxes (the delayed roles' in one all-reduce; current
    scaling's are global already) and NaN decode scales where an amax is not finite."""
    local = [r for r, qt in qts.items() if qt.scaling_mode.is_tensor_scaling and not _current(cfg, r)]
    if local:
        g = _pmax(jnp.concatenate([qts[r].amax for r in local]), axes)
        qts = dict(qts, **{r: dataclasses.replace(qts[r], amax=g[i : i + 1]) for i, r in enumerate(local)})
    return tuple(poison_nonfinite(qt) for qt in qts.values())


def _partial_dtype(plan, a, b, out_dtype):
    """The dtype a split contraction's partial sums are written and all-reduced in."""
    if plan.partial_sum_dtype is not None:
        return np.dtype(plan.partial_sum_dtype)
    inputs = jnp.promote_types(a.dq_dtype, b.dq_dtype)
    return np.dtype(inputs if np.dtype(inputs).itemsize < np.dtype(out_dtype).itemsize else out_dtype)


def _reduce(y, axes, scatter_b: int):
    """The psum of split-contraction partials over ``axes``; with ``scatter_b`` (a shard's B under
    sequence parallelism) a reduce-scatter along the sequence instead: rows (b, S) -> (b, S/n)."""
    if not scatter_b:
        return jax.lax.psum(y, axes)
    y = y.reshape(scatter_b, -1, y.shape[-1])
    return jax.lax.psum_scatter(y, axes, scatter_dimension=1, tiled=True).reshape(-1, y.shape[-1])


def _mm(plan, a, b, a_layout, b_layout, out_dtype, sum_axes, bias=None, fast_accum=False, scatter_b=0):
    """a . b^T (+ bias); a split contraction is summed over ``sum_axes`` (see the module doc),
    reduce-scattered along the sequence with ``scatter_b`` (:func:`_reduce`)."""
    if not sum_axes:
        y = gemm(
            a,
            b,
            bias,
            a_layout=a_layout,
            b_layout=b_layout,
            out_dtype=gemm_out_dtype(out_dtype),
            fast_accum=fast_accum,
        )
        return y.astype(out_dtype)
    part = _partial_dtype(plan, a, b, out_dtype)
    y = gemm(
        a, b, a_layout=a_layout, b_layout=b_layout, out_dtype=gemm_out_dtype(part), fast_accum=fast_accum
    )
    y = _reduce(y.astype(part), sum_axes, scatter_b)
    if bias is not None:
        y = y.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _scale_spec(cfg, plan, role, colwise: bool):
    """PartitionSpec of a shard's stored decode scales (of the kernel's rowwise (K, N) copy or
    x's colwise (K, M) copy): replicated per-tensor scales; MXFP8 scales shard as the data does;
    FP8 block-scale arrays by their (block rows, block cols) dims, which for 1x128 blocks are
    (the copy's cols, its rows) (lowbit.quantization.scaling_modes.fp8_block_scale_shape)."""
    mode = cfg.recipe.scaling_mode(role)
    dims = ("k_axes", "x_rows") if colwise else ("k_axes", "n_axes")
    if mode.is_tensor_scaling:
        return P()
    if mode == ScalingMode.BLOCK_1D_SCALING:
        return plan.spec(dims[1], dims[0])
    return plan.spec(*dims)


def _act_spec(plan, side: str) -> P:
    """The spec of x / dx (``side`` "x") or y / dy ("y"): (M, C), or (B, S, C) under sequence
    parallelism with the sequence split on the side the plan names."""
    feat = "k_axes" if side == "x" else "n_axes"
    return plan.spec("batch", f"{side}_seq", feat) if plan.rows else plan.spec("batch", feat)


def _gather_rows(a, axis: int, b: int, axes):
    """``a`` whose ``axis`` lists a shard's rows (b, s) (b-major; or their scale entries), with
    each batch row's s gathered over ``axes`` (mesh order: the sequence)."""
    a = a.reshape(a.shape[:axis] + (b, a.shape[axis] // b) + a.shape[axis + 1 :])
    a = jax.lax.all_gather(a, axes, axis=axis + 1, tiled=True)
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2 :])


#: (scaling mode, colwise copy) -> (the axis of its decode-scale array that follows the tensor's
#: rows, rows per entry): MXFP8 (rows, cols/32) / (cols, rows/32); FP8 block scales as
#: fp8_block_scale_shape lays them out for the rowwise (R, C) and the colwise (C, R) copy.
_SCALE_ROWS = {
    (ScalingMode.MXFP8_1D_SCALING, False): (0, 1),
    (ScalingMode.MXFP8_1D_SCALING, True): (1, 32),
    (ScalingMode.BLOCK_1D_SCALING, False): (1, 1),
    (ScalingMode.BLOCK_1D_SCALING, True): (0, 128),
    (ScalingMode.BLOCK_2D_SCALING, False): (0, 128),
    (ScalingMode.BLOCK_2D_SCALING, True): (1, 128),
}


def _gather_scales(mode, s, colwise: bool, R: int, C: int, n: int, b: int, axes):
    """The decode scales of one copy of an (R, C) shard whose rows are gathered ``n``-fold."""
    if mode.is_tensor_scaling:
        return s  # per-tensor: global already
    ax, unit = _SCALE_ROWS[(mode, colwise)]
    s = _gather_rows(jax.lax.slice_in_dim(s, 0, R // unit, axis=ax), ax, b, axes)  # no padding
    if mode.is_fp8_block:  # the gathered copy's layout may pad (entries 1.0)
        want = fp8_block_scale_shape(mode, *((C, R * n) if colwise else (R * n, C)))[ax]
        if want > s.shape[ax]:
            pad = [(0, 0)] * s.ndim
            pad[ax] = (0, want - s.shape[ax])
            s = jnp.pad(s, pad, constant_values=1)
    return s


def _gather_seq(plan, qt: ScaledTensor, axes) -> ScaledTensor:
    """A quantized shard of rows (b, s) x C with the sequence gathered over ``axes`` (sequence
    parallelism): the FP8 data and decode scales of each copy it holds; FP8 travels, never the
    high-precision tensor."""
    if not axes:
        return qt
    n, b = int(np.prod([plan.mesh.shape[a] for a in axes])), plan.b_local
    (R, C), mode, kw = qt.shape, qt.scaling_mode, {}
    if qt.data is not None:
        kw.update(
            data=_gather_rows(qt.data, 0, b, axes),
            scale_inv=_gather_scales(mode, qt.scale_inv, False, R, C, n, b, axes),
        )
    if qt.colwise_data is not None:
        kw.update(
            colwise_data=_gather_rows(qt.colwise_data, 1, b, axes),
            colwise_scale_inv=_gather_scales(mode, qt.colwise_scale_inv, True, R, C, n, b, axes),
        )
    return dataclasses.replace(qt, shape=(R * n, C), **kw)


def _rows_out(plan, v):
    """A shard's 2-D result as it leaves the shard_map: (b, s, C) under sequence parallelism."""
    return v.reshape(plan.b_local, -1, v.shape[-1]) if plan.rows else v


def _call(plan, body, args: dict, specs: dict, out_specs):
    """shard_map over the non-None entries of ``args`` (None stays None inside)."""
    keys = [k for k, v in args.items() if v is not None]

    def inner(*vals):
        return body(**dict(zip(keys, vals)), **{k: None for k in args if k not in keys})

    return _shard_map(inner, plan.mesh, tuple(specs[k] for k in keys), out_specs)(*(args[k] for k in keys))


def _plan_axes(plan) -> tuple:
    """Every mesh axis of the plan: a per-tensor amax is reduced over all of them (each tensor
    is replicated over the axes that do not split it, so the max over those is its own)."""
    return plan.batch + plan.k_axes + plan.n_axes


# ---------------------------------------------------------------------------------------------
# The sharded 2-D op: custom VJP outside, one shard_map per direction
# ---------------------------------------------------------------------------------------------
def _fwd(cfg, plan: ShardPlan, x, k, bias, state):
    def body(x, k, bias, sx, sk):
        x = x.reshape(-1, x.shape[-1])  # (b, s, K) under sequence parallelism
        axes = _plan_axes(plan)
        pre = _global_amaxes(cfg, {"x": x, "kernel": k}, axes)
        qx, _ = _quantize(cfg, "x", x, sx, pre.get("x"))
        qk, _ = _quantize(cfg, "kernel", k, sk, pre.get("kernel"))
        # The delayed roles' amaxes only feed the state update: they leave as the shard's own and
        # are reduced in the backward's one all-reduce (no scalar collective in the forward).
        qx, qk = _reduce_amaxes(cfg, {"x": qx, "kernel": qk}, () if cfg.delayed else axes)
        # Column layout under sequence parallelism: the GEMM reads whole sequences (the rowwise
        # FP8 copy gathered); the colwise copy stays a shard until the backward needs it.
        xg = qx
        if plan.x_seq:
            rowwise = dataclasses.replace(qx, colwise_data=None, colwise_scale_inv=None)
            xg = _gather_seq(plan, rowwise, plan.x_seq)
        scatter = plan.b_local if plan.y_seq else 0
        y = _mm(plan, xg, qk, "rowwise", "colwise", cfg.out_dtype, plan.k_axes, bias, cfg.fast_accum, scatter)
        res = (qx.colwise_data, qx.colwise_scale_inv, qk.data, qk.scale_inv)
        fa = jnp.concatenate([qx.amax, qk.amax]) if cfg.delayed else jnp.zeros((2,), jnp.float32)
        return _rows_out(plan, y), res, fa

    res_specs = (
        plan.spec("k_axes", "x_rows"),
        _scale_spec(cfg, plan, "x", colwise=True),
        plan.spec("k_axes", "n_axes"),
        _scale_spec(cfg, plan, "kernel", colwise=False),
    )
    sx, sk = ds.scale_of(state, "x"), ds.scale_of(state, "kernel")
    args = dict(x=x, k=k, bias=gemm_bias(bias), sx=sx, sk=sk)
    specs = dict(
        x=_act_spec(plan, "x"),
        k=plan.spec("k_axes", "n_axes"),
        bias=plan.spec("n_axes"),
        sx=P(),
        sk=P(),
    )
    amax_spec = P(_plan_axes(plan) or None)  # (2,) per shard: local under delayed scaling
    y, res, amaxes = _call(plan, body, args, specs, (_act_spec(plan, "y"), res_specs, amax_spec))
    return y, res, amaxes


def _local_tensor(cfg, role, data, s_inv, colwise):
    """A per-shard ScaledTensor from one copy's arrays (2-D: rowwise (R, C), colwise (C, R))."""
    mode, q = cfg.recipe.scaling_mode(role), cfg.recipe.q_dtype(role)
    if mode == ScalingMode.CURRENT_TENSOR_SCALING:
        mode = ScalingMode.DELAYED_TENSOR_SCALING
    r, c = (data.shape[1], data.shape[0]) if colwise else data.shape
    dq = cfg.x_dtype if role == "x" else cfg.kernel_dtype
    return ScaledTensor(
        data=None if colwise else data,
        scale_inv=None if colwise else s_inv,
        colwise_data=data if colwise else None,
        colwise_scale_inv=s_inv if colwise else None,
        amax=jnp.zeros((1,), jnp.float32),
        global_scale_inv=None,
        scaling_mode=mode,
        q_dtype=np.dtype(q),
        dq_dtype=np.dtype(dq),
        shape=(r, c),
        flatten_axis=1,
    )


def _bwd(cfg, plan: ShardPlan, res, dy, grad_scale, fwd_amax):
    def body(dy, xc, xcs, kr, krs, sg, fa):
        dy = dy.reshape(-1, dy.shape[-1])  # (b, s, N) under sequence parallelism
        # Split rows: sum dbias in float32 here (the fused one rounds each partial to dy's dtype).
        fused = cfg.bias_dtype is not None and not plan.y_rows
        axes = _plan_axes(plan)
        # Every scalar reduction of the step in one all-reduce: the forward's local amaxes (delayed
        # scaling) ride along with the gradient's (before quantizing it under current scaling,
        # after under delayed).
        fa = fa if cfg.delayed else jnp.zeros((0,), jnp.float32)
        pre = {}
        if _current(cfg, "grad"):
            g = _pmax(jnp.concatenate([fa, _local_amax(dy)]), axes)
            fa, pre = g[:-1], {"grad": g[-1:]}
        qdy, db = _quantize(cfg, "grad", dy, sg, pre.get("grad"), dbias=fused)
        if cfg.delayed and not pre:
            g = _pmax(jnp.concatenate([fa, qdy.amax]), axes)
            fa, qdy = g[:-1], poison_nonfinite(dataclasses.replace(qdy, amax=g[-1:]))
        else:
            (qdy,) = _reduce_amaxes(cfg, {"grad": qdy}, axes)
        if cfg.bias_dtype is not None and plan.y_rows:
            db = jnp.sum(dy.astype(jnp.float32), axis=0)
        # Sequence parallelism: the GEMMs read whole sequences: dy's FP8 copies gathered (row
        # layout), x's colwise FP8 copy gathered (column layout).
        qdy = _gather_seq(plan, qdy, plan.y_seq)
        qx = _gather_seq(plan, _local_tensor(cfg, "x", xc, xcs, colwise=True), plan.x_seq)
        qk = _local_tensor(cfg, "kernel", kr, krs, colwise=False)
        scatter = plan.b_local if plan.x_seq else 0
        dx = _mm(
            plan,
            qdy,
            qk,
            "rowwise",
            "rowwise",
            cfg.x_dtype,
            plan.n_axes,
            fast_accum=cfg.fast_accum_dgrad,
            scatter_b=scatter,
        )
        dk = _mm(
            plan, qx, qdy, "colwise", "colwise", cfg.kernel_dtype, plan.batch, fast_accum=cfg.fast_accum_wgrad
        )
        if db is not None:
            db = (jax.lax.psum(db, plan.y_rows) if plan.y_rows else db).astype(cfg.bias_dtype)
        return _rows_out(plan, dx), dk, db, jnp.concatenate([fa, qdy.amax])

    xc, xcs, kr, krs = res
    args = dict(dy=dy, xc=xc, xcs=xcs, kr=kr, krs=krs, sg=grad_scale, fa=fwd_amax)
    specs = dict(
        dy=_act_spec(plan, "y"),
        xc=plan.spec("k_axes", "x_rows"),
        xcs=_scale_spec(cfg, plan, "x", colwise=True),
        kr=plan.spec("k_axes", "n_axes"),
        krs=_scale_spec(cfg, plan, "kernel", colwise=False),
        sg=P(),
        fa=P(_plan_axes(plan) or None),
    )
    db_spec = plan.spec("n_axes") if cfg.bias_dtype is not None else None
    outs = (_act_spec(plan, "x"), plan.spec("k_axes", "n_axes"), db_spec, P())
    if cfg.bias_dtype is None:

        def body_nb(**kw):
            dx, dk, _, a = body(**kw)
            return dx, dk, a

        dx, dk, a = _call(plan, body_nb, args, specs, (outs[0], outs[1], outs[3]))
        return dx, dk, None, a
    return _call(plan, body, args, specs, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_2d(cfg, plan, x, kernel, bias, state):
    return _fwd(cfg, plan, x, kernel, bias, state)[0]


def _sharded_2d_fwd(cfg, plan, x, kernel, bias, state):
    y, res, fwd_amax = _fwd(cfg, plan, x, kernel, bias, state)
    return y, (res, fwd_amax, state)


def _sharded_2d_bwd(cfg, plan, saved, dy):
    res, fwd_amax, state = saved
    dx, dk, db, a = _bwd(cfg, plan, res, dy, ds.scale_of(state, "grad"), fwd_amax)
    state_ct = None
    if cfg.delayed:  # a: the global amaxes of x, kernel and grad
        state_ct = ds.advance_step(cfg.recipe, state, {"x": a[0:1], "kernel": a[1:2], "grad": a[2:3]})
    return dx, dk, db, state_ct


_sharded_2d.defvjp(_sharded_2d_fwd, _sharded_2d_bwd)


def dense_2d(cfg, plan: ShardPlan, x, kernel, bias, state):
    """lowbit.ops.dense's 2-D op (``cfg`` its config) per shard as ``plan`` lays it out:
    x (M, K) -> y (M, N), or under sequence parallelism x (B, S, K) -> y (B, S, N)
    (``plan.rows``); kernel (K, N), bias (N,) or None; every size split evenly (plan_dense
    checks)."""
    return _sharded_2d(cfg, plan, x, kernel, bias, state)
