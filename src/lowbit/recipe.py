"""Quantization recipes, with TransformerEngine's names and defaults.

A recipe says which formats and scaling modes the quantized GEMMs use; it holds no state.
Recipes are frozen dataclasses (hashable, usable as static arguments) validated on construction.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Callable, NamedTuple, Optional, Union

import jax.numpy as jnp

from lowbit.quantization.scaling_modes import ScalingMode


class _FormatMax(NamedTuple):
    """Largest finite magnitude of the forward and backward tensors' format."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """Element formats for the forward (activations, weights) and backward (gradients) tensors.

    ``Format.X.value.max_fwd`` / ``.max_bwd`` are the formats' largest magnitudes, as in
    TransformerEngine; ``fwd_dtype`` / ``bwd_dtype`` the JAX dtypes.
    """

    E2M1 = _FormatMax(6.0, 6.0)
    E4M3 = _FormatMax(448.0, 448.0)
    E5M2 = _FormatMax(57344.0, 57344.0)
    HYBRID = _FormatMax(448.0, 57344.0)

    @property
    def fwd_dtype(self):
        return _DTYPE_OF_MAX[self.value.max_fwd]

    @property
    def bwd_dtype(self):
        return _DTYPE_OF_MAX[self.value.max_bwd]


_DTYPE_OF_MAX = {6.0: jnp.float4_e2m1fn, 448.0: jnp.float8_e4m3fn, 57344.0: jnp.float8_e5m2}
_FP8_FORMATS = (Format.E4M3, Format.E5M2, Format.HYBRID)


def _check_format(fmt, name="fp8_format"):
    if not isinstance(fmt, Format) or fmt not in _FP8_FORMATS:
        raise TypeError(f"{name} must be a lowbit.recipe.Format (E4M3, E5M2 or HYBRID), got {fmt!r}")


def _check_per_tensor_format(recipe) -> None:
    """Per-tensor FP8 GEMMs need E4M3 on one side; all-E5M2 would fail at the first GEMM."""
    _check_format(recipe.fp8_format)
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(
            f"{type(recipe).__name__}(fp8_format=Format.E5M2): every GEMM would multiply E5M2 by E5M2, "
            "which FP8 tensor cores do not support; use Format.HYBRID (E5M2 gradients) or Format.E4M3"
        )


class Recipe:
    """Base class: every recipe names its scaling modes.

    The kind predicates (``delayed()``, ``mxfp8()`` ...) are TransformerEngine's; they work on
    the class and on instances.
    """

    def scaling_mode(self, role: str) -> ScalingMode:  # role: "x", "kernel" or "grad"
        raise NotImplementedError

    def q_dtype(self, role: str):
        raise NotImplementedError

    def layer_recipe(self, layer: int, num_layers: int) -> Recipe | None:
        """The recipe for transformer layer ``layer`` of ``num_layers`` (None: unquantized).

        A lowbit addition for models that pick a recipe per layer
        (``lowbit.flax.layer_dot_general_cls``); the ops never call it. Every layer uses this
        recipe, except where a recipe keeps some layers in higher precision (NVFP4).
        """
        _check_layer(layer, num_layers)
        return self

    @property
    def stateful(self) -> bool:
        return False

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options of a recipe (TransformerEngine's): split accumulation in FP8 GEMMs."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization options of one tensor role (TransformerEngine's)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


def _check_layer(layer, num_layers) -> None:
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, num_layers={num_layers}), got {layer}")


def _refuse_unless_default(recipe, fields: dict, why: str) -> None:
    """Fields lowbit cannot honour: an error naming the field, never a silent ignore."""
    for name, default in fields.items():
        value = getattr(recipe, name)
        if value != default:
            raise NotImplementedError(
                f"{type(recipe).__name__}({name}={value!r}): lowbit does not support this field "
                f"(only the default {default!r}); {why}"
            )


_NO_FP8_ATTENTION = "lowbit has no FP8 attention (attention runs in the input precision)"
_BACKWARD = "lowbit's backward always uses the quantized operands"


def _check_common(recipe) -> None:
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):  # FP8 attention: fp8_dpa, fp8_mha
        _refuse_unless_default(recipe, {"fp8_dpa": False, "fp8_mha": False}, _NO_FP8_ATTENTION)
    _refuse_unless_default(recipe, {"backward_override": None}, _BACKWARD)


class _FP8FormatRecipe(Recipe):
    """A recipe with an ``fp8_format``: gradients in its backward dtype, the rest forward."""

    def q_dtype(self, role):
        return self.fp8_format.bwd_dtype if role == "grad" else self.fp8_format.fwd_dtype


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_FP8FormatRecipe):
    """Per-tensor scales from a history of past amaxes (state in ``_overwrite_with_gradient``).

    scale = (fp8_max / amax) / 2**margin, amax = max of the history ("max") or its newest entry
    ("most_recent"); the previous scale is kept while amax is 0 or not finite. Under a mesh the
    amax is reduced over the mesh (``reduce_amax=True``, the only value lowbit supports).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self):
        _check_per_tensor_format(self)
        m = self.margin
        integral = isinstance(m, (int, float)) and not isinstance(m, bool) and float(m).is_integer()
        if not integral or m < 0:
            raise ValueError(f"margin must be a non-negative integer, got {m!r}")
        object.__setattr__(self, "margin", int(m))  # 2.0 and 2 are the same recipe
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent' (lowbit takes no callable), "
                f"got {self.amax_compute_algo!r}"
            )
        _refuse_unless_default(
            self, {"scaling_factor_compute_algo": None}, "the scale is always (fp8_max / amax) / 2**margin"
        )
        _refuse_unless_default(self, {"reduce_amax": True}, "amaxes are always reduced over the mesh")
        _check_common(self)

    def scaling_mode(self, role):
        return ScalingMode.DELAYED_TENSOR_SCALING

    @property
    def stateful(self):
        return True


