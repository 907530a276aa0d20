"""DenseGeneral and LayerNormDenseGeneral (TransformerEngine's names), and the state modules
their GEMMs run in: DenseOp (one GEMM), DenseContext (a recipe context for ops running several
GEMMs in one VJP), SplitDenseOp (the fused QKV projection's GEMM, returning its slots).

Layout choices are fields, not context: ``tp_layout`` (column/row-parallel kernel under a
MeshResource) and ``split_features`` (the slots of a (n, F) output as a tuple).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.compat import constrain_logical
from lowbit.flax.params import (
    Initializer,
    apply_norm,
    canon_tuple,
    cast_for_math,
    ln_params,
    norm_input,
    param,
)
from lowbit.flax.state_module import QuantizeContext, wrap_function_in_state_module
from lowbit.ops.dense import dense as _dense
from lowbit.ops.dense import quantized_checkpoint_name
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.fused.dense_split import split_dense as _split_dense
from lowbit.sharding import check_tp_layout


def names_quantized_residuals(method):
    """A module method run under ``quantized_checkpoint_name(self.quantization_checkpoint_name)``:
    its GEMMs' quantized residuals carry that name for remat policies (TransformerEngine's field)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with quantized_checkpoint_name(self.quantization_checkpoint_name):
            return method(self, *args, **kwargs)

    return wrapper


_OPERANDS = contextvars.ContextVar("lowbit_dense_operands", default=False)


class Operands(NamedTuple):
    """What a dense module would run its GEMM with (:func:`operands_only`)."""

    x: Any
    kernel: Any
    bias: Any
    norm: Optional[NormInput]
    ctx: QuantizeContext


@contextlib.contextmanager
def operands_only():
    """Within it, DenseGeneral / LayerNormDenseGeneral create their parameters and state as
    always but return :class:`Operands` instead of running the GEMM: for an op that runs several
    modules' GEMMs in one VJP (the recipes' fp8_mha)."""
    token = _OPERANDS.set(True)
    try:
        yield
    finally:
        _OPERANDS.reset(token)


def _dense_op(ctx: QuantizeContext, x, kernel, bias, contracting_dims, tp_layout=None, tp_overlap=False):
    kw = dict(
        contracting_dims=contracting_dims, out_dtype=x.dtype, tp_layout=tp_layout, tp_overlap=tp_overlap
    )
    return _dense(x, kernel, bias, **kw, **ctx.dense_kwargs())


#: One GEMM with its own recipe state; recipe read from autocast at trace time.
DenseOp = wrap_function_in_state_module(_dense_op, None, "dense")
#: A DenseOp's recipe context (same variables) for ops that run several GEMMs in one VJP.
DenseContext = wrap_function_in_state_module(lambda ctx: ctx, None, "dense")


def _split_dense_op(ctx: QuantizeContext, x, kernel, bias, norm=None, tp_layout=None):
    # ctx.rng too: NVFP4's stochastic rounding of the projection's gradient needs the sr_rng key.
    kw = dict(out_dtype=x.dtype, norm=norm, tp_layout=tp_layout)
    return _split_dense(x, kernel, bias, **kw, **ctx.dense_kwargs())


#: DenseOp (same variables) returning the slots of the kernel's first feature axis separately.
SplitDenseOp = wrap_function_in_state_module(_split_dense_op, None, "dense")


