"""Flax Linen modules with TransformerEngine's names: LayerNorm, Softmax, DenseGeneral,
LayerNormDenseGeneral, LayerNormMLP.

Every GEMM goes through :func:`lowbit.dense` inside a state module of
:func:`lowbit.flax.wrap_function_in_state_module`, so the recipe of the enclosing
:func:`lowbit.autocast` (read at trace time) applies, DelayedScaling keeps its state in the
``_overwrite_with_gradient`` collection and NVFP4 draws from the ``sr_rng`` stream. Without a
recipe the math runs in the input's dtype. ``dtype`` is the parameters' dtype (as in
TransformerEngine); outputs have the input's dtype. ``*_axes`` are logical axis names
(``nn.with_logical_partitioning``); empty means unannotated.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowbit.autocast import get_recipe
from lowbit.flax.state_module import QuantizeContext, wrap_function_in_state_module
from lowbit.ops.activation import activation as _activation
from lowbit.ops.activation import parse_activations
from lowbit.ops.dense import dense as _dense
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.fused.dense_split import split_dense as _split_dense
from lowbit.ops.fused.mlp import mlp as _mlp
from lowbit.ops.fused.mlp import runs_fused as _mlp_runs_fused
from lowbit.ops.norm import NORM_TYPES
from lowbit.ops.norm import layernorm as _layernorm
from lowbit.ops.softmax import softmax as _softmax
from lowbit.sharding import tensor_parallel_layout

Initializer = Callable[..., Any]


def _dense_op(ctx: QuantizeContext, x, kernel, bias, contracting_dims):
    return _dense(x, kernel, bias, contracting_dims=contracting_dims, out_dtype=x.dtype, **ctx.dense_kwargs())


#: One GEMM with its own recipe state; recipe read from autocast at trace time.
DenseOp = wrap_function_in_state_module(_dense_op, None, "dense")
#: A DenseOp's recipe context (same variables) for ops that run several GEMMs in one VJP.
DenseContext = wrap_function_in_state_module(lambda ctx: ctx, None, "dense")


def _split_dense_op(ctx: QuantizeContext, x, kernel, bias, norm=None):
    return _split_dense(x, kernel, bias, recipe=ctx.recipe, state=ctx.state, out_dtype=x.dtype, norm=norm)


#: DenseOp (same variables) returning the slots of the kernel's first feature axis separately.
SplitDenseOp = wrap_function_in_state_module(_split_dense_op, None, "dense")

#: Set around a fused QKV projection (MultiHeadAttention): DenseGeneral / LayerNormDenseGeneral
#: with features (n, F) return their n slots as a tuple, whose gradients then need no concat.
_SPLIT_FEATURES = contextvars.ContextVar("lowbit_split_features", default=False)


@contextlib.contextmanager
def split_first_feature_axis():
    """Within: a (LayerNorm)DenseGeneral with two feature axes and no LoRA returns a tuple of
    its first axis's slots (the arrays ``out[..., i, :]``)."""
    token = _SPLIT_FEATURES.set(True)
    try:
        yield
    finally:
        _SPLIT_FEATURES.reset(token)


def _canon_tuple(v, name) -> Tuple[int, ...]:
    if isinstance(v, (int, np.integer)):
        return (int(v),)
    try:
        return tuple(int(i) for i in v)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {v!r}") from None


def _param(module, name, init, shape, dtype, axes):
    """A parameter, annotated with logical axis names when given."""
    axes = tuple(axes or ())
    if axes:
        if len(axes) != len(shape):
            raise ValueError(
                f"{type(module).__name__}: {name} axes {axes} must name each of its {len(shape)} "
                f"dimensions (shape {tuple(shape)})"
            )
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, tuple(shape), dtype)


def check_norm_type(layernorm_type: str) -> None:
    """Refuses a ``layernorm_type`` other than "layernorm" or "rmsnorm" when the module is built."""
    if layernorm_type not in NORM_TYPES:
        raise ValueError(f"layernorm_type must be 'layernorm' or 'rmsnorm', got {layernorm_type!r}")