_CURRENT_Q = QParams()


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_FP8FormatRecipe):
    """Per-tensor scales from each tensor's own amax, computed on the device every step.

    The ``fp8_gemm_*`` fields are TransformerEngine's (its PyTorch side reads them); on the JAX
    side, TE's and lowbit's, the GEMMs accumulate as ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION``
    says: fast unless it is 1 (lowbit.ops.accumulation).
    """

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = _CURRENT_Q
    fp8_quant_fwd_weight: QParams = _CURRENT_Q
    fp8_quant_bwd_grad: QParams = _CURRENT_Q
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self):
        _check_per_tensor_format(self)
        why = "lowbit's current scaling uses scale = fp8_max / amax with no power-of-2 rounding or epsilon"
        _refuse_unless_default(
            self,
            {
                "use_power_2_scales": False,
                "fp8_quant_fwd_inp": _CURRENT_Q,
                "fp8_quant_fwd_weight": _CURRENT_Q,
                "fp8_quant_bwd_grad": _CURRENT_Q,
            },
            why,
        )
        _refuse_unless_default(
            self,
            {
                "fp8_gemm_fprop": MMParams(False),
                "fp8_gemm_dgrad": MMParams(True),
                "fp8_gemm_wgrad": MMParams(True),
            },
            "lowbit accumulates the forward GEMM fast and the gradient GEMMs split "
            "(lowbit.dense(fast_accum=False) makes the forward split too)",
        )
        _check_common(self)

    def scaling_mode(self, role):
        return ScalingMode.CURRENT_TENSOR_SCALING


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_FP8FormatRecipe):
    """OCP MXFP8: one E8M0 scale per 32 elements along the contraction axis."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self):
        _check_format(self.fp8_format)
        _refuse_unless_default(self, {"margin": 0}, "MXFP8 scales are the OCP MX power-of-two choice")
        _check_common(self)

    def scaling_mode(self, role):
        return ScalingMode.MXFP8_1D_SCALING


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, E4M3 scale per 16 elements, FP32 tensor scale.

    Gradients use stochastic rounding (needs the ``sr_rng`` RNG stream), the inputs of the
    weight-gradient GEMM a random Hadamard transform, and weights 16x16 2-D blocks, unless
    disabled. ``fp4_quant_{fwd_inp,fwd_weight,bwd_grad}`` describe the result per role.

    lowbit's per-layer fields (not TransformerEngine's; read by :meth:`layer_recipe`, never by
    the ops), after the NVFP4 pretraining practice of keeping a few layers in higher precision:
    ``high_precision_first_layers`` / ``high_precision_last_layers`` transformer layers at the
    start / end of the stack use ``high_precision_recipe`` (None: BF16, unquantized; or an
    FP8 recipe such as ``MXFP8BlockScaling()``). The embedding and output head are not
    transformer layers: keep them unquantized in the model.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    # lowbit's (after TE's fields, so TE's positional order holds): see the docstring.
    high_precision_first_layers: int = 1
    high_precision_last_layers: int = 1
    high_precision_recipe: Recipe | None = None

    def __post_init__(self):
        for f in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{f} must be a bool, got {getattr(self, f)!r}")
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"fp4_format must be Format.E2M1 for NVFP4, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"fp8_format (the block scales' format) must be Format.E4M3 for NVFP4, "
                f"got {self.fp8_format!r}"
            )
        _refuse_unless_default(
            self, {"row_scaled_activation": False}, "activations carry one FP32 tensor scale"
        )
        _refuse_unless_default(
            self,
            {"nvfp4_4over6": "none", "nvfp4_4over6_e4m3_use_256": "all", "nvfp4_4over6_err_mode": "MAE"},
            "lowbit has no 4over6 adaptive block scaling",
        )
        for f in ("high_precision_first_layers", "high_precision_last_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f} must be a non-negative int, got {v!r}")
        hp = self.high_precision_recipe
        if hp is not None and (not isinstance(hp, Recipe) or isinstance(hp, NVFP4BlockScaling)):
            raise TypeError(
                f"high_precision_recipe must be None (BF16) or a non-NVFP4 lowbit recipe, got {hp!r}"
            )
        _check_common(self)

    def layer_recipe(self, layer, num_layers):
        """``high_precision_recipe`` for the first / last layers these fields name, else self."""
        _check_layer(layer, num_layers)
        if layer < self.high_precision_first_layers or layer >= num_layers - self.high_precision_last_layers:
            return self.high_precision_recipe
        return self

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        return QParams(random_hadamard_transform=not self.disable_rht)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        return QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        return QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )

    def scaling_mode(self, role):
        if role == "kernel" and not self.disable_2d_quantization:
            return ScalingMode.NVFP4_2D_SCALING
        return ScalingMode.NVFP4_1D_SCALING

    def q_dtype(self, role):
        return jnp.float4_e2m1fn


class _Unsupported(Recipe):
    """A TransformerEngine recipe lowbit does not implement: constructing one says so."""

    _why = ""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(f"{type(self).__name__} is not supported by lowbit: {self._why}")


_BLOCK_F32_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_FP8FormatRecipe):
    """DeepSeek-style FP8 block scaling: float32 scales per 1x128 block of activations and
    gradients (along the contraction axis) and per 128x128 tile of weights.

    TransformerEngine's fields and defaults. ``use_f32_scales`` (default from the environment
    variable ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``) turns off the power-of-two rounding of the
    scales; ``fp8_quant_{fwd_inp,fwd_weight,bwd_grad}`` are the per-role QParams (only
    ``power_2_scale`` and ``amax_epsilon`` apply); left at None they follow ``use_f32_scales``
    (in TransformerEngine they are class attributes fixed at import from the environment
    variable; here they can also be passed). ``{x,w,grad}_block_scaling_dim``: 1 (1x128) or 2
    (128x128); no GEMM may pair two 2-D operands. Split accumulation is required for every GEMM
    (``fp8_gemm_*.use_split_accumulator=True``), FP8 attention is not offered, and
    ``fp8_format`` is E4M3 or HYBRID (E5M2 gradients).
    """

    use_f32_scales: bool = dataclasses.field(default_factory=lambda: os.getenv(_BLOCK_F32_ENV, "0") == "1")
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.fp8_format is Format.E5M2:
            raise ValueError(
                "Float8BlockScaling(fp8_format=Format.E5M2): pure E5M2 training is not supported; "
                "use Format.E4M3 or Format.HYBRID"
            )
        if not isinstance(self.use_f32_scales, bool):
            raise TypeError(f"use_f32_scales must be a bool, got {self.use_f32_scales!r}")
        default_q = QParams(power_2_scale=not self.use_f32_scales, amax_epsilon=0.0)
        for f in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            q = getattr(self, f)
            if q is None:
                object.__setattr__(self, f, default_q)
                continue
            if not isinstance(q, QParams):
                raise TypeError(f"{f} must be a lowbit.recipe.QParams, got {q!r}")
            eps = q.amax_epsilon
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < float("inf")):
                raise ValueError(f"{f}.amax_epsilon must be a finite float >= 0, got {eps!r}")
            if q.random_hadamard_transform or q.stochastic_rounding or q.fp4_2d_quantization:
                raise ValueError(
                    f"{f}: the Hadamard transform, stochastic rounding and fp4_2d_quantization are "
                    "NVFP4 options, not Float8BlockScaling's"
                )
        dims = {
            "x": self.x_block_scaling_dim,
            "w": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }
        for name, d in dims.items():
            if isinstance(d, bool) or d not in (1, 2):
                raise ValueError(f"{name}_block_scaling_dim must be 1 or 2, got {d!r}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"Float8BlockScaling: {a}_block_scaling_dim=2 and {b}_block_scaling_dim=2 would "
                    "need a 2D x 2D block-scaled GEMM, which cuBLASLt does not offer"
                )
        for f in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, f).use_split_accumulator:
                raise ValueError(
                    f"Float8BlockScaling: {f}.use_split_accumulator must be True (FP8 block "
                    "scaling needs split accumulation)"
                )
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError(
                "Float8BlockScaling(fp8_dpa/fp8_mha=True): FP8 attention is not supported for "
                "Float8BlockScaling"
            )
        _refuse_unless_default(self, {"backward_override": None}, _BACKWARD)

    def scaling_mode(self, role):
        dim = {"x": self.x_block_scaling_dim, "kernel": self.w_block_scaling_dim}.get(
            role, self.grad_block_scaling_dim
        )
        return ScalingMode.BLOCK_2D_SCALING if dim == 2 else ScalingMode.BLOCK_1D_SCALING

    def qparams(self, role: str) -> QParams:
        """The QParams of a role ("x", "kernel" or "grad")."""
        return {"x": self.fp8_quant_fwd_inp, "kernel": self.fp8_quant_fwd_weight}.get(
            role, self.fp8_quant_bwd_grad
        )


class CustomRecipe(_Unsupported):
    """TransformerEngine's quantizer-factory recipe (not in lowbit)."""

    _why = "lowbit has no per-role quantizer factories; pick one of lowbit's five recipes"
