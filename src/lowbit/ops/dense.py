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

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike, DTypeLike

from lowbit import delayed_scaling as ds
from lowbit.autocast import get_recipe
from lowbit.ops import collective_dense, dense_sharded
from lowbit.ops.accumulation import config_fields
from lowbit.ops.fused_quantize import QuantizeSpec, block_fusion_enabled, parse_quantize_spec
from lowbit.ops.gemm import gemm, gemm_bias, gemm_out_dtype
from lowbit.ops.nonfinite import poison_nonfinite
from lowbit.ops.quantize import quantize, quantize_dbias, quantize_parts
from lowbit.quantization.checks import as_dtype, check_input
from lowbit.quantization.scaling_modes import INPUT_DTYPES, ScalingMode
from lowbit.quantization.tensor import prod
from lowbit.recipe import DelayedScaling, Float8BlockScaling, NVFP4BlockScaling, Recipe
from lowbit.sharding import check_tp_layout, plan_dense


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
    # FP8 backward GEMMs: fast accumulation instead of split (2x) accumulation
    # (ops/accumulation.py: TransformerEngine's switches; fast unless they say split).
    fast_accum_dgrad: bool = True
    fast_accum_wgrad: bool = True
    # The name of the quantized residuals (quantized_checkpoint_name), None: unnamed.
    checkpoint_name: Optional[str] = None

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)

    @property
    def nvfp4(self) -> bool:
        return isinstance(self.recipe, NVFP4BlockScaling)

    @property
    def fp8_block(self) -> bool:
        return isinstance(self.recipe, Float8BlockScaling)

    @property
    def rht(self) -> bool:
        return self.nvfp4 and not self.recipe.disable_rht

    @property
    def stochastic(self) -> bool:
        return self.nvfp4 and not self.recipe.disable_stochastic_rounding


_QUANTIZED_NAME = contextvars.ContextVar("lowbit_quantized_checkpoint_name", default=None)