def _norm_params(
    module, C, layernorm_type, zero_centered_gamma, scale_init, bias_init, scale_axes, bias_axes, dtype
):
    check_norm_type(layernorm_type)
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    gamma = _param(module, "scale", scale_init, (C,), dtype, scale_axes)
    beta = None
    if layernorm_type == "layernorm":
        beta = _param(module, "ln_bias", bias_init, (C,), dtype, bias_axes)
    return gamma, beta


def _ln_params(m, C):
    """The norm parameters of a LayerNorm* module (fields ``scale_init``, ``ln_bias_init``,
    ``scale_axes``, ``ln_bias_axes``)."""
    return _norm_params(
        m,
        C,
        m.layernorm_type,
        m.zero_centered_gamma,
        m.scale_init,
        m.ln_bias_init,
        m.scale_axes,
        m.ln_bias_axes,
        m.dtype,
    )


def _norm(x, gamma, beta, layernorm_type, zero_centered_gamma, epsilon):
    return _layernorm(
        x,
        gamma,
        beta,
        norm_type=layernorm_type,
        zero_centered_gamma=bool(zero_centered_gamma),
        epsilon=float(epsilon),
    )


def _norm_input(m, gamma, beta, return_output: bool) -> NormInput:
    """Module m's norm as the input stage of a fused dense (``lowbit.ops.fused.dense_norm``)."""
    return NormInput(
        gamma, beta, m.layernorm_type, bool(m.zero_centered_gamma), float(m.epsilon), bool(return_output)
    )


