"""dense under a mesh: the 2-D op of lowbit.ops.dense run per shard through shard_map.

The FFI calls have no partitioning rule, so without this XLA gathers their operands. Here the
active MeshResource names the axes: the batch axes (dp, fsdp) split M; tp splits the kernel's N
("column", the default) or K ("row", see lowbit.sharding.tensor_parallel_layout). Per shard:

* per-tensor scales stay global: a tensor's amax is the pmax of the shard amaxes; current scaling
  quantizes with scale_from_amax(global amax) through the delayed path (the same encode);
* a GEMM whose contraction is split (y over K in "row", dgrad over N in "column", wgrad and
  dbias over M) is computed in float32 per shard and psum'd, then cast: the order of that sum
  differs from one device's, so those results match to float32 rounding, not bit for bit.

NVFP4 (its per-tensor scale comes from the amax inside the kernel) and shapes whose shards would
split a scaling block fall back to the unsharded op.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lowbit.ops.gemm import gemm
from lowbit.ops.quantize import quantize, quantize_dbias
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.quantize.tensor import ScaledTensor
from lowbit.sharding import current_mesh, global_mesh_resource, tp_layout

_F32 = np.dtype(jnp.float32)
_FLT_MAX = float(np.finfo(np.float32).max)


def _shard_map(f, mesh, in_specs, out_specs):
    # Collectives inside make every replicated output truly replicated; the FFI calls carry no
    # varying-axes rules, so the check is off.
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(f, mesh, in_specs, out_specs, check_rep=False)


@dataclasses.dataclass(frozen=True)
class _Plan:
    mesh: Any
    batch: tuple          # mesh axes splitting M
    k_axes: tuple         # mesh axes splitting K
    n_axes: tuple         # mesh axes splitting N

    @staticmethod
    def _entry(axes):
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    def spec(self, *dims) -> P:
        return P(*(self._entry(getattr(self, d)) for d in dims))


def _axis_size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def plan_for(cfg, M: int, K: int, N: int) -> Optional[_Plan]:
    """The shard plan for a (M, K) x (K, N) dense, or None to run unsharded."""
    res = global_mesh_resource()
    if res.dp_resource is None and res.fsdp_resource is None and res.tp_resource is None:
        return None
    mesh = current_mesh()
    if mesh is None or cfg.nvfp4:
        return None
    names = tuple(mesh.axis_names)
    for a in (res.dp_resource, res.fsdp_resource, res.tp_resource):
        if a is not None and a not in names:
            raise ValueError(f"lowbit: MeshResource names mesh axis {a!r}, but the mesh in context has axes {names}")
    get_abstract = getattr(jax.sharding, "get_abstract_mesh", None)
    manual = set(getattr(get_abstract(), "manual_axes", ()) or ()) if get_abstract else set()
    used = [a for a in (res.dp_resource, res.fsdp_resource, res.tp_resource) if a is not None]
    if manual & set(used):
        return None  # already inside a shard_map over these axes: the caller handles them
    batch = tuple(a for a in (res.dp_resource, res.fsdp_resource) if a is not None and mesh.shape[a] > 1)
    tp = (res.tp_resource,) if res.tp_resource is not None and mesh.shape[res.tp_resource] > 1 else ()
    row = tp_layout() == "row"
    plan = _Plan(mesh, batch, tp if row else (), () if row else tp)
    if not (plan.batch or plan.k_axes or plan.n_axes):
        return None
    # Every shard must hold whole scaling blocks (MXFP8: 32 along each quantized axis).
    blk = 32 if ScalingMode.MXFP8_1D_SCALING in {cfg.recipe.scaling_mode(r) for r in ("x", "kernel", "grad")} else 1
    for size, axes in ((M, plan.batch), (K, plan.k_axes), (N, plan.n_axes)):
        n = _axis_size(mesh, axes)
        if size % n or (size // n) % blk:
            return None
    return plan


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


def _quantize(cfg, role, v, scale, axes, dbias=False):
    """Quantizes one shard in both layouts with the global per-tensor scale; amax is global."""
    mode, q = cfg.recipe.scaling_mode(role), cfg.recipe.q_dtype(role)
    if mode == ScalingMode.CURRENT_TENSOR_SCALING:
        scale = _scale_from_amax(_pmax(_local_amax(v), axes), float(jnp.finfo(q).max))
        mode = ScalingMode.DELAYED_TENSOR_SCALING
    kw = dict(scale=scale, layout="both")
    if dbias:
        qt, db = quantize_dbias(v, mode, q, **kw)
    else:
        qt, db = quantize(v, mode, q, **kw), None
    if mode.is_tensor_scaling:
        qt = dataclasses.replace(qt, amax=_pmax(qt.amax, axes))
    return qt, db


def _gemm_dtype(d):
    return d if np.dtype(d) in (np.dtype(jnp.bfloat16), _F32) else _F32


def _mm(a, b, a_layout, b_layout, out_dtype, sum_axes, bias=None, fast_accum=False):
    """a . b^T (+ bias); a split contraction is summed over ``sum_axes`` in float32."""
    if not sum_axes:
        y = gemm(a, b, bias, a_layout=a_layout, b_layout=b_layout, out_dtype=_gemm_dtype(out_dtype),
                 fast_accum=fast_accum)
        return y.astype(out_dtype)
    y = gemm(a, b, a_layout=a_layout, b_layout=b_layout, out_dtype=_F32, fast_accum=fast_accum)
    y = jax.lax.psum(y, sum_axes)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _bias32(bias):
    if bias is not None and np.dtype(bias.dtype) not in (np.dtype(jnp.bfloat16), _F32):
        return bias.astype(jnp.float32)  # as the unsharded op: the GEMM takes BF16/F32 biases
    return bias


def _call(plan, body, args: dict, specs: dict, out_specs):
    """shard_map over the non-None entries of ``args`` (None stays None inside)."""
    keys = [k for k, v in args.items() if v is not None]

    def inner(*vals):
        return body(**dict(zip(keys, vals)), **{k: None for k in args if k not in keys})

    return _shard_map(inner, plan.mesh, tuple(specs[k] for k in keys), out_specs)(*(args[k] for k in keys))


def _amax_axes(plan, *dims):
    return tuple(a for d in dims for a in getattr(plan, d))


# ---------------------------------------------------------------------------------------------
# The sharded 2-D op: custom VJP outside, one shard_map per direction
# ---------------------------------------------------------------------------------------------
def _fwd(cfg, plan: _Plan, x, k, bias, state):
    def body(x, k, bias, sx, sk):
        qx, _ = _quantize(cfg, "x", x, sx, _amax_axes(plan, "batch", "k_axes"))
        qk, _ = _quantize(cfg, "kernel", k, sk, _amax_axes(plan, "k_axes", "n_axes"))
        y = _mm(qx, qk, "rowwise", "colwise", cfg.out_dtype, plan.k_axes, bias, cfg.fast_accum)
        return y, (qx.colwise_data, qx.colwise_scale_inv, qk.data, qk.scale_inv), (qx.amax, qk.amax)

    tensor = cfg.recipe.scaling_mode("x").is_tensor_scaling
    x_res = plan.spec("k_axes", "batch")
    res_specs = (x_res, P() if tensor else x_res, plan.spec("k_axes", "n_axes"),
                 P() if cfg.recipe.scaling_mode("kernel").is_tensor_scaling else plan.spec("k_axes", "n_axes"))
    sx = state["x_scale"] if cfg.delayed else None
    sk = state["kernel_scale"] if cfg.delayed else None
    args = dict(x=x, k=k, bias=_bias32(bias), sx=sx, sk=sk)
    specs = dict(x=plan.spec("batch", "k_axes"), k=plan.spec("k_axes", "n_axes"), bias=plan.spec("n_axes"),
                 sx=P(), sk=P())
    y, res, amaxes = _call(plan, body, args, specs, (plan.spec("batch", "n_axes"), res_specs, (P(), P())))
    return y, res, amaxes


def _local_tensor(cfg, role, data, s_inv, colwise):
    """A per-shard ScaledTensor from one copy's arrays (2-D: rowwise (R, C), colwise (C, R))."""
    mode, q = cfg.recipe.scaling_mode(role), cfg.recipe.q_dtype(role)
    if mode == ScalingMode.CURRENT_TENSOR_SCALING:
        mode = ScalingMode.DELAYED_TENSOR_SCALING
    r, c = (data.shape[1], data.shape[0]) if colwise else data.shape
    dq = cfg.x_dtype if role == "x" else cfg.kernel_dtype
    return ScaledTensor(data=None if colwise else data, scale_inv=None if colwise else s_inv,
                        colwise_data=data if colwise else None, colwise_scale_inv=s_inv if colwise else None,
                        amax=jnp.zeros((1,), jnp.float32), global_scale_inv=None, scaling_mode=mode,
                        q_dtype=np.dtype(q), dq_dtype=np.dtype(dq), shape=(r, c), flatten_axis=1)