@contextlib.contextmanager
def quantized_checkpoint_name(name: Optional[str]):
    """Within this context, the quantized copies that ``dense`` (and the fused MLP and split
    projections) keep for their backward are named ``name`` with
    ``jax.ad_checkpoint.checkpoint_name``, so a remat policy such as ``save_only_these_names``
    can keep them (TransformerEngine's ``quantization_checkpoint_name``). Read when an op is
    traced; None: unnamed. Sharded dense does not name its residuals."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"quantized_checkpoint_name: name must be a str or None, got {name!r}")
    token = _QUANTIZED_NAME.set(name)
    try:
        yield
    finally:
        _QUANTIZED_NAME.reset(token)


def make_config(recipe, out_dtype, x_dtype, kernel, bias, fast_accum: bool) -> _Config:
    """The dense configuration; the accumulation of each FP8 GEMM as TE's environment says
    (``fast_accum=False`` keeps split accumulation in the forward GEMM whatever it says)."""
    return _Config(
        recipe=recipe,
        out_dtype=out_dtype,
        x_dtype=np.dtype(x_dtype),
        kernel_dtype=np.dtype(kernel.dtype),
        bias_dtype=None if bias is None else np.dtype(bias.dtype),
        **config_fields(fast_accum),
        checkpoint_name=_QUANTIZED_NAME.get(),
    )


def tensor_scaled(recipe) -> bool:
    """Whether ``recipe`` scales x, kernel and gradient per tensor (DelayedScaling,
    Float8CurrentScaling): the recipes the fused kernels quantize for."""
    return isinstance(recipe, Recipe) and all(recipe.scaling_mode(r).is_tensor_scaling for r in ds.ROLES)


def quantize_kwargs(cfg: _Config, role: str, state, **kw):
    """``lowbit.quantize`` keyword arguments of ``role`` ("x", "kernel", "grad"), both layouts."""
    r = cfg.recipe
    if cfg.fp8_block:  # per-role QParams: power-of-two scales, amax floor
        qp = r.qparams(role)
        kw = dict(kw, power_2_scale=bool(qp.power_2_scale), amax_epsilon=float(qp.amax_epsilon))
    return dict(
        scaling_mode=r.scaling_mode(role),
        q_dtype=r.q_dtype(role),
        scale=ds.scale_of(state, role),
        layout="both",
        **kw,
    )


def fused_spec(cfg: _Config, state, role: str, dtype) -> QuantizeSpec:
    """A fused kernel's quantize spec (norm, activation): what ``dense`` quantizes ``role`` with
    (FP8 block scaling: with the role's power-of-two and amax-floor options)."""
    kw = quantize_kwargs(cfg, role, state)
    block = (kw.get("power_2_scale", False), kw.get("amax_epsilon", 0.0))
    return parse_quantize_spec((kw["scaling_mode"], kw["q_dtype"], kw["scale"], kw["layout"], *block), dtype)


def kernel_fused(recipe) -> bool:
    """Whether the norm and activation kernels write ``recipe``'s FP8 operands themselves: tensor
    scaling, or FP8 block scaling (Float8BlockScaling) unless LOWBIT_BLOCK_FUSION=0."""
    return tensor_scaled(recipe) or (isinstance(recipe, Float8BlockScaling) and block_fusion_enabled())


def quantize_input(cfg: _Config, x, state):
    """x's FP8 copies (both layouts) under the recipe's "x" role."""
    return poison_nonfinite(quantize(x, **quantize_kwargs(cfg, "x", state, rht=cfg.rht)))


def forward_quantized(cfg: _Config, qx, kernel, bias, state, parts: int = 1):
    """``y = qx . kernel (+ bias)`` from x's quantized copies; returns y and the kernel's copies.
    With ``parts`` > 1, y is the tuple of its ``parts`` column blocks (``gemm(parts=)``)."""
    qk = poison_nonfinite(quantize(kernel, **quantize_kwargs(cfg, "kernel", state)))
    y = gemm(
        qx,
        qk,
        gemm_bias(bias),
        a_layout="rowwise",
        b_layout="colwise",
        out_dtype=gemm_out_dtype(cfg.out_dtype),
        fast_accum=cfg.fast_accum,
        parts=parts,
    )
    if parts > 1:
        return tuple(o.astype(cfg.out_dtype) for o in y), qk
    return y.astype(cfg.out_dtype), qk


def backward_residuals(qx, qk, name: Optional[str] = None):
    """The copies the backward reads: x's colwise (wgrad), the kernel's rowwise (dgrad); each
    leaf named ``name`` for remat policies when given."""
    res = (
        dataclasses.replace(qx, data=None, scale_inv=None),
        dataclasses.replace(qk, colwise_data=None, colwise_scale_inv=None),
    )
    return res if name is None else checkpoint_name(res, name)


def quantize_grad(cfg: _Config, dy, state, rng):
    """dy's FP8 copies under the "grad" role, and the bias gradient (None without bias). ``dy``
    may be a tuple of the parts of its last axis: they are quantized where they lie
    (``quantize_parts``, tensor and FP8 block scaling), not concatenated first."""
    with_bias = cfg.bias_dtype is not None
    if isinstance(dy, tuple):
        qdy, dbias = quantize_parts(dy, **quantize_kwargs(cfg, "grad", state), dbias=with_bias)
        return poison_nonfinite(qdy), None if dbias is None else dbias.astype(cfg.bias_dtype)
    if cfg.stochastic and rng is None:
        raise ValueError(
            "dense: NVFP4BlockScaling rounds gradients stochastically and needs an rng key "
            "(Flax: pass rngs={'sr_rng': key} to apply; "
            "or NVFP4BlockScaling(disable_stochastic_rounding=True))"
        )
    kw = dict(rht=cfg.rht, rng_key=rng if cfg.stochastic else None)
    q_kw = quantize_kwargs(cfg, "grad", state, **kw)
    if cfg.bias_dtype is None:
        return poison_nonfinite(quantize(dy, **q_kw)), None
    mode, q = q_kw.pop("scaling_mode"), q_kw.pop("q_dtype")
    qdy, dbias = quantize_dbias(dy, mode, q, **q_kw)
    return poison_nonfinite(qdy), dbias.astype(cfg.bias_dtype)


def backward_quantized(cfg: _Config, qx_c, qk_r, state, qdy):
    """dx, dkernel and (DelayedScaling) the state's cotangent from dy's quantized copies."""
    dx = gemm(
        qdy,
        qk_r,
        a_layout="rowwise",
        b_layout="rowwise",
        out_dtype=gemm_out_dtype(cfg.x_dtype),
        fast_accum=cfg.fast_accum_dgrad,
    )
    dk = gemm(
        qx_c,
        qdy,
        a_layout="colwise",
        b_layout="colwise",
        out_dtype=gemm_out_dtype(cfg.kernel_dtype),
        fast_accum=cfg.fast_accum_wgrad,
    )
    state_ct = None
    if cfg.delayed:
        state_ct = ds.advance_step(cfg.recipe, state, {"x": qx_c.amax, "kernel": qk_r.amax, "grad": qdy.amax})
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), state_ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_2d(cfg: _Config, x, kernel, bias, state, rng):
    return forward_quantized(cfg, quantize_input(cfg, x, state), kernel, bias, state)[0]


