"""LayerNormMLP with TransformerEngine's fields: norm, ``wi``, activations, dropout, ``wo``.

Fused (:func:`lowbit.ops.fused.mlp.mlp`: tensor-scaled recipe, an activation lowbit's kernel computes,
no dropout or LoRA, unsharded) the norm and both GEMMs run in one VJP; otherwise the two GEMMs
are DenseOps with the activation (lowbit's kernel or jnp) between them, ``wo`` row-parallel
under tensor parallelism.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowbit.autocast import get_recipe
from lowbit.flax.compat import constrain_logical
from lowbit.flax.dense_general import DenseContext, DenseOp, names_quantized_residuals
from lowbit.flax.params import (
    Initializer,
    apply_norm,
    canon_tuple,
    cast_for_math,
    ln_params,
    norm_input,
    param,
)
from lowbit.ops.activation import activation as _activation
from lowbit.ops.activation import parse_activations
from lowbit.ops.fused.mlp import mlp as _mlp
from lowbit.ops.fused.mlp import runs_fused as _mlp_runs_fused


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
    Returns ``(out, ln_output)`` (``ln_output`` None unless ``return_layernorm_output``).
    Defaults are TransformerEngine 2.10+'s: ``activations=("gelu",)``,
    ``intermediate_dropout_rate=0.0``, ``return_layernorm_output=False``. The first GEMM's
    output (after bias) is named ``ffn1_ckpt_name``, the second's ``ffn2_ckpt_name`` for
    ``jax.checkpoint`` policies.

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
    return_layernorm_output: bool = False
    activations: Sequence[Union[str, Callable]] = ("gelu",)
    activation_params: Optional[dict] = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
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
    #: names the GEMMs' quantized residuals for remat policies (jax checkpoint_name), as TE.
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    @names_quantized_residuals
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
        axis = canon_tuple(self.axis, "axis")
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
            y = constrain_logical(inputs, self.layernorm_input_axes)
            gamma, beta = ln_params(self, H)
        init = self.kernel_init or _default_mlp_kernel_init(self.dtype)
        ax1 = tuple(self.kernel_axes_1 or ())
        if len(ax1) == 2:  # (embed, mlp) names the 2-D view; the activation axis is unsharded
            ax1 = (ax1[0], None, ax1[1])
        wi = param(self, "wi_kernel", _stacked_init(init, n_act), (H, n_act, F), self.dtype, ax1)
        wo = param(self, "wo_kernel", init, (F, H), self.dtype, self.kernel_axes_2)
        wi_b = wo_b = None
        if self.use_bias:
            b1 = tuple(self.bias_axes_1 or ())
            b1 = (None, b1[0]) if len(b1) == 1 else b1
            wi_b = param(self, "wi_bias", self.bias_init, (n_act, F), self.dtype, b1)
            wo_b = param(self, "wo_bias", self.bias_init, (H,), self.dtype, self.bias_axes_2)
        lora = None
        if self.enable_low_rank_adaptation:
            r = self.low_rank_adaptation_dim
            if not isinstance(r, (int, np.integer)) or r < 1:
                raise ValueError(f"LayerNormMLP: low_rank_adaptation_dim must be a positive int, got {r!r}")
            lora = (
                param(self, "wi_lora_a_kernel", _stacked_init(init, n_act), (H, n_act, r), self.dtype, ()),
                param(self, "wi_lora_b_kernel", nn.initializers.zeros, (n_act, r, F), self.dtype, ()),
                param(self, "wo_lora_a_kernel", init, (F, r), self.dtype, ()),
                param(self, "wo_lora_b_kernel", nn.initializers.zeros, (r, H), self.dtype, ()),
            )
        wi, wi_b, wo, wo_b = cast_for_math(inputs, wi, wi_b, wo, wo_b)
        dropout = self.intermediate_dropout_rate > 0 and not deterministic
        M = int(np.prod(inputs.shape[:-1]))
        fused = lora is None and not dropout and _mlp_runs_fused(get_recipe(), acts, M, H, n_act * F)
        # Fused, the norm runs inside the MLP's VJP (its kernel writes the first GEMM's FP8 input),
        # unless the GEMM's input carries a sharding constraint of its own.
        norm = None
        if self.enable_layernorm:
            if fused and self.dot_1_input_axes is None:
                norm = norm_input(self, gamma, beta, self.return_layernorm_output)
            else:
                y = apply_norm(y, gamma, beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        ln_output = y if self.return_layernorm_output else None
        y1 = constrain_logical(y, self.dot_1_input_axes)
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
        z = constrain_logical(z, self.dot_2_input_axes)
        # Under tensor parallelism wo is row-parallel (its input is wi's column-parallel output,
        # split over tp on the last axis), as in TransformerEngine: no gather between the GEMMs.
        out = DenseOp(name="wo_op")(z, wo, wo_b, ((z.ndim - 1,), (0,)), tp_layout="row")
        if lora is not None:
            out = out + _lora_mlp(z, lora[2], lora[3], self.low_rank_adaptation_alpha)
        out = checkpoint_name(out, self.ffn2_ckpt_name)
        return out, ln_output


__all__ = ["LayerNormMLP", "fused_mlp_activation", "normalize_mlp_activations"]