def _cast_for_math(x, *arrays):
    """Without a recipe the GEMM runs in x's dtype; with one, lowbit.dense quantizes the
    full-precision parameters directly."""
    if get_recipe() is not None:
        return arrays
    return tuple(None if a is None else a.astype(x.dtype) for a in arrays)


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis (``lowbit.layernorm``)."""

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ("embed",)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma, beta = _norm_params(
            self,
            x.shape[-1],
            self.layernorm_type,
            self.zero_centered_gamma,
            self.scale_init,
            self.bias_init,
            self.scale_axes,
            self.bias_axes,
            self.dtype,
        )
        return _norm(x, gamma, beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)


_SOFTMAX_TYPES = {
    "scaled": "scaled",
    "scaled_masked": "scaled_masked",
    "scaled_upper_triang_masked": "scaled_upper_triang_masked",
}


class Softmax(nn.Module):
    """``softmax(scale_factor * (x + bias))`` over the last axis (``lowbit.softmax``).

    ``softmax_type``: "scaled", "scaled_masked" (needs ``mask``, True = masked out) or
    "scaled_upper_triang_masked" (causal). TransformerEngine's SoftmaxType enum values (whose
    ``.name`` is SCALED, ...) are accepted too."""

    scale_factor: float = 1.0
    softmax_type: Any = "scaled"

    @nn.compact
    def __call__(
        self, inputs: jax.Array, mask: Optional[jax.Array] = None, bias: Optional[jax.Array] = None
    ) -> jax.Array:
        st = getattr(self.softmax_type, "name", self.softmax_type)
        st = st.lower() if isinstance(st, str) else st
        if st not in _SOFTMAX_TYPES:
            raise ValueError(
                f"softmax_type must be one of {sorted(_SOFTMAX_TYPES)}, got {self.softmax_type!r}"
            )
        if bias is not None:
            inputs = (inputs + bias).astype(inputs.dtype)
        if mask is not None and st != "scaled_masked":
            raise ValueError(f"Softmax: mask is only used with softmax_type='scaled_masked', not {st!r}")
        return _softmax(inputs, float(self.scale_factor), mask=mask, softmax_type=st)


def _dense_general(m, x, features, axis, owner: str, norm: Optional[NormInput] = None):
    """Kernel (+ bias, + LoRA) of module ``m`` (its params, so they sit where TransformerEngine
    puts them) and the GEMM; shared by DenseGeneral and LayerNormDenseGeneral. With ``norm`` the
    GEMM reads x's norm and the result is ``(y, norm output or None)``: the fused QKV path
    (split features over x's last axis, no LoRA) runs the norm inside the GEMM's VJP."""
    features, axis = _canon_tuple(features, "features"), _canon_tuple(axis, "axis")
    if any(f < 1 for f in features):
        raise ValueError(f"{owner}: features must be positive, got {features}")
    nd = x.ndim
    axis = tuple(a + nd if a < 0 else a for a in axis)
    if any(not 0 <= a < nd for a in axis) or len(set(axis)) != len(axis):
        raise ValueError(f"{owner}: axis {axis} is out of range or repeats for inputs of rank {nd}")
    split = _SPLIT_FEATURES.get() and len(axis) == 1 and len(features) == 2
    split = split and not m.enable_low_rank_adaptation
    if norm is not None and not (split and axis == (nd - 1,)):
        y = _norm(x, norm.gamma, norm.beta, norm.norm_type, norm.zero_centered_gamma, norm.epsilon)
        return _dense_general(m, y, features, axis, owner), (y if norm.return_output else None)
    # lowbit.dense contracts trailing axes: move the contracted ones to the end, in order.
    rest = [a for a in range(nd) if a not in axis]
    if rest + list(axis) != list(range(nd)):
        x = jnp.transpose(x, rest + list(axis))
    c = len(axis)
    in_shape = tuple(x.shape[nd - c :])
    kernel = _param(m, "kernel", m.kernel_init, in_shape + features, m.dtype, m.kernel_axes)
    bias = _param(m, "bias", m.bias_init, features, m.dtype, m.bias_axes) if m.use_bias else None
    k, b = _cast_for_math(x, kernel, bias)
    dims = (tuple(range(nd - c, nd)), tuple(range(c)))
    if split:
        return SplitDenseOp(name="dense_op")(x, k, b, norm=norm)
    y = DenseOp(name="dense_op")(x, k, b, dims)
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
    a = _param(m, "lora_a_kernel", m.kernel_init, in_shape + lead + (r,), m.dtype, a_axes)
    b = _param(m, "lora_b_kernel", nn.initializers.zeros, lead + (r, features[-1]), m.dtype, b_axes)
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

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
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

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
        owner = "LayerNormDenseGeneral"
        if not self.enable_layernorm:
            out = _dense_general(self, inputs, self.features, self.axis, owner)
            return out, (inputs if self.return_layernorm_output else None)
        gamma, beta = _ln_params(self, inputs.shape[-1])
        norm = _norm_input(self, gamma, beta, self.return_layernorm_output)
        return _dense_general(self, inputs, self.features, self.axis, owner, norm=norm)


#: TransformerEngine's default MLP kernel init (its ``kernel_init=None``).
def _default_mlp_kernel_init(dtype):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", dtype=dtype)


def _identity(x):
    return x


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _squared_relu(x):
    return jnp.square(jax.nn.relu(x))


#: jnp forms of the activations, for combinations without a fused kernel ("gelu" is the tanh form,
#: as in TransformerEngine, flax.linen.gelu and lowbit's fused kernel).
_JNP_ACTS = {
    "linear": _identity,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": _quick_gelu,
    "squared_relu": _squared_relu,
}


def normalize_mlp_activations(activations) -> tuple:
    """TransformerEngine's normalisation: names lower-cased, and a sequence starting with "linear"
    reversed (``("linear", "gelu")`` is ``("gelu", "linear")``). Callables are kept."""
    if isinstance(activations, str) or callable(activations):
        activations = (activations,)
    try:
        acts = tuple(activations)
    except TypeError:
        raise TypeError(
            f"LayerNormMLP: activations must be a sequence of names or callables, got {activations!r}"
        ) from None
    if not acts:
        raise ValueError("LayerNormMLP: activations must name at least one activation, got ()")
    out = []
    for a in acts:
        if isinstance(a, str):
            out.append(a.lower())
        elif callable(a):
            out.append(a)
        else:
            raise TypeError(f"LayerNormMLP: activations entries must be names or callables, got {a!r}")
    if out[0] == "linear":
        out.reverse()
    return tuple(out)


def fused_mlp_activation(acts: tuple) -> bool:
    """Whether lowbit's fused activation kernel computes ``acts``: one activation, or an
    (activation, "linear") gated pair, of gelu, gelu_exact, relu, silu, quick_gelu, squared_relu
    or linear. Other combinations (``("relu", "relu")``, ``("gelu", "gelu")``, flax.linen names,
    callables) run as jnp between the two GEMMs."""
    if not all(isinstance(a, str) for a in acts):
        return False
    if len(acts) == 1 or (len(acts) == 2 and acts[1] == "linear"):
        try:
            parse_activations(acts)
        except (TypeError, ValueError):
            return False
        return True
    return False


def _activation_fn(a):
    if callable(a):
        return a
    if a in _JNP_ACTS:
        return _JNP_ACTS[a]
    if a.startswith("clamped_"):
        raise NotImplementedError(
            f"LayerNormMLP: activation {a!r} (TransformerEngine's clamped SwiGLU, with activation_params) "
            "is not supported by lowbit"
        )
    fn = getattr(nn, a, None)  # TransformerEngine falls back to flax.linen's function of that name
    if fn is None or not callable(fn):
        raise ValueError(
            f"LayerNormMLP: unknown activation {a!r}; use one of {sorted(_JNP_ACTS)}, a flax.linen "
            "activation name, or a callable"
        )
    return fn


def _mlp_activation(h, acts, F):
    """``h`` (..., n_act * F), slot i being ``h[..., i*F:(i+1)*F]``: the product of act_i(slot i)."""
    if fused_mlp_activation(acts):
        return _activation(h, acts)
    n = len(acts)
    hs = h.reshape(h.shape[:-1] + (n, F))
    z = None
    for i, a in enumerate(acts):
        zi = _activation_fn(a)(hs[..., i, :])
        z = zi if z is None else z * zi
    return z.astype(h.dtype)


def _lora_mlp(x, a, b, alpha):
    """TransformerEngine's LoRA of a kernel with features (n, F) or (H,): ``x . a . b * alpha/r``;
    ``a`` (K, [n,] r), ``b`` ([n,] r, F). Plain GEMMs in x's dtype (as TransformerEngine)."""
    r = a.shape[-1]
    scaling = 1.0 if alpha is None else float(alpha) / r
    a, b = a.astype(x.dtype), b.astype(x.dtype)
    if a.ndim == 3:
        z = jnp.einsum("...k,knr,nrf->...nf", x, a, b)
        z = z.reshape(z.shape[:-2] + (-1,))
    else:
        z = jnp.einsum("...k,kr,rf->...f", x, a, b)
    return (z * scaling).astype(x.dtype)


def _stacked_init(init, n):
    """A (K, n, F) kernel from ``n`` draws of ``init`` at (K, F), so each slot has fan_in K like
    a separate Dense (as TransformerEngine's kernel_1_init)."""

    def f(key, shape, dtype):
        keys = jax.random.split(key, shape[1])
        return jnp.stack([init(k, (shape[0], shape[2]), dtype) for k in keys], axis=-2).astype(dtype)

    return f


def _constrain(x, axes):
    """TransformerEngine's ``*_input_axes``: a logical sharding constraint (a no-op without Flax
    logical axis rules and a mesh)."""
    if axes is None:
        return x
    axes = tuple(axes)
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} must name each of the input's {x.ndim} dimensions")
    return nn.with_logical_constraint(x, axes)