def _dense_2d_fwd(cfg: _Config, x, kernel, bias, state, rng):
    qx = quantize_input(cfg, x, state)
    y, qk = forward_quantized(cfg, qx, kernel, bias, state)
    return y, (*backward_residuals(qx, qk, cfg.checkpoint_name), state, rng)


def _dense_2d_bwd(cfg: _Config, res, dy):
    qx_c, qk_r, state, rng = res
    qdy, dbias = quantize_grad(cfg, dy, state, rng)
    dx, dk, state_ct = backward_quantized(cfg, qx_c, qk_r, state, qdy)
    return dx, dk, dbias, state_ct, None


_dense_2d.defvjp(_dense_2d_fwd, _dense_2d_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry: argument checks, dimension numbers, reshapes
# ---------------------------------------------------------------------------------------------
def _normalize_dims(contracting_dims, x_ndim: int, k_ndim: int):
    if contracting_dims is None:
        contracting_dims = ((x_ndim - 1,), (0,))
    try:
        lhs, rhs = contracting_dims
        lhs = tuple(int(d) for d in (lhs if isinstance(lhs, (tuple, list)) else (lhs,)))
        rhs = tuple(int(d) for d in (rhs if isinstance(rhs, (tuple, list)) else (rhs,)))
    except (TypeError, ValueError):
        raise ValueError(
            f"dense: contracting_dims must be ((x dims...), (kernel dims...)), got {contracting_dims!r}"
        ) from None
    lhs = tuple(d + x_ndim if d < 0 else d for d in lhs)
    rhs = tuple(d + k_ndim if d < 0 else d for d in rhs)
    if not lhs or len(lhs) != len(rhs):
        raise ValueError(
            f"dense: contracting_dims must pair up at least one x dim with one kernel dim, "
            f"got {contracting_dims!r}"
        )
    if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
        raise ValueError(f"dense: contracting_dims repeat a dimension: {contracting_dims!r}")
    if any(not 0 <= d < x_ndim for d in lhs) or any(not 0 <= d < k_ndim for d in rhs):
        raise ValueError(
            f"dense: contracting_dims {contracting_dims!r} are out of range for x of rank {x_ndim} "
            f"and kernel of rank {k_ndim}"
        )
    if sorted(lhs) != list(range(x_ndim - len(lhs), x_ndim)):
        raise ValueError(
            f"dense: x must be contracted over its trailing axes (got x dims {lhs} of rank {x_ndim}); "
            "move the contracted axes to the end of x first"
        )
    if len(rhs) == k_ndim:
        raise ValueError(
            f"dense: kernel of rank {k_ndim} needs at least one axis outside contracting_dims "
            f"{contracting_dims!r} (its output features)"
        )
    return lhs, rhs


def _block_multiple(recipe: Recipe) -> int:
    modes = {recipe.scaling_mode(r) for r in ds.ROLES}
    if ScalingMode.MXFP8_1D_SCALING in modes:
        return 32
    if any(m.is_nvfp4 for m in modes):
        return 16
    return 1


def dense(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: Optional[ArrayLike] = None,
    *,
    recipe: Optional[Recipe] = None,
    contracting_dims: Optional[tuple[Sequence[int], Sequence[int]]] = None,
    state: Optional[dict] = None,
    rng: Optional[jax.Array] = None,
    out_dtype: Optional[DTypeLike] = None,
    fast_accum: bool = True,
    tp_layout: Optional[str] = None,
    tp_overlap: bool = False,
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
      fast_accum: FP8 GPU GEMMs: False keeps split accumulation in the forward GEMM. Otherwise
        every GEMM accumulates as TransformerEngine's environment says: fast (TE 2.20's
        default) unless ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1`` or a per-GEMM
        ``NVTE_JAX_FP8_2X_ACC_<FPROP|DGRAD|WGRAD>=1`` (lowbit.ops.accumulation).
      tp_layout: under a MeshResource with ``tp_resource`` (lowbit.sharding), how tp splits the
        kernel: "column" (its output features; None: the default) or "row" (its contracted
        axes, y summed over tp: the second GEMM of a column/row pair, as an MLP's). Under
        ``tpsp_resource`` (sequence parallelism) "column" takes x split along the sequence (axis
        1, gathered in FP8) and "row" leaves y so (reduce-scattered).
      tp_overlap: under ``tpsp_resource``, that gather and reduce-scatter (and the backward's)
        run as rings of ppermute steps overlapped with the GEMM of each sequence chunk
        (lowbit.ops.collective_dense; BF16 too); a ValueError where x's sequence does not split
        evenly over the tp axis. Without sequence parallelism it changes nothing.

    Returns:
      ``x.shape[:-c] + F...``.
    """
    x = check_input(x, "dense: x")
    kernel = check_input(kernel, "dense: kernel")
    check_tp_layout(tp_layout, "dense")
    for name, a, need in (("x", x, "(..., K)"), ("kernel", kernel, "(K, N...)")):
        if a.ndim < 1:  # a scalar has no axis to contract
            raise ValueError(f"dense: {name} must have shape {need} (at least one axis), got a rank-0 array")
    lhs, rhs = _normalize_dims(contracting_dims, x.ndim, kernel.ndim)
    for i, j in zip(lhs, rhs):
        if x.shape[i] != kernel.shape[j]:
            raise ValueError(
                f"dense: contraction size mismatch: x axis {i} has {x.shape[i]}, kernel axis {j} "
                f"has {kernel.shape[j]} (x {tuple(x.shape)}, kernel {tuple(kernel.shape)})"
            )
    out_dtype = as_dtype(
        out_dtype if out_dtype is not None else jnp.result_type(x, kernel), "dense: out_dtype"
    )
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
    M, K, N = prod(lead), prod(x.shape[x.ndim - c :]), prod(feat)
    if bias is not None:
        bias = check_input(bias, "dense: bias")
        if bias.shape not in (feat, (N,)):
            raise ValueError(
                f"dense: bias must have shape {feat} (the kernel's feature axes), got {tuple(bias.shape)}"
            )
        bias = bias.reshape(N)

    if recipe is None and tp_overlap:
        y = collective_dense.dense_overlapped(
            make_config(None, out_dtype, x.dtype, kernel, bias, fast_accum),
            x,
            kernel,
            bias,
            None,
            tp_layout,
            lead,
        )
        if y is not None:
            return y
    if recipe is None:
        dt = jnp.result_type(x, kernel)
        y = jax.lax.dot_general(
            x.astype(dt),
            kernel.astype(dt),
            ((tuple(range(x.ndim - c, x.ndim)), tuple(range(c))), ((), ())),
            preferred_element_type=out_dtype,
        )
        return (y + bias.reshape(feat).astype(out_dtype)) if bias is not None else y.astype(out_dtype)
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"dense: recipe must be a lowbit recipe (DelayedScaling, Float8CurrentScaling, "
            f"MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling), got {type(recipe).__name__}"
        )

    b = _block_multiple(recipe)
    if K % b or N % b:
        raise ValueError(
            f"dense: {type(recipe).__name__} needs the contraction size K and the output size N to be "
            f"multiples of {b}; got K={K}, N={N}"
        )
    state = ds.check_state_arg("dense", recipe, state, "lowbit.init_delayed_state(recipe)")
    if rng is not None and not isinstance(recipe, NVFP4BlockScaling):
        rng = None  # only NVFP4's stochastic rounding draws random bits

    cfg = make_config(recipe, out_dtype, x.dtype, kernel, bias, fast_accum)
    y = (
        collective_dense.dense_overlapped(cfg, x, kernel, bias, state, tp_layout, lead)
        if tp_overlap
        else None
    )
    if y is not None:  # NVFP4 excepted: it runs unsharded
        return y
    x2 = x.reshape(M, K)
    # Block-scaled colwise copies need the token count in whole blocks: zero rows change no
    # result (nor any amax, nor the bias gradient), so pad and slice.
    pad = (-M) % b
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    k2 = kernel.reshape(K, N)
    # Under a MeshResource and a mesh in context, per shard with global scales (NVFP4 excepted).
    plan = None if cfg.nvfp4 else plan_dense(recipe, M + pad, K, N, tp_layout, lead=() if pad else lead)
    if plan is None:
        y2 = _dense_2d(cfg, x2, k2, bias, state, rng)
    elif plan.rows:
        # Sequence parallelism: x as (batch, sequence, K), reshaped from (and y to) x's own leading
        # axes, never through (M, K): the flattened rows of a (batch, sequence)-split array are not
        # one split axis, and XLA would move them.
        y3 = dense_sharded.dense_2d(cfg, plan, x.reshape(plan.rows + (K,)), k2, bias, state)
        return y3.reshape(lead + feat)
    else:
        y2 = dense_sharded.dense_2d(cfg, plan, x2, k2, bias, state)
    if pad:
        y2 = y2[:M]
    return y2.reshape(lead + feat)