def _dense_general(m, x, features, axis, owner: str, norm: Optional[NormInput] = None):
    """Kernel (+ bias, + LoRA) of module ``m`` (its params, so they sit where TransformerEngine
    puts them) and the GEMM; shared by DenseGeneral and LayerNormDenseGeneral. With ``norm`` the
    GEMM reads x's norm and the result is ``(y, norm output or None)``: the fused QKV path
    (``m.split_features`` over x's last axis, no LoRA) runs the norm inside the GEMM's VJP."""
    features, axis = canon_tuple(features, "features"), canon_tuple(axis, "axis")
    if any(f < 1 for f in features):
        raise ValueError(f"{owner}: features must be positive, got {features}")
    nd = x.ndim
    axis = tuple(a + nd if a < 0 else a for a in axis)
    if any(not 0 <= a < nd for a in axis) or len(set(axis)) != len(axis):
        raise ValueError(f"{owner}: axis {axis} is out of range or repeats for inputs of rank {nd}")
    tp_layout = check_tp_layout(m.tp_layout, owner)
    split = m.split_features and len(axis) == 1 and len(features) == 2
    split = split and not m.enable_low_rank_adaptation
    if norm is not None and not (split and axis == (nd - 1,)):
        y = apply_norm(x, norm.gamma, norm.beta, norm.norm_type, norm.zero_centered_gamma, norm.epsilon)
        out = _dense_general(
            m, constrain_logical(y, getattr(m, "dot_input_axes", None)), features, axis, owner
        )
        return out, (y if norm.return_output else None)
    # lowbit.dense contracts trailing axes: move the contracted ones to the end, in order.
    rest = [a for a in range(nd) if a not in axis]
    if rest + list(axis) != list(range(nd)):
        x = jnp.transpose(x, rest + list(axis))
    c = len(axis)
    in_shape = tuple(x.shape[nd - c :])
    kernel = param(m, "kernel", m.kernel_init, in_shape + features, m.dtype, m.kernel_axes)
    bias = param(m, "bias", m.bias_init, features, m.dtype, m.bias_axes) if m.use_bias else None
    k, b = cast_for_math(x, kernel, bias)
    dims = (tuple(range(nd - c, nd)), tuple(range(c)))
    if _OPERANDS.get():
        ops = Operands(x, k, b, norm, DenseContext(name="dense_op")())
        return (ops, None) if norm is not None else ops
    if split:
        return SplitDenseOp(name="dense_op")(x, k, b, norm=norm, tp_layout=tp_layout)
    y = DenseOp(name="dense_op")(x, k, b, dims, tp_layout=tp_layout, tp_overlap=m.tp_overlap)
    if m.enable_low_rank_adaptation:
        y = y + _lora(m, x, in_shape, features, owner)
    return y


def _lora(m, x, in_shape, features, owner):
    """TransformerEngine's adapter: one per slot of the leading feature dims. ``A``
    (contracted + features[:-1] + (r,)), ``B`` (features[:-1] + (r, features[-1])), output
    ``x . A_s . B_s * alpha / r`` in slot ``s``. ``x``'s contracted axes are its trailing ones."""
    r = m.low_rank_adaptation_dim
    if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{owner}: low_rank_adaptation_dim must be a positive int, got {r!r}")
    r = int(r)
    c, lead = len(in_shape), tuple(features[:-1])
    if c > 5 or len(features) > 5:
        raise ValueError(f"{owner}: LoRA takes at most 5 contracted and 5 feature dims")
    kax = tuple(m.kernel_axes)
    # The kernel's logical names where the adapter shares the kernel's dims; the rank unnamed.
    a_axes = (kax[: c + len(lead)] + (None,)) if kax else ()
    b_axes = (kax[c : c + len(lead)] + (None, kax[-1])) if kax else ()
    a = param(m, "lora_a_kernel", m.kernel_init, in_shape + lead + (r,), m.dtype, a_axes)
    b = param(m, "lora_b_kernel", nn.initializers.zeros, lead + (r, features[-1]), m.dtype, b_axes)
    alpha = m.low_rank_adaptation_alpha
    scaling = 1.0 if alpha is None else float(alpha) / r
    i, o = "ijklm"[:c], "nopqr"[: len(features)]
    # The adapter is small: plain GEMMs in x's dtype (as TransformerEngine does).
    z = jnp.einsum(f"...{i},{i}{o[:-1]}s,{o[:-1]}s{o[-1]}->...{o}", x, a.astype(x.dtype), b.astype(x.dtype))
    return (z * scaling).astype(x.dtype)


