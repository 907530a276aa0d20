"""LayerNorm / RMSNorm over the last axis, optionally writing the output straight to FP8.

Numerics (csrc/include/lowbit/norm.h): statistics and the affine map in float32, the output
rounded once to ``x``'s dtype. With ``quantize`` under tensor scaling, and under FP8 block
scaling (1x128 / 128x128, whole 16x16 tiles), the kernel writes the FP8 copies itself, and they
equal ``lowbit.quantize(layernorm(x, ...), mode, q_dtype, scale=..., layout=...,
power_2_scale=..., amax_epsilon=...)`` bit for bit: the quantized values are the norm output
*after* its rounding to ``x``'s dtype. Other scaling modes (MXFP8, NVFP4, NO_SCALING) run the
norm, then ``lowbit.quantize`` on its output.

Building blocks for fused modules: :func:`layernorm_fwd` (also returns the statistics the
backward needs) and :func:`layernorm_bwd` (dx, dgamma, dbeta).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from lowbit.ops._ffi import norm as ffi
from lowbit.ops.fused_quantize import (
    QuantizeArg,
    QuantizeSpec,
    finish_output,
    is_fused,
    kernel_quant,
    parse_quantize_spec,
    scales_only,
    straight_through_grad,
)
from lowbit.quantization.checks import check_input
from lowbit.quantization.tensor import ScaledTensor, prod
from lowbit.sharding import plan_rows, shard_map, spec_row_axes

NORM_TYPES = {"layernorm": ffi.LAYERNORM, "rmsnorm": ffi.RMSNORM}


# ------------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------------
def check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon):
    x = check_input(x, "x")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last axis to normalize over, got shape {tuple(x.shape)}")
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    C = x.shape[-1]
    gamma = check_input(gamma, "gamma")
    if tuple(gamma.shape) != (C,):
        raise ValueError(f"gamma must have shape ({C},) (x's last axis), got {tuple(gamma.shape)}")
    if beta is not None:
        if norm_type == "rmsnorm":
            raise ValueError("beta must be None for norm_type='rmsnorm' (RMSNorm has no bias)")
        beta = check_input(beta, "beta")
        if tuple(beta.shape) != (C,):
            raise ValueError(f"beta must have shape ({C},) (x's last axis), got {tuple(beta.shape)}")
    if not isinstance(zero_centered_gamma, (bool, np.bool_)):
        raise TypeError(f"zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
    if (
        isinstance(epsilon, jax.Array)
        or not isinstance(epsilon, (int, float, np.floating))
        or not epsilon >= 0
    ):
        raise ValueError(f"epsilon must be a non-negative Python float, got {epsilon!r}")
    return x, gamma, beta


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def layernorm_fwd(
    x,
    gamma,
    beta=None,
    *,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantize=None,
    return_norm_output: bool = False,
):
    """Forward building block: returns ``(out, norm_output, mean, rsigma)``.

    ``out`` is the normalized ``x`` in its dtype, or a ScaledTensor when ``quantize`` is given;
    ``norm_output`` is the unquantized output when ``return_norm_output`` (else None); ``mean``
    (None for rmsnorm) and ``rsigma`` are float32 of shape ``x.shape[:-1]``."""
    x, gamma, beta = check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    spec = parse_quantize_spec(quantize, x.dtype)
    return norm_forward(x, gamma, beta, spec, norm_type, zero_centered_gamma, epsilon, return_norm_output)


def norm_forward(x, gamma, beta, spec, norm_type, zc, eps, return_norm_output):
    """:func:`layernorm_fwd` of checked arguments (``spec`` a parsed QuantizeSpec or None)."""
    shape = tuple(x.shape)
    C = shape[-1]
    x2 = x.reshape(prod(shape[:-1]), C)
    fused = is_fused(spec, x2.shape[0], C)
    want_y = not fused or return_norm_output
    y, *fp8, mean, rsigma = ffi.norm_fwd(
        x2,
        gamma,
        beta,
        norm_type=NORM_TYPES[norm_type],
        zero_centered=zc,
        epsilon=eps,
        want_y=want_y,
        **kernel_quant(spec, fused),
    )
    y = y.reshape(shape) if want_y else None
    mean = mean.reshape(shape[:-1]) if norm_type == "layernorm" else None
    rsigma = rsigma.reshape(shape[:-1])
    out = finish_output(spec, fused, y, tuple(fp8), shape, x.dtype)
    return out, (y if return_norm_output else None), mean, rsigma


def layernorm_bwd(
    dy, x, mean, rsigma, gamma, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False
):
    """Backward building block: returns ``(dx, dgamma, dbeta)`` (dbeta None for rmsnorm);
    ``dy`` and ``dx`` have ``x``'s dtype, dgamma/dbeta ``gamma``'s."""
    x = check_input(x, "x")
    dy = check_input(dy, "dy")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise TypeError(f"dy must match x ({x.dtype} {tuple(x.shape)}), got {dy.dtype} {tuple(dy.shape)}")
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    gamma = check_input(gamma, "gamma")
    if tuple(gamma.shape) != (x.shape[-1],):
        raise ValueError(f"gamma must have shape ({x.shape[-1]},) (x's last axis), got {tuple(gamma.shape)}")
    R = prod(x.shape[:-1])
    if norm_type == "layernorm" and (mean is None or prod(jnp.shape(mean)) != R):
        raise ValueError(
            f"mean must have {R} entries (x.shape[:-1]) for layernorm, got "
            f"{None if mean is None else tuple(jnp.shape(mean))}"
        )
    if prod(jnp.shape(rsigma)) != R:
        raise ValueError(
            f"rsigma must have {R} entries (x.shape[:-1]), got "
            f"{None if rsigma is None else tuple(jnp.shape(rsigma))}"
        )
    C = x.shape[-1]
    dx, dg, db = ffi.norm_bwd(
        dy.reshape(R, C),
        x.reshape(R, C),
        mean,
        rsigma,
        gamma,
        norm_type=NORM_TYPES[norm_type],
        zero_centered=zero_centered_gamma,
    )
    return dx.reshape(x.shape), dg.astype(gamma.dtype), (None if db is None else db.astype(gamma.dtype))


def layernorm(
    x: ArrayLike,
    gamma: ArrayLike,
    beta: Optional[ArrayLike] = None,
    *,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantize: Optional[QuantizeArg] = None,
) -> Union[jax.Array, ScaledTensor]:
    """LayerNorm or RMSNorm of ``x`` over its last axis, differentiable (custom VJP).

    Args:
      x: float32/bfloat16/float16 array (..., C).
      gamma: scale, shape (C,); with ``zero_centered_gamma`` the scale applied is ``gamma + 1``.
      beta: bias, shape (C,), or None; must be None for rmsnorm.
      norm_type: "layernorm" or "rmsnorm".
      epsilon: added to the variance (mean square for rmsnorm) before the square root.
      quantize: None (returns an array of x's dtype), or ``(scaling_mode, q_dtype, scale[,
        layout])``: returns a :class:`lowbit.ScaledTensor` of the output, equal to
        ``lowbit.quantize`` of the unquantized output (fused into the kernel for tensor
        scaling). Its cotangent is taken straight through the quantization.
    """
    x, gamma, beta = check_norm_args(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    spec = parse_quantize_spec(quantize, x.dtype)
    scale = None if spec is None else spec.scale
    has_beta = beta is not None
    beta_arg = beta if has_beta else jnp.zeros((0,), gamma.dtype)
    static_spec = None if spec is None else spec._replace(scale=None)
    cfg = _NormConfig(norm_type, zero_centered_gamma, epsilon, has_beta, static_spec)
    # Under a MeshResource: per batch shard, and per sequence shard under sequence parallelism
    # (a norm reads the residual stream, which lies split along the sequence between blocks).
    plan = None if spec is not None else plan_rows(x.shape, split_seq=True)
    if plan is not None:
        return _layernorm_sharded(cfg, plan, x, gamma, beta_arg)
    return _layernorm(cfg, x, gamma, beta_arg, scale)


# ------------------------------------------------------------------------------------------------
# the differentiable op: beta_arg is beta, or (0,) without one; the spec's scale is an argument
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _NormConfig:
    norm_type: str
    zero_centered_gamma: bool
    epsilon: float
    has_beta: bool
    spec: Optional[QuantizeSpec] = None  # the output's quantization, its scale None


def _forward(cfg: _NormConfig, x, gamma, beta_arg, scale):
    spec = None if cfg.spec is None else cfg.spec._replace(scale=scale)
    beta = beta_arg if cfg.has_beta else None
    return norm_forward(x, gamma, beta, spec, cfg.norm_type, cfg.zero_centered_gamma, cfg.epsilon, False)


def _gamma_beta_grads(cfg: _NormConfig, gamma, dg, db):
    db = db.astype(gamma.dtype) if cfg.has_beta else jnp.zeros((0,), gamma.dtype)
    return dg.astype(gamma.dtype), db


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm(cfg: _NormConfig, x, gamma, beta_arg, scale):
    return _forward(cfg, x, gamma, beta_arg, scale)[0]


def _layernorm_fwd(cfg: _NormConfig, x, gamma, beta_arg, scale):
    out, _, mean, rsigma = _forward(cfg, x, gamma, beta_arg, scale)
    res_q = scales_only(out) if isinstance(out, ScaledTensor) else None
    return out, (x, gamma, mean, rsigma, res_q, scale)


def _layernorm_bwd(cfg: _NormConfig, res, ct):
    x, gamma, mean, rsigma, res_q, scale = res
    dy = ct if res_q is None else straight_through_grad(ct, res_q)
    dx, dg, db = layernorm_bwd(
        dy.astype(x.dtype),
        x,
        mean,
        rsigma,
        gamma,
        norm_type=cfg.norm_type,
        zero_centered_gamma=cfg.zero_centered_gamma,
    )
    return dx, *_gamma_beta_grads(cfg, gamma, dg, db), (None if scale is None else jnp.zeros_like(scale))


_layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)


# ------------------------------------------------------------------------------------------------
# its sharded path: per row shard under a MeshResource (batch, and sequence under sequence
# parallelism; the FFI call has no partitioning rule, so XLA would gather x). gamma/beta stay
# replicated; their gradients are summed over the shards in float32 and rounded once, as one
# device does.
# ------------------------------------------------------------------------------------------------
def _shard_fwd(cfg: _NormConfig, plan):
    """(x, gamma, beta_arg) -> (out, mean (rsigma for RMSNorm), rsigma), per shard."""
    mesh, xs = plan
    rs = P(*tuple(xs)[:-1])
    ln = cfg.norm_type == "layernorm"

    def body(x, g, b):
        out, _, mean, rsigma = _forward(cfg, x, g, b, None)
        return out, (mean if ln else rsigma), rsigma

    return shard_map(body, mesh, (xs, P(), P()), (xs, rs, rs))


def _shard_bwd(cfg: _NormConfig, plan):
    """(dy, x, mean, rsigma, gamma) -> (dx, dgamma, dbeta), the float32 sums over the shards."""
    mesh, xs = plan
    axes, rs = spec_row_axes(xs), P(*tuple(xs)[:-1])
    ln = cfg.norm_type == "layernorm"

    def body(dy, x, mean, rsigma, g):
        dx, dg, db = layernorm_bwd(
            dy,
            x,
            mean if ln else None,
            rsigma,
            g.astype(jnp.float32),
            norm_type=cfg.norm_type,
            zero_centered_gamma=cfg.zero_centered_gamma,
        )
        db = db if db is not None else jnp.zeros_like(dg)
        return dx, jax.lax.psum(dg, axes), jax.lax.psum(db, axes)

    return shard_map(body, mesh, (xs, xs, rs, rs, P()), (xs, P(), P()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layernorm_sharded(cfg: _NormConfig, plan, x, gamma, beta_arg):
    return _shard_fwd(cfg, plan)(x, gamma, beta_arg)[0]


def _layernorm_sharded_fwd(cfg: _NormConfig, plan, x, gamma, beta_arg):
    out, mean, rsigma = _shard_fwd(cfg, plan)(x, gamma, beta_arg)
    return out, (x, gamma, mean, rsigma)


def _layernorm_sharded_bwd(cfg: _NormConfig, plan, res, ct):
    x, gamma, mean, rsigma = res
    dx, dg, db = _shard_bwd(cfg, plan)(ct.astype(x.dtype), x, mean, rsigma, gamma)
    return dx, *_gamma_beta_grads(cfg, gamma, dg, db)


_layernorm_sharded.defvjp(_layernorm_sharded_fwd, _layernorm_sharded_bwd)


__all__ = ["QuantizeSpec", "layernorm", "layernorm_bwd", "layernorm_fwd"]
