"""dense: y = x . kernel (+ bias) through quantized GEMMs, with a custom VJP.

Forward: x and the kernel are each quantized once, in both layouts (rowwise and the transposed
colwise copy); y = x_rowwise(M,K) . kernel_colwise(N,K)^T. Backward: dy is quantized once in both
layouts (E5M2 under HYBRID) with the bias gradient fused into that pass;
dgrad = dy_rowwise(M,N) . kernel_rowwise(K,N)^T and wgrad = x_colwise(K,M) . dy_colwise(N,M)^T.
The residuals are the quantized copies the backward needs, so nothing is quantized twice.

DelayedScaling: the encode scales come in through ``state`` and the updated amax histories and
scales go out as the cotangent of ``state`` (what Flax's ``_overwrite_with_gradient`` collection
expects), so a training step that overwrites the state with its "gradient" keeps it current.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops import sharded
from lowbit.ops.gemm import gemm
from lowbit.ops.quantize import quantize, quantize_dbias
from lowbit.quantize.scaling_modes import INPUT_DTYPES, ScalingMode
from lowbit.quantize.tensor import _prod
from lowbit.recipe import DelayedScaling, NVFP4BlockScaling, Recipe

ROLES = ("x", "kernel", "grad")
STATE_KEYS = tuple(k for r in ROLES for k in (f"{r}_amax_history", f"{r}_scale"))
_F32 = np.dtype(jnp.float32)
_BF16 = np.dtype(jnp.bfloat16)
_FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# DelayedScaling state
# ---------------------------------------------------------------------------------------------
def init_delayed_state(recipe: DelayedScaling) -> dict:
    """Fresh state of one dense: empty amax histories (L,) and unit scales (1,), float32."""
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"init_delayed_state needs a DelayedScaling recipe, got {type(recipe).__name__}")
    out = {}
    for r in ROLES:
        out[f"{r}_amax_history"] = jnp.zeros((recipe.amax_history_len,), jnp.float32)
        out[f"{r}_scale"] = jnp.ones((1,), jnp.float32)
    return out


def update_delayed_scale(history, scale, amax, recipe: DelayedScaling, q_dtype):
    """One step of DelayedScaling: push ``amax`` as the newest entry (index 0, the oldest falls
    off the end) and recompute the encode scale from the updated history.

    scale = (fp8_max / a) / 2**margin, a = max(history) ("max") or history[0] ("most_recent"),
    clamped to the largest float32; the previous scale is kept where a is 0 or not finite.
    """
    history = jnp.roll(history, 1).at[0].set(jnp.reshape(amax, ()).astype(jnp.float32))
    a = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    fmax = float(jnp.finfo(q_dtype).max)
    new = jnp.minimum((jnp.float32(fmax) / a) / jnp.float32(2.0 ** recipe.margin), jnp.float32(_FLT_MAX))
    ok = jnp.isfinite(a) & (a > 0)
    return history, jnp.where(ok, new, scale).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# The 2-D op and its VJP
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: Recipe
    out_dtype: Any
    x_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without bias
    fast_accum: bool

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)

    @property
    def nvfp4(self) -> bool:
        return isinstance(self.recipe, NVFP4BlockScaling)

    @property
    def rht(self) -> bool:
        return self.nvfp4 and not self.recipe.disable_rht

    @property
    def stochastic(self) -> bool:
        return self.nvfp4 and not self.recipe.disable_stochastic_rounding


def _gemm_dtype(d):
    """The GEMM writes BF16 or F32; other dtypes are cast from F32."""
    return d if np.dtype(d) in (_BF16, _F32) else _F32


def _quantize_role(cfg: _Config, role: str, state, **kw):
    r = cfg.recipe
    scale = state[f"{role}_scale"] if cfg.delayed else None
    return dict(scaling_mode=r.scaling_mode(role), q_dtype=r.q_dtype(role), scale=scale, layout="both", **kw)


def _forward(cfg: _Config, x, kernel, bias, state):
    qx = quantize(x, **_quantize_role(cfg, "x", state, rht=cfg.rht))
    qk = quantize(kernel, **_quantize_role(cfg, "kernel", state))
    if bias is not None and np.dtype(bias.dtype) not in (_BF16, _F32):
        bias = bias.astype(jnp.float32)  # exact for float16; the GEMM takes BF16/F32 biases
    y = gemm(qx, qk, bias, a_layout="rowwise", b_layout="colwise",
             out_dtype=_gemm_dtype(cfg.out_dtype), fast_accum=cfg.fast_accum)
    return y.astype(cfg.out_dtype), qx, qk


def _new_fwd_state(cfg: _Config, state, qx, qk):
    if not cfg.delayed:
        return None
    out = {}
    for role, qt in (("x", qx), ("kernel", qk)):
        out[f"{role}_amax_history"], out[f"{role}_scale"] = update_delayed_scale(
            state[f"{role}_amax_history"], state[f"{role}_scale"], qt.amax, cfg.recipe, cfg.recipe.q_dtype(role))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_2d(cfg: _Config, x, kernel, bias, state, rng):
    return _forward(cfg, x, kernel, bias, state)[0]


def _dense_2d_fwd(cfg: _Config, x, kernel, bias, state, rng):
    y, qx, qk = _forward(cfg, x, kernel, bias, state)
    # Keep only the copies the backward reads: x's colwise (wgrad), the kernel's rowwise (dgrad).
    qx_c = dataclasses.replace(qx, data=None, scale_inv=None)
    qk_r = dataclasses.replace(qk, colwise_data=None, colwise_scale_inv=None)
    grad_state = None
    if cfg.delayed:
        grad_state = {k: state[k] for k in ("grad_amax_history", "grad_scale")}
    return y, (qx_c, qk_r, _new_fwd_state(cfg, state, qx, qk), grad_state, rng)


def _dense_2d_bwd(cfg: _Config, res, dy):
    qx_c, qk_r, fwd_state, grad_state, rng = res
    if cfg.stochastic and rng is None:
        raise ValueError(
            "dense: NVFP4BlockScaling rounds gradients stochastically and needs an rng key "
            "(Flax: pass rngs={'sr_rng': key} to apply; or NVFP4BlockScaling(disable_stochastic_rounding=True))")
    kw = dict(rht=cfg.rht, rng_key=rng if cfg.stochastic else None)
    q_kw = _quantize_role(cfg, "grad", grad_state, **kw)
    if cfg.bias_dtype is not None:
        mode, q = q_kw.pop("scaling_mode"), q_kw.pop("q_dtype")
        qdy, dbias = quantize_dbias(dy, mode, q, **q_kw)
        dbias = dbias.astype(cfg.bias_dtype)
    else:
        qdy, dbias = quantize(dy, **q_kw), None
    dx = gemm(qdy, qk_r, a_layout="rowwise", b_layout="rowwise", out_dtype=_gemm_dtype(cfg.x_dtype))
    dk = gemm(qx_c, qdy, a_layout="colwise", b_layout="colwise", out_dtype=_gemm_dtype(cfg.kernel_dtype))
    state_ct = None
    if cfg.delayed:
        h, s = update_delayed_scale(grad_state["grad_amax_history"], grad_state["grad_scale"], qdy.amax,
                                    cfg.recipe, cfg.recipe.q_dtype("grad"))
        state_ct = dict(fwd_state, grad_amax_history=h, grad_scale=s)
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), dbias, state_ct, None


_dense_2d.defvjp(_dense_2d_fwd, _dense_2d_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry: argument checks, dimension numbers, reshapes
# ---------------------------------------------------------------------------------------------
def _check_float(a, name):
    a = jnp.asarray(a)
    if np.dtype(a.dtype) not in INPUT_DTYPES:
        raise TypeError(f"dense: {name} must be float32, bfloat16 or float16, got {np.dtype(a.dtype).name}")
    return a


def _normalize_dims(contracting_dims, x_ndim: int, k_ndim: int):
    if contracting_dims is None:
        return (x_ndim - 1,), (0,)
    try:
        lhs, rhs = contracting_dims
        lhs = tuple(int(d) for d in (lhs if isinstance(lhs, (tuple, list)) else (lhs,)))
        rhs = tuple(int(d) for d in (rhs if isinstance(rhs, (tuple, list)) else (rhs,)))
    except (TypeError, ValueError):
        raise ValueError(f"dense: contracting_dims must be ((x dims...), (kernel dims...)), got {contracting_dims!r}") from None
    lhs = tuple(d + x_ndim if d < 0 else d for d in lhs)
    rhs = tuple(d + k_ndim if d < 0 else d for d in rhs)
    if not lhs or len(lhs) != len(rhs):
        raise ValueError(f"dense: contracting_dims must pair up at least one x dim with one kernel dim, got {contracting_dims!r}")
    if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
        raise ValueError(f"dense: contracting_dims repeat a dimension: {contracting_dims!r}")
    if any(not 0 <= d < x_ndim for d in lhs) or any(not 0 <= d < k_ndim for d in rhs):
        raise ValueError(f"dense: contracting_dims {contracting_dims!r} are out of range for x of rank {x_ndim} "
                         f"and kernel of rank {k_ndim}")
    if sorted(lhs) != list(range(x_ndim - len(lhs), x_ndim)):
        raise ValueError(
            f"dense: x must be contracted over its trailing axes (got x dims {lhs} of rank {x_ndim}); "
            "move the contracted axes to the end of x first")
    if len(rhs) == k_ndim:
        raise ValueError("dense: the kernel needs at least one non-contracted (output feature) axis")
    return lhs, rhs


def _block_multiple(recipe: Recipe) -> int:
    modes = {recipe.scaling_mode(r) for r in ROLES}
    if ScalingMode.MXFP8_1D_SCALING in modes:
        return 32
    if any(m.is_nvfp4 for m in modes):
        return 16
    return 1


def _check_state(state, recipe: DelayedScaling):
    if state is None:
        raise ValueError("dense: DelayedScaling needs state=lowbit.init_delayed_state(recipe) (the amax histories and "
                         "scales; Flax modules keep it in the '_overwrite_with_gradient' collection)")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"dense: state is missing {missing}")
    L = recipe.amax_history_len
    for k in STATE_KEYS:
        want = (L,) if k.endswith("history") else (1,)
        v = state[k]
        if tuple(v.shape) != want or np.dtype(v.dtype) != _F32:
            raise ValueError(f"dense: state[{k!r}] must be float32 of shape {want}, got {v.dtype} {tuple(v.shape)}")
    return {k: state[k] for k in STATE_KEYS}


def dense(
    x,
    kernel,
    bias=None,
    *,
    recipe: Optional[Recipe] = None,
    contracting_dims: Optional[tuple[Sequence[int], Sequence[int]]] = None,
    state: Optional[dict] = None,
    rng: Optional[jax.Array] = None,
    out_dtype=None,
    fast_accum: bool = True,
) -> jax.Array:
    """Quantized ``x . kernel (+ bias)`` with gradients through quantized GEMMs.

    Args:
      x: ``(..., K1..Kc)``; the contracted axes are x's trailing axes.
      kernel: ``(kernel axes)``: the axes paired with x's contracted ones, plus the output
        feature axes ``F...`` (in the kernel's order).
      bias: optional, shape ``F...`` (or flat ``(prod F,)``).
      recipe: a lowbit recipe; default: the one of the enclosing :func:`lowbit.autocast`; with
        neither, an ordinary unquantized ``lax.dot_general``.
      contracting_dims: ``((x dims), (kernel dims))``, default ``((x.ndim-1,), (0,))``.
      state: DelayedScaling only: ``lowbit.init_delayed_state(recipe)``-shaped dict; its
        "gradient" is the updated state.
      rng: NVFP4 with stochastic rounding: a PRNG key for the gradient's rounding.
      out_dtype: default ``jnp.result_type(x, kernel)``.
      fast_accum: FP8 GPU GEMMs: fast accumulation for the forward GEMM (not the gradients).

    Returns:
      ``x.shape[:-c] + F...``.
    """
    from lowbit.autocast import get_recipe

    x = _check_float(x, "x")
    kernel = _check_float(kernel, "kernel")
    lhs, rhs = _normalize_dims(contracting_dims, x.ndim, kernel.ndim)
    for i, j in zip(lhs, rhs):
        if x.shape[i] != kernel.shape[j]:
            raise ValueError(f"dense: contraction size mismatch: x axis {i} has {x.shape[i]}, kernel axis {j} "
                             f"has {kernel.shape[j]} (x {tuple(x.shape)}, kernel {tuple(kernel.shape)})")
    out_dtype = np.dtype(out_dtype if out_dtype is not None else jnp.result_type(x, kernel))
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(f"dense: out_dtype must be float32, bfloat16 or float16, got {out_dtype.name}")
    if recipe is None:
        recipe = get_recipe()
    # The kernel as (contracted axes in x's order, then the feature axes).
    c = len(lhs)
    order = [j for _, j in sorted(zip(lhs, rhs))] + [d for d in range(kernel.ndim) if d not in rhs]
    if order != list(range(kernel.ndim)):
        kernel = jnp.transpose(kernel, order)
    lead, feat = tuple(x.shape[: x.ndim - c]), tuple(kernel.shape[c:])
    M, K, N = _prod(lead), _prod(x.shape[x.ndim - c:]), _prod(feat)
    if bias is not None:
        bias = _check_float(bias, "bias")
        if bias.shape not in (feat, (N,)):
            raise ValueError(f"dense: bias must have shape {feat} (the kernel's feature axes), got {tuple(bias.shape)}")
        bias = bias.reshape(N)

    if recipe is None:
        dt = jnp.result_type(x, kernel)
        y = jax.lax.dot_general(x.astype(dt), kernel.astype(dt),
                                ((tuple(range(x.ndim - c, x.ndim)), tuple(range(c))), ((), ())),
                                preferred_element_type=out_dtype)
        return (y + bias.reshape(feat).astype(out_dtype)) if bias is not None else y.astype(out_dtype)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"dense: recipe must be a lowbit recipe (DelayedScaling, Float8CurrentScaling, "
                        f"MXFP8BlockScaling, NVFP4BlockScaling), got {type(recipe).__name__}")

    b = _block_multiple(recipe)
    if K % b or N % b:
        raise ValueError(f"dense: {type(recipe).__name__} needs the contraction size K and the output size N to be "
                         f"multiples of {b}; got K={K}, N={N}")
    if isinstance(recipe, DelayedScaling):
        state = _check_state(state, recipe)
    elif state is not None:
        raise ValueError(f"dense: state is only used with DelayedScaling, not {type(recipe).__name__}")
    if rng is not None and not isinstance(recipe, NVFP4BlockScaling):
        rng = None  # only NVFP4's stochastic rounding draws random bits

    cfg = _Config(recipe=recipe, out_dtype=out_dtype, x_dtype=np.dtype(x.dtype),
                  kernel_dtype=np.dtype(kernel.dtype), bias_dtype=None if bias is None else np.dtype(bias.dtype),
                  fast_accum=bool(fast_accum))
    x2 = x.reshape(M, K)
    # Block-scaled colwise copies need the token count in whole blocks: zero rows change no
    # result (nor any amax, nor the bias gradient), so pad and slice.
    pad = (-M) % b
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    # Under a MeshResource and a mesh in context this runs per shard with global scales.
    y2 = sharded.dense_2d(_dense_2d, cfg, x2, kernel.reshape(K, N), bias, state, rng)
    if pad:
        y2 = y2[:M]
    return y2.reshape(lead + feat)
