"""The LayerNorm / RMSNorm in front of a fused dense (``split_dense``, ``mlp``).

Inside the dense's VJP the norm kernel writes the GEMM's FP8 input copies itself (for whole
16x16 tiles on the GPU: statistics, then the quantize tile cast recomputes the norm output per
element; csrc/kernels/cuda/norm.cu), and the norm's backward runs from the GEMM's dx. Without
it, a LayerNormDenseGeneral / LayerNormMLP step writes the norm output in x's dtype and
quantizes it in a second pass. The results equal ``layernorm`` followed by the dense bit for bit:
the fused FP8 copies equal ``lowbit.quantize`` of the rounded norm output (lowbit/norm.h).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from lowbit.ops import dense as dense_mod
from lowbit.ops import norm as norm_mod
from lowbit.ops.nonfinite import poison_nonfinite


class NormInput(NamedTuple):
    """The norm a fused dense applies to its input first (the arguments of
    :func:`lowbit.layernorm`); ``return_output``: also return the norm output (in x's dtype, as
    LayerNormDenseGeneral's ``return_layernorm_output``), whose cotangent joins the GEMM's."""

    gamma: Any
    beta: Any = None
    norm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6
    return_output: bool = False


class NormConfig(NamedTuple):
    """NormInput's static part (a custom VJP's non-differentiable argument)."""

    norm_type: str
    zero_centered_gamma: bool
    epsilon: float
    return_output: bool


def check_norm_input(norm: Optional[NormInput], x, owner: str):
    """Validates ``norm`` against x (..., K); returns ``(config, gamma, beta)`` (all None without
    a norm)."""
    if norm is None:
        return None, None, None
    if not isinstance(norm, NormInput):
        raise TypeError(
            f"{owner}: norm must be a lowbit.ops.fused.dense_norm.NormInput or None, got {norm!r}"
        )
    _, gamma, beta = norm_mod.check_norm_args(
        x, norm.gamma, norm.beta, norm.norm_type, norm.zero_centered_gamma, norm.epsilon
    )
    cfg = NormConfig(
        norm.norm_type, bool(norm.zero_centered_gamma), float(norm.epsilon), bool(norm.return_output)
    )
    return cfg, gamma, beta


def apply_norm(ncfg: Optional[NormConfig], x, gamma, beta):
    """The unfused composition's norm (``lowbit.layernorm``): x itself without a norm."""
    if ncfg is None:
        return x
    return norm_mod.layernorm(
        x,
        gamma,
        beta,
        norm_type=ncfg.norm_type,
        zero_centered_gamma=ncfg.zero_centered_gamma,
        epsilon=ncfg.epsilon,
    )


def with_norm_output(ncfg: Optional[NormConfig], out, y_norm):
    """A fused dense's result: ``out`` alone without a norm, else ``(out, norm output)``, the
    norm output None unless ``return_output``."""
    if ncfg is None:
        return out
    return out, (y_norm if ncfg.return_output else None)


def quantize_input(cfg, ncfg: Optional[NormConfig], x, gamma, beta, state):
    """The dense's FP8 input copies: of x (``dense.quantize_input``), or of its norm written by
    the norm kernel. Returns ``(qx, y, residual)``: y the norm output when ``return_output`` (else
    None), the residual what :func:`input_grad` needs."""
    if ncfg is None:
        return dense_mod.quantize_input(cfg, x, state), None, None
    spec = dense_mod.fused_spec(cfg, state, "x", x.dtype)
    qx, y, mean, rsigma = norm_mod.norm_forward(
        x, gamma, beta, spec, ncfg.norm_type, ncfg.zero_centered_gamma, ncfg.epsilon, ncfg.return_output
    )
    return poison_nonfinite(qx), y, (x, mean, rsigma, gamma, beta)


def input_grad(ncfg: Optional[NormConfig], res, dy: jax.Array, ct_y=None):
    """x's gradient from the gradient ``dy`` of the dense's input (plus the cotangent ``ct_y`` of
    a returned norm output), and gamma's and beta's (None without a norm)."""
    if ncfg is None:
        return dy, None, None
    x, mean, rsigma, gamma, beta = res
    if ct_y is not None:
        dy = dy + ct_y.astype(dy.dtype)
    dx, dg, db = norm_mod.layernorm_bwd(
        dy.astype(x.dtype),
        x,
        mean,
        rsigma,
        gamma,
        norm_type=ncfg.norm_type,
        zero_centered_gamma=ncfg.zero_centered_gamma,
    )
    return dx, dg.astype(gamma.dtype), (None if beta is None else db.astype(beta.dtype))


__all__ = [
    "NormConfig",
    "NormInput",
    "apply_norm",
    "check_norm_input",
    "input_grad",
    "quantize_input",
    "with_norm_output",
]