class LayerNormMLP(nn.Module):
    """Norm, ``wi`` (to ``intermediate_dim`` per activation), activations, dropout, ``wo``, with
    TransformerEngine's fields, defaults and field order.

    ``activations``: ``("gelu",)``, a gated pair ``("silu", "linear")`` (``("linear", "silu")`` is
    the same), or any sequence: the first GEMM's output holds one ``intermediate_dim`` slot per
    activation and the activations' results are multiplied (``("relu", "relu")``,
    ``("gelu", "gelu", "linear")``, callables, flax.linen names). One activation or an
    (act, "linear") pair of gelu/relu/silu/quick_gelu/squared_relu runs lowbit's fused kernel;
    other combinations run as jnp between the two quantized GEMMs.

    Params: ``scale``/``ln_bias``, ``wi_kernel`` (hidden, n_act, intermediate_dim),
    ``wo_kernel`` (intermediate_dim, hidden), ``wi_bias`` (n_act, intermediate_dim) and
    ``wo_bias`` (hidden,) with ``use_bias``; with ``enable_low_rank_adaptation``
    ``wi_lora_a_kernel`` (hidden, n_act, r), ``wi_lora_b_kernel`` (n_act, r, intermediate_dim),
    ``wo_lora_a_kernel`` (intermediate_dim, r), ``wo_lora_b_kernel`` (r, hidden).
    Returns ``(out, ln_output)`` (``ln_output`` None unless ``return_layernorm_output``, which is
    True by default as in TransformerEngine). The first GEMM's output (after bias) is named
    ``ffn1_ckpt_name``, the second's ``ffn2_ckpt_name`` for ``jax.checkpoint`` policies.

    Refused (an error naming the field): ``axis`` other than -1 (TransformerEngine asserts the
    same), ``activation_params`` (clamped SwiGLU). ``transpose_batch_sequence`` changes nothing
    in the math (the MLP is per token); the ``*_input_axes`` are Flax logical constraints."""

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes_1: Tuple[Optional[str], ...] = ("embed", "act", "mlp")
    kernel_axes_2: Tuple[Optional[str], ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Tuple[Optional[str], ...] = ("act", "mlp")
    bias_axes_2: Tuple[Optional[str], ...] = ("embed",)
    return_layernorm_output: bool = True
    activations: Sequence[Union[str, Callable]] = ("relu",)
    activation_params: Optional[dict] = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.1
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_1_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_2_input_axes: Optional[Tuple[Optional[str], ...]] = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False

    @nn.compact
    def __call__(
        self, inputs: jax.Array, deterministic: bool = False
    ) -> tuple[jax.Array, Optional[jax.Array]]:
        acts = normalize_mlp_activations(self.activations)
        if self.activation_params is not None:
            raise NotImplementedError(
                "LayerNormMLP: activation_params (TransformerEngine's clamped SwiGLU parameters) "
                "is not supported by lowbit; leave it None"
            )
        for a in acts:
            if isinstance(a, str):
                _activation_fn(a)  # unknown names fail here, before any parameter is made
        axis = _canon_tuple(self.axis, "axis")
        if axis not in ((-1,), (inputs.ndim - 1,)):
            raise NotImplementedError(
                "LayerNormMLP: axis must be -1 (the last axis, as TransformerEngine requires), "
                f"got {self.axis!r}"
            )
        n_act = len(acts)
        if not isinstance(self.intermediate_dim, (int, np.integer)) or self.intermediate_dim < 1:
            raise ValueError(
                f"LayerNormMLP: intermediate_dim must be a positive int, got {self.intermediate_dim!r}"
            )
        if not 0.0 <= self.intermediate_dropout_rate < 1.0:
            raise ValueError(
                f"LayerNormMLP: intermediate_dropout_rate must be in [0, 1), "
                f"got {self.intermediate_dropout_rate!r}"
            )
        H, F = inputs.shape[-1], int(self.intermediate_dim)
        y = inputs
        if self.enable_layernorm:
            y = _constrain(inputs, self.layernorm_input_axes)
            gamma, beta = _ln_params(self, H)
        init = self.kernel_init or _default_mlp_kernel_init(self.dtype)
        ax1 = tuple(self.kernel_axes_1 or ())
        if len(ax1) == 2:  # (embed, mlp) names the 2-D view; the activation axis is unsharded
            ax1 = (ax1[0], None, ax1[1])
        wi = _param(self, "wi_kernel", _stacked_init(init, n_act), (H, n_act, F), self.dtype, ax1)
        wo = _param(self, "wo_kernel", init, (F, H), self.dtype, self.kernel_axes_2)
        wi_b = wo_b = None
        if self.use_bias:
            b1 = tuple(self.bias_axes_1 or ())
            b1 = (None, b1[0]) if len(b1) == 1 else b1
            wi_b = _param(self, "wi_bias", self.bias_init, (n_act, F), self.dtype, b1)
            wo_b = _param(self, "wo_bias", self.bias_init, (H,), self.dtype, self.bias_axes_2)
        lora = None
        if self.enable_low_rank_adaptation:
            r = self.low_rank_adaptation_dim
            if not isinstance(r, (int, np.integer)) or r < 1:
                raise ValueError(f"LayerNormMLP: low_rank_adaptation_dim must be a positive int, got {r!r}")
            lora = (
                _param(self, "wi_lora_a_kernel", _stacked_init(init, n_act), (H, n_act, r), self.dtype, ()),
                _param(self, "wi_lora_b_kernel", nn.initializers.zeros, (n_act, r, F), self.dtype, ()),
                _param(self, "wo_lora_a_kernel", init, (F, r), self.dtype, ()),
                _param(self, "wo_lora_b_kernel", nn.initializers.zeros, (r, H), self.dtype, ()),
            )
        wi, wi_b, wo, wo_b = _cast_for_math(inputs, wi, wi_b, wo, wo_b)
        dropout = self.intermediate_dropout_rate > 0 and not deterministic
        M = int(np.prod(inputs.shape[:-1]))
        fused = lora is None and not dropout and _mlp_runs_fused(get_recipe(), acts, M, H, n_act * F)
        # Fused, the norm runs inside the MLP's VJP (its kernel writes the first GEMM's FP8 input),
        # unless the GEMM's input carries a sharding constraint of its own.
        norm = None
        if self.enable_layernorm:
            if fused and self.dot_1_input_axes is None:
                norm = _norm_input(self, gamma, beta, self.return_layernorm_output)
            else:
                y = _norm(y, gamma, beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        ln_output = y if self.return_layernorm_output else None
        y1 = _constrain(y, self.dot_1_input_axes)
        if fused:
            # One VJP for both GEMMs: the activation kernels write the FP8 operands themselves.
            c1, c2 = DenseContext(name="wi_op")(), DenseContext(name="wo_op")()
            b1 = None if wi_b is None else wi_b.reshape(-1)
            out = _mlp(
                y1,
                wi.reshape(H, n_act * F),
                b1,
                wo,
                wo_b,
                acts,
                recipe=c1.recipe,
                states=(c1.state, c2.state),
                hidden_checkpoint_name=self.ffn1_ckpt_name,
                norm=norm,
            )
            if norm is not None:
                out, ln_output = out
            return checkpoint_name(out, self.ffn2_ckpt_name), ln_output
        # (H, n_act, F) -> (H, n_act*F): the output's last axis holds the activation slots in order.
        h = DenseOp(name="wi_op")(
            y1, wi.reshape(H, n_act * F), None if wi_b is None else wi_b.reshape(-1), ((y1.ndim - 1,), (0,))
        )
        if lora is not None:
            h = h + _lora_mlp(y1, lora[0], lora[1], self.low_rank_adaptation_alpha)
        h = checkpoint_name(h, self.ffn1_ckpt_name)
        z = _mlp_activation(h, acts, F)
        if dropout:
            z = nn.Dropout(
                self.intermediate_dropout_rate,
                broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                rng_collection=self.intermediate_dropout_rng_name,
            )(z, deterministic=False)
        z = _constrain(z, self.dot_2_input_axes)
        # Under tensor parallelism wo is row-parallel (its input is wi's column-parallel output,
        # split over tp on the last axis), as in TransformerEngine: no gather between the GEMMs.
        with tensor_parallel_layout("row"):
            out = DenseOp(name="wo_op")(z, wo, wo_b, ((z.ndim - 1,), (0,)))
        if lora is not None:
            out = out + _lora_mlp(z, lora[2], lora[3], self.low_rank_adaptation_alpha)
        out = checkpoint_name(out, self.ffn2_ckpt_name)
        return out, ln_output


__all__ = ["DenseGeneral", "DenseOp", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "Softmax"]