def _bwd(cfg, plan: _Plan, res, dy, grad_scale):
    def body(dy, xc, xcs, kr, krs, sg):
        # Split rows: sum dbias in float32 here (the fused one rounds each partial to dy's dtype).
        fused = cfg.bias_dtype is not None and not plan.batch
        qdy, db = _quantize(cfg, "grad", dy, sg, _amax_axes(plan, "batch", "n_axes"), dbias=fused)
        if cfg.bias_dtype is not None and plan.batch:
            db = jnp.sum(dy.astype(jnp.float32), axis=0)
        qx = _local_tensor(cfg, "x", xc, xcs, colwise=True)
        qk = _local_tensor(cfg, "kernel", kr, krs, colwise=False)
        dx = _mm(qdy, qk, "rowwise", "rowwise", cfg.x_dtype, plan.n_axes)
        dk = _mm(qx, qdy, "colwise", "colwise", cfg.kernel_dtype, plan.batch)
        if db is not None:
            db = (jax.lax.psum(db, plan.batch) if plan.batch else db).astype(cfg.bias_dtype)
        return dx, dk, db, qdy.amax

    tensor = cfg.recipe.scaling_mode("x").is_tensor_scaling
    k_tensor = cfg.recipe.scaling_mode("kernel").is_tensor_scaling
    xc, xcs, kr, krs = res
    args = dict(dy=dy, xc=xc, xcs=xcs, kr=kr, krs=krs, sg=grad_scale)
    specs = dict(dy=plan.spec("batch", "n_axes"), xc=plan.spec("k_axes", "batch"),
                 xcs=P() if tensor else plan.spec("k_axes", "batch"), kr=plan.spec("k_axes", "n_axes"),
                 krs=P() if k_tensor else plan.spec("k_axes", "n_axes"), sg=P())
    db_spec = plan.spec("n_axes") if cfg.bias_dtype is not None else None
    outs = (plan.spec("batch", "k_axes"), plan.spec("k_axes", "n_axes"), db_spec, P())
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
    from lowbit.ops.dense import update_delayed_scale

    y, res, (ax, ak) = _fwd(cfg, plan, x, kernel, bias, state)
    fwd_state, grad_state = None, None
    if cfg.delayed:
        fwd_state = {}
        for role, a in (("x", ax), ("kernel", ak)):
            fwd_state[f"{role}_amax_history"], fwd_state[f"{role}_scale"] = update_delayed_scale(
                state[f"{role}_amax_history"], state[f"{role}_scale"], a, cfg.recipe, cfg.recipe.q_dtype(role))
        grad_state = {k: state[k] for k in ("grad_amax_history", "grad_scale")}
    return y, (res, fwd_state, grad_state)


def _sharded_2d_bwd(cfg, plan, saved, dy):
    from lowbit.ops.dense import update_delayed_scale

    res, fwd_state, grad_state = saved
    dx, dk, db, ag = _bwd(cfg, plan, res, dy, grad_state["grad_scale"] if cfg.delayed else None)
    state_ct = None
    if cfg.delayed:
        h, s = update_delayed_scale(grad_state["grad_amax_history"], grad_state["grad_scale"], ag,
                                    cfg.recipe, cfg.recipe.q_dtype("grad"))
        state_ct = dict(fwd_state, grad_amax_history=h, grad_scale=s)
    return dx, dk, db, state_ct


_sharded_2d.defvjp(_sharded_2d_fwd, _sharded_2d_bwd)


def dense_2d(unsharded, cfg, x, kernel, bias, state, rng):
    """``unsharded(cfg, x, kernel, bias, state, rng)`` (lowbit.ops.dense._dense_2d), run per shard
    when a MeshResource and a mesh are active and the shapes split evenly."""
    M, K = x.shape
    plan = plan_for(cfg, M, K, kernel.shape[1])
    if plan is None:
        return unsharded(cfg, x, kernel, bias, state, rng)
    return _sharded_2d(cfg, plan, x, kernel, bias, state)