DEFAULT_KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class DenseGeneral(nn.Module):
    """``y = x . kernel + bias`` over ``axis`` (default: last) to ``features`` (an int or tuple).

    Params: ``kernel`` (contracted dims + features), ``bias`` (features), and with
    ``enable_low_rank_adaptation`` TransformerEngine's adapter, one per slot of the leading
    feature dims: ``lora_a_kernel`` (contracted + features[:-1] + (r,)) and ``lora_b_kernel``
    (features[:-1] + (r, features[-1])); ``y[..., s, :] += (x . A[.., s, :] . B[s]) * alpha / r``
    (alpha None: 1). With one feature dim that is ``(K, r)`` and ``(r, F)``."""

    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    kernel_init: Initializer = DEFAULT_KERNEL_INIT
    kernel_axes: Tuple[Optional[str], ...] = ()
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    input_axes: Tuple[Optional[str], ...] = ()
    #: The math is per token: the batch/sequence order changes nothing.
    transpose_batch_sequence: bool = False
    #: TE names the quantized GEMM inputs for remat with it; lowbit names its GEMMs itself (ignored).
    quantization_checkpoint_name: Optional[str] = None
    #: lowbit: how tensor parallelism splits the kernel ("column": its features, the default
    #: for None; "row": its contracted axes, as the second GEMM of a column/row pair).
    tp_layout: Optional[str] = None
    #: lowbit: under ``tpsp_resource``, the sequence all-gather / reduce-scatter overlapped with
    #: the GEMM (``lowbit.dense``'s ``tp_overlap``; the split QKV path keeps XLA's collectives).
    tp_overlap: bool = False
    #: lowbit: with two feature axes (n, F) over one contracted axis and no LoRA, return the n
    #: slots ``out[..., i, :]`` as a tuple (the fused QKV projection: no slicing copies, and the
    #: gradients need no concatenation).
    split_features: bool = False

    @nn.compact
    @names_quantized_residuals
    def __call__(self, inputs: jax.Array) -> jax.Array:
        inputs = constrain_logical(inputs, self.input_axes)
        return _dense_general(self, inputs, self.features, self.axis, "DenseGeneral")


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm/RMSNorm then DenseGeneral. Returns ``(out, ln_output)``, ``ln_output`` being the
    norm output when ``return_layernorm_output`` (else None), as in TransformerEngine."""

    features: Union[int, Sequence[int]]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
    kernel_init: Initializer = DEFAULT_KERNEL_INIT
    kernel_axes: Tuple[Optional[str], ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    return_layernorm_output: bool = False
    axis: Union[int, Sequence[int]] = -1
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    layernorm_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_input_axes: Optional[Tuple[Optional[str], ...]] = None
    #: The output divided by it (None: not scaled), as in TransformerEngine.
    depth_scaling: Optional[float] = None
    transpose_batch_sequence: bool = False  # per token: changes nothing
    quantization_checkpoint_name: Optional[str] = None  # as DenseGeneral's
    tp_layout: Optional[str] = None  # lowbit's, as DenseGeneral's
    tp_overlap: bool = False  # lowbit's, as DenseGeneral's
    split_features: bool = False  # lowbit's, as DenseGeneral's

    @nn.compact
    @names_quantized_residuals
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
        owner = "LayerNormDenseGeneral"
        inputs = constrain_logical(inputs, self.layernorm_input_axes)
        if not self.enable_layernorm:
            out = _dense_general(
                self, constrain_logical(inputs, self.dot_input_axes), self.features, self.axis, owner
            )
            out, ln = out, (inputs if self.return_layernorm_output else None)
        else:
            gamma, beta = ln_params(self, inputs.shape[-1])
            norm = norm_input(self, gamma, beta, self.return_layernorm_output)
            out, ln = _dense_general(self, inputs, self.features, self.axis, owner, norm=norm)
        if self.depth_scaling is not None:
            out = jax.tree_util.tree_map(lambda z: z / self.depth_scaling, out)  # split slots: each
        return out, ln


__all__ = [
    "DEFAULT_KERNEL_INIT",
    "DenseContext",
    "DenseGeneral",
    "DenseOp",
    "LayerNormDenseGeneral",
    "Operands",
    "SplitDenseOp",
    "operands_only",
]
