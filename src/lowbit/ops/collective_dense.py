"""Collective matmul: sequence parallelism's all-gather and reduce-scatter overlapped with the
GEMMs, as rings of ``ppermute`` steps inside one shard_map (TransformerEngine's collective GEMM).

Opt-in: ``lowbit.dense(..., tp_overlap=True)`` / ``lowbit.mlp(..., tp_overlap=True)`` under a
MeshResource with ``tpsp_resource``. The layout, the quantization and the amax reductions are
those of lowbit.ops.dense_sharded's sequence-parallel plan (FP8 copies quantized once per shard
with the global amax, before any ring: the rings move FP8 bytes and their block scales); only the
collectives change. With n the size of the tp axis and r a device's place on it, at step
t = 0 .. n-1:

* all-gather -> GEMM ("AG"): the device multiplies the sequence chunk it holds (the one device
  (r + t) % n started with) while ppermute hands that chunk on to device r - 1; each chunk's
  output rows land at their place in the whole sequence. Each output element is one unsplit dot,
  as with the gathered operand.
* GEMM -> reduce-scatter ("RS"): the device computes chunk (r + t + 1) % n's partial sums from
  its slice of the contraction (GEMM in float32), adds the running sum that device r + 1 handed
  it, and hands the sum on in ``plan.partial_sum_dtype`` (the dtype the non-overlapped
  reduce-scatter moves); after n steps device r holds chunk r's whole sum.

Per direction (column layout = kernel's N split, x split along the sequence on arrival; row
layout = kernel's K split, y split along the sequence on leaving):

* column: forward AG over x's rowwise FP8 copy; backward RS for dx (dy . kernel^T), with x's
  colwise FP8 shard handed round the same ring for the wgrad (the forward's gathered x is not
  kept: the backward regathers it chunk by chunk, each chunk's wgrad accumulated in float32);
* row: forward RS for y; backward AG over dy's two FP8 copies: dx rows per chunk, and the wgrad
  of each chunk against x's rows of it, accumulated in float32.

The wgrad is then summed over the batch axes as in dense_sharded. BF16 (no recipe) runs the same
rings with XLA dots. Without ``tpsp_resource`` there is nothing to overlap and ``tp_overlap``
changes nothing; NVFP4 runs unsharded anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lowbit import delayed_scaling as ds
from lowbit.ops import dense_sharded as sh
from lowbit.ops.gemm import gemm, gemm_bias, gemm_out_dtype
from lowbit.quantization.scaling_modes import fp8_block_scale_shape
from lowbit.quantization.tensor import ScaledTensor
from lowbit.sharding import ShardPlan, _mesh_axes, plan_dense

_F32 = np.dtype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def sequence_parallel() -> bool:
    """Whether a MeshResource with ``tpsp_resource`` (size > 1) and a mesh are in context."""
    found = _mesh_axes()
    return found is not None and bool(found.seq)


def plan_overlap(recipe, M: int, K: int, N: int, tp_layout, lead: tuple, x_shape) -> Optional[ShardPlan]:
    """The sequence-parallel plan with its collectives as rings, or None without sequence
    parallelism in context. A ValueError naming the axis and x's shape where the sequence (or
    the kernel) does not split evenly: an opted-in overlap never falls back silently."""
    found = _mesh_axes()
    if found is None or not found.seq:
        return None
    plan = plan_dense(recipe, M, K, N, tp_layout, lead)
    if plan is None or not plan.rows:
        axis = found.seq[0]
        n, nb = found.mesh.shape[axis], int(np.prod([found.mesh.shape[a] for a in found.batch]))
        row = plan is not None and bool(plan.k_axes)
        raise ValueError(
            f"dense(tp_overlap=True): x of shape {tuple(x_shape)} does not split over mesh axis "
            f"{axis!r} (size {n}, tpsp_resource): its sequence (axis 1) must divide by {n} into "
            f"shards of whole scaling blocks, its batch (axis 0) by the batch axes {found.batch} "
            f"({nb}), and the kernel ({K}, {N})'s {'K' if row else 'N'} by {n}; pad the sequence "
            "or pass tp_overlap=False"
        )
    return dataclasses.replace(plan, overlap=True)


# ---------------------------------------------------------------------------------------------
# Rings (inside the shard_map)
# ---------------------------------------------------------------------------------------------
def _ring(plan):
    axis = plan.seq[0]
    return axis, plan.mesh.shape[axis]


def _to_left(v, axis, n):
    """``v`` (a pytree: a ScaledTensor's arrays travel together) handed from device j to j - 1."""
    return jax.lax.ppermute(v, axis, [(j, (j - 1) % n) for j in range(n)])


def _travelling(a):
    """What of the operand ``a`` moves round the ring, and how a device rebuilds the chunk: a
    ScaledTensor's data (and block scales) move; its amax and per-tensor scales are global and
    stay (one collective-permute less each, a latency per step on GPUs)."""
    if not isinstance(a, ScaledTensor):
        return a, lambda v: v
    keep = {"amax": a.amax}
    if a.scaling_mode.is_tensor_scaling:
        keep.update(scale_inv=a.scale_inv, colwise_scale_inv=a.colwise_scale_inv)
    return dataclasses.replace(a, **{k: None for k in keep}), lambda v: dataclasses.replace(v, **keep)


def _ring_steps(plan, held=None, on_held=None, partial=None, part_dtype=None):
    """n steps of the tp ring (module doc). ``on_held(chunk, j)`` runs on the chunk a device
    holds at each step (device j's) while it moves on: returns the outputs in step order.
    ``partial(c)`` gives chunk c's float32 partial sums: returns the running sum after n steps
    (this device's chunk, in ``part_dtype``)."""
    axis, n = _ring(plan)
    r = jax.lax.axis_index(axis)
    held, rebuild = _travelling(held)
    outs, acc = [], None
    for t in range(n):
        # Both sends are issued before this step's GEMMs and need none of their results, so
        # XLA's scheduler runs them under the GEMMs.
        nxt = _to_left(held, axis, n) if on_held is not None and t < n - 1 else None
        incoming = _to_left(acc, axis, n) if acc is not None else None
        if on_held is not None:
            outs.append(on_held(rebuild(held), (r + t) % n))
        if partial is not None:
            p = partial((r + t + 1) % n).astype(_F32)
            acc = (p if incoming is None else p + incoming.astype(_F32)).astype(part_dtype)
        held = nxt
    return outs, acc


def _place(plan, outs):
    """The whole sequence's rows (b * S, C) from the per-step chunk outputs (b * s, C): step t's
    chunk is device (r + t) % n's."""
    axis, n = _ring(plan)
    r, b = jax.lax.axis_index(axis), plan.b_local
    s, C = outs[0].shape[0] // b, outs[0].shape[1]
    buf = jnp.zeros((b, n, s, C), outs[0].dtype)
    for t, o in enumerate(outs):
        buf = jax.lax.dynamic_update_slice(buf, o.reshape(b, 1, s, C), (0, (r + t) % n, 0, 0))
    return buf.reshape(b * n * s, C)


def _take(a, axis: int, b: int, n: int, c):
    """Sequence chunk ``c`` of ``a``, whose ``axis`` lists rows (b, S) b-major (or their scale
    entries): (b, n, S/n) -> (b, S/n) at chunk c."""
    shp = a.shape
    a = a.reshape(shp[:axis] + (b, n, shp[axis] // (b * n)) + shp[axis + 1 :])
    a = jax.lax.dynamic_index_in_dim(a, c, axis + 1, keepdims=False)
    return a.reshape(shp[:axis] + (-1,) + shp[axis + 1 :])


def _take_scales(mode, s, colwise: bool, R: int, C: int, b: int, n: int, c):
    """The decode scales of chunk ``c`` of an (R, C) copy's rows (dense_sharded's _SCALE_ROWS)."""
    if mode.is_tensor_scaling:
        return s
    ax, unit = sh._SCALE_ROWS[(mode, colwise)]
    s = _take(jax.lax.slice_in_dim(s, 0, R // unit, axis=ax), ax, b, n, c)  # padding dropped
    if mode.is_fp8_block:  # the chunk's own layout may pad (entries 1.0)
        want = fp8_block_scale_shape(mode, *((C, R // n) if colwise else (R // n, C)))[ax]
        pad = [(0, 0)] * s.ndim
        pad[ax] = (0, want - s.shape[ax])
        s = jnp.pad(s, pad, constant_values=1)
    return s


def _take_rows(plan, a, c):
    """Chunk ``c`` of the sequence of a full-sequence operand: a 2-D array (rows, C) or a
    ScaledTensor (each copy it holds, with its scales)."""
    _, n = _ring(plan)
    b = plan.b_local
    if not isinstance(a, ScaledTensor):
        return _take(a, 0, b, n, c)
    (R, C), mode, kw = a.shape, a.scaling_mode, {}
    if a.data is not None:
        kw.update(
            data=_take(a.data, 0, b, n, c), scale_inv=_take_scales(mode, a.scale_inv, False, R, C, b, n, c)
        )
    if a.colwise_data is not None:
        kw.update(
            colwise_data=_take(a.colwise_data, 1, b, n, c),
            colwise_scale_inv=_take_scales(mode, a.colwise_scale_inv, True, R, C, b, n, c),
        )
    return dataclasses.replace(a, shape=(R // n, C), **kw)


# ---------------------------------------------------------------------------------------------
# The three GEMMs of a dense on one chunk: FP8 (lowbit.gemm on the copies) or BF16 (XLA dots)
# ---------------------------------------------------------------------------------------------
def _dot(a, b, dims, out):
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32).astype(out)


def _fprop(a, k, out, fast=False, bias=None):
    """a (R, K) . kernel (K, N) (+ bias)."""
    if isinstance(a, ScaledTensor):
        y = gemm(
            a,
            k,
            gemm_bias(bias),
            a_layout="rowwise",
            b_layout="colwise",
            out_dtype=gemm_out_dtype(out),
            fast_accum=fast,
        )
        return y.astype(out)
    y = _dot(a, k, ((1,), (0,)), _F32)
    return (y if bias is None else y + bias.astype(_F32)).astype(out)


def _dgrad(dy, k, out, fast=False):
    """dy (R, N) . kernel (K, N)^T."""
    if isinstance(dy, ScaledTensor):
        y = gemm(
            dy, k, a_layout="rowwise", b_layout="rowwise", out_dtype=gemm_out_dtype(out), fast_accum=fast
        )
        return y.astype(out)
    return _dot(dy, k, ((1,), (1,)), out)


def _wgrad(x, dy, fast=False):
    """x (R, K)^T . dy (R, N) in float32."""
    if isinstance(x, ScaledTensor):
        return gemm(x, dy, a_layout="colwise", b_layout="colwise", out_dtype=_F32, fast_accum=fast)
    return _dot(x, dy, ((0,), (0,)), _F32)


def _partial_dtype(plan, a, out_dtype):
    """dense_sharded's choice: the plan's dtype, else the inputs' where narrower than the output."""
    if plan.partial_sum_dtype is not None:
        return np.dtype(plan.partial_sum_dtype)
    d = np.dtype(a.dq_dtype if isinstance(a, ScaledTensor) else a.dtype)
    return d if d.itemsize < np.dtype(out_dtype).itemsize else np.dtype(out_dtype)


def _forward_rows(cfg, plan, xa, ka, bias):
    """This shard's y rows (b * S, N/n) in the column layout, (b * s, N) in the row layout."""
    if plan.x_seq:  # column: AG -> GEMM over x's chunks
        outs, _ = _ring_steps(
            plan, xa, on_held=lambda a, j: _fprop(a, ka, cfg.out_dtype, cfg.fast_accum, bias)
        )
        return _place(plan, outs)
    part = _partial_dtype(plan, xa, cfg.out_dtype)  # row: GEMM -> RS of y
    _, y = _ring_steps(
        plan, partial=lambda c: _fprop(_take_rows(plan, xa, c), ka, _F32, cfg.fast_accum), part_dtype=part
    )
    if bias is not None:
        y = y.astype(_F32) + bias.astype(_F32)
    return y.astype(cfg.out_dtype)


def _backward_rows(cfg, plan, dya, xa, ka):
    """dx rows and the wgrad (summed over the batch axes) from dy's operand ``dya`` (both FP8
    copies), x's colwise operand ``xa`` and the kernel's rowwise ``ka``."""
    fa_d, fa_w = cfg.fast_accum_dgrad, cfg.fast_accum_wgrad
    if plan.x_seq:  # column: dx by GEMM -> RS; x's chunks go round for the wgrad
        outs, dx = _ring_steps(
            plan,
            xa,
            on_held=lambda xc, j: _wgrad(xc, _take_rows(plan, dya, j), fa_w),
            partial=lambda c: _dgrad(_take_rows(plan, dya, c), ka, _F32, fa_d),
            part_dtype=_partial_dtype(plan, dya, cfg.x_dtype),
        )
        dx = dx.astype(cfg.x_dtype)
    else:  # row: AG -> GEMM over dy's chunks, each chunk's wgrad against x's rows of it
        pairs, _ = _ring_steps(
            plan,
            dya,
            on_held=lambda d, j: (_dgrad(d, ka, cfg.x_dtype, fa_d), _wgrad(_take_rows(plan, xa, j), d, fa_w)),
        )
        dx, outs = _place(plan, [p[0] for p in pairs]), [p[1] for p in pairs]
    dk = functools.reduce(jnp.add, outs)
    if plan.batch:
        dk = jax.lax.psum(dk.astype(_partial_dtype(plan, xa, cfg.kernel_dtype)), plan.batch)
    return dx, dk.astype(cfg.kernel_dtype)


# ---------------------------------------------------------------------------------------------
# The sharded 2-D op: custom VJP outside, one shard_map per direction (as dense_sharded)
# ---------------------------------------------------------------------------------------------
def _fwd(cfg, plan: ShardPlan, x, k, bias, state):
    fp8 = cfg.recipe is not None

    def body(x, k, bias, sx, sk):
        x = x.reshape(-1, x.shape[-1])  # (b, s, K) or (b, S, K/n)
        if not fp8:
            return {"y": sh._rows_out(plan, _forward_rows(cfg, plan, x, k, bias))}
        axes = sh._plan_axes(plan)
        pre = sh._global_amaxes(cfg, {"x": x, "kernel": k}, axes)
        qx, _ = sh._quantize(cfg, "x", x, sx, pre.get("x"))
        qk, _ = sh._quantize(cfg, "kernel", k, sk, pre.get("kernel"))
        qx, qk = sh._reduce_amaxes(cfg, {"x": qx, "kernel": qk}, axes)
        rowwise = dataclasses.replace(qx, colwise_data=None, colwise_scale_inv=None)
        y = _forward_rows(cfg, plan, rowwise, qk, bias)
        res = (qx.colwise_data, qx.colwise_scale_inv, qk.data, qk.scale_inv)
        return {"y": sh._rows_out(plan, y), "res": res, "amax": (qx.amax, qk.amax)}

    out_specs = {"y": sh._act_spec(plan, "y")}
    if fp8:
        out_specs["res"] = (
            plan.spec("k_axes", "x_rows"),
            sh._scale_spec(cfg, plan, "x", colwise=True),
            plan.spec("k_axes", "n_axes"),
            sh._scale_spec(cfg, plan, "kernel", colwise=False),
        )
        out_specs["amax"] = (P(), P())
    args = dict(x=x, k=k, bias=bias, sx=ds.scale_of(state, "x"), sk=ds.scale_of(state, "kernel"))
    specs = dict(
        x=sh._act_spec(plan, "x"), k=plan.spec("k_axes", "n_axes"), bias=plan.spec("n_axes"), sx=P(), sk=P()
    )
    out = sh._call(plan, body, args, specs, out_specs)
    # BF16: the backward reads x and the kernel as they came.
    return out["y"], out.get("res", (x, None, k, None)), out.get("amax")


def _bwd(cfg, plan: ShardPlan, res, dy, sg):
    fp8 = cfg.recipe is not None
    with_bias = cfg.bias_dtype is not None

    def body(dy, xr, xs, kr, ks, sg):
        dy = dy.reshape(-1, dy.shape[-1])  # (b, S, N/n) or (b, s, N)
        # dbias fused into dy's quantization where dy's rows are whole; else summed in float32.
        fused = fp8 and with_bias and not plan.y_rows
        out = {}
        if fp8:
            axes = sh._plan_axes(plan)
            amax = sh._global_amaxes(cfg, {"grad": dy}, axes).get("grad")
            dya, db = sh._quantize(cfg, "grad", dy, sg, amax, dbias=fused)
            (dya,) = sh._reduce_amaxes(cfg, {"grad": dya}, axes)
            xa = sh._local_tensor(cfg, "x", xr, xs, colwise=True)
            ka = sh._local_tensor(cfg, "kernel", kr, ks, colwise=False)
            out["amax"] = dya.amax
        else:
            dya, db, xa, ka = dy, None, xr.reshape(-1, xr.shape[-1]), kr
        if with_bias and not fused:
            db = jnp.sum(dy.astype(_F32), axis=0)
        dx, out["dk"] = _backward_rows(cfg, plan, dya, xa, ka)
        out["dx"] = sh._rows_out(plan, dx)
        if with_bias:
            out["db"] = (jax.lax.psum(db, plan.y_rows) if plan.y_rows else db).astype(cfg.bias_dtype)
        return out

    xr, xs, kr, ks = res
    args = dict(dy=dy, xr=xr, xs=xs, kr=kr, ks=ks, sg=sg)
    if fp8:
        x_spec, xs_spec = plan.spec("k_axes", "x_rows"), sh._scale_spec(cfg, plan, "x", colwise=True)
        ks_spec = sh._scale_spec(cfg, plan, "kernel", colwise=False)
    else:
        x_spec, xs_spec, ks_spec = sh._act_spec(plan, "x"), None, None
    k_spec = plan.spec("k_axes", "n_axes")
    specs = dict(dy=sh._act_spec(plan, "y"), xr=x_spec, xs=xs_spec, kr=k_spec, ks=ks_spec, sg=P())
    out_specs = {"dx": sh._act_spec(plan, "x"), "dk": k_spec}
    if with_bias:
        out_specs["db"] = plan.spec("n_axes")
    if fp8:
        out_specs["amax"] = P()
    out = sh._call(plan, body, args, specs, out_specs)
    return out["dx"], out["dk"], out.get("db"), out.get("amax")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _collective_2d(cfg, plan, x, kernel, bias, state):
    return _fwd(cfg, plan, x, kernel, bias, state)[0]


def _collective_2d_fwd(cfg, plan, x, kernel, bias, state):
    y, res, amaxes = _fwd(cfg, plan, x, kernel, bias, state)
    return y, (res, amaxes, state)


def _collective_2d_bwd(cfg, plan, saved, dy):
    res, amaxes, state = saved
    dx, dk, db, ag = _bwd(cfg, plan, res, dy, ds.scale_of(state, "grad"))
    state_ct = None
    if cfg.delayed:
        state_ct = ds.advance_step(cfg.recipe, state, {"x": amaxes[0], "kernel": amaxes[1], "grad": ag})
    return dx, dk, db, state_ct


_collective_2d.defvjp(_collective_2d_fwd, _collective_2d_bwd)


def dense_overlapped(cfg, x, kernel, bias, state, tp_layout, lead: tuple):
    """lowbit.dense (``cfg`` its config; ``cfg.recipe`` None: BF16) with the sequence
    parallelism's collectives as rings: x whose leading axes are ``lead`` (its other axes
    contracted), kernel (contracted axes..., features...), bias (N,) or None. Returns y
    ``lead + features``, or None where no sequence parallelism is in context or the recipe is
    NVFP4 (the caller's path runs)."""
    if cfg.nvfp4:
        return None
    M, c = int(np.prod(lead)), x.ndim - len(lead)
    K = int(np.prod(kernel.shape[:c]))
    N, feat = int(np.prod(kernel.shape[c:])), tuple(kernel.shape[c:])
    plan = plan_overlap(cfg.recipe, M, K, N, tp_layout, lead, x.shape)
    if plan is None:
        return None
    y = _collective_2d(cfg, plan, x.reshape(plan.rows + (K,)), kernel.reshape(K, N), bias, state)
    return y.reshape(lead + feat)


__all__ = ["dense_overlapped", "plan_overlap", "sequence_parallel"]
