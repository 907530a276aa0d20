"""``transformer_engine.jax.quantize`` for lowbit: the quantizer objects TE's functional ops take,
and TE's configuration queries.

A :class:`QuantizerSet` here is a description of one GEMM's quantization (a lowbit recipe plus,
for DelayedScaling, the scales and amax histories as pytree leaves); lowbit's ops do the
quantizing. Differentiating through an op with respect to a delayed set gives the updated set,
as in TransformerEngine.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import FrozenDict

from lowbit import capabilities
from lowbit.autocast import autocast, get_recipe
from lowbit.capabilities import get_supported_quantization_recipes, get_supported_scaling_modes
from lowbit.delayed_scaling import init_grouped_delayed_state
from lowbit.flax import OVERWRITE_WITH_GRADIENT
from lowbit.quantization.scaling_modes import ScalingMode
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from lowbit.sharding import MeshResource

#: The collection holding DelayedScaling state (TE's NVTE_FP8_COLLECTION_NAME).
NVTE_FP8_COLLECTION_NAME = OVERWRITE_WITH_GRADIENT


class QuantizeLayout(enum.Enum):
    """Which copies a quantizer writes: rowwise, colwise (transposed) or both."""

    ROWWISE = "rowwise"
    COLWISE = "colwise"
    ROWWISE_COLWISE = "both"


class TensorSource(enum.Enum):
    """The role of a quantized tensor in a GEMM."""

    X = "x"
    KERNEL = "kernel"
    DGRAD = "grad"


class AmaxComputeAlgo(str, enum.Enum):
    """DelayedScaling's amax from its history: the maximum or the most recent value (a str enum:
    equal to the recipe's strings)."""

    MAX = "max"
    MOST_RECENT = "most_recent"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantizer:
    """One tensor role's quantization: scaling mode and dtype (static), and for delayed scaling
    the encode scale (1,) and amax history (L,) (pytree leaves)."""

    scaling_mode: ScalingMode = dataclasses.field(metadata=dict(static=True))
    q_dtype: Any = dataclasses.field(metadata=dict(static=True))
    q_layout: QuantizeLayout = dataclasses.field(
        default=QuantizeLayout.ROWWISE_COLWISE, metadata=dict(static=True)
    )
    scale: Optional[jax.Array] = None
    amax_history: Optional[jax.Array] = None
    rng: Optional[jax.Array] = None  # NVFP4 stochastic rounding (dgrad)
    # DelayedScaling's recipe fields, as TE's quantizers carry them
    margin: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    amax_compute_algo: AmaxComputeAlgo = dataclasses.field(
        default=AmaxComputeAlgo.MAX, metadata=dict(static=True)
    )
    #: layouts of the rowwise and the colwise copy: lowbit stores every colwise copy transposed
    data_layout: str = dataclasses.field(default="NT", metadata=dict(static=True))
    #: NVFP4: the random Hadamard transform on the colwise copy (lowbit: x and dgrad, for wgrad)
    use_rht: bool = dataclasses.field(default=False, metadata=dict(static=True))
    #: the name ``dense`` gives the quantized tensors it keeps for the backward (remat policies)
    checkpoint_name: Optional[str] = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.data_layout != "NT":
            raise NotImplementedError(
                f"Quantizer(data_layout={self.data_layout!r}): lowbit stores the rowwise copy as is and "
                "the colwise copy transposed, 'NT' only"
            )
        if self.checkpoint_name is not None and not isinstance(self.checkpoint_name, str):
            raise TypeError(f"Quantizer: checkpoint_name must be a str or None, got {self.checkpoint_name!r}")

    def get_data_layout(self) -> str:
        """The layout of the copies this quantizer writes ("N" rowwise, "T" colwise, "NT" both)."""
        if self.q_layout == QuantizeLayout.ROWWISE_COLWISE:
            return self.data_layout
        return self.data_layout[0] if self.q_layout == QuantizeLayout.ROWWISE else self.data_layout[1]

    @property
    def stochastic_rounding_rng_state(self) -> Optional[jax.Array]:
        """TE's name for the NVFP4 stochastic-rounding key (None: rounding to nearest)."""
        return self.rng


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """The quantizers of one GEMM: ``x``, ``kernel`` and ``dgrad`` (None each when unquantized)."""

    x: Optional[Quantizer] = None
    kernel: Optional[Quantizer] = None
    dgrad: Optional[Quantizer] = None
    # The recipe the set was made from, when there was one (keeps NVFP4's options).
    recipe: Optional[Recipe] = dataclasses.field(default=None, metadata=dict(static=True))

    def is_noop(self) -> bool:
        return self.x is None and self.kernel is None and self.dgrad is None


noop_quantizer_set = QuantizerSet()


def compute_scale_from_amax(
    amax: jax.Array, q_dtype, margin: float, scale: Optional[jax.Array] = None
) -> jax.Array:
    """TE's delayed-scaling update: ``(fp8_max / amax) / 2**margin`` (float32, shape (1,)); where
    amax is zero or not finite, ``scale`` (None: 1) is kept."""
    fp8_max = jnp.asarray(jnp.finfo(q_dtype).max, jnp.float32)
    amax = jnp.asarray(amax, jnp.float32)
    keep = jnp.ones((1,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    sf = (fp8_max / amax) / (2.0 ** jnp.asarray(margin, jnp.float32))
    sf = jnp.where((amax > 0.0) & jnp.isfinite(amax), sf, keep)
    if sf.shape != (1,):
        raise ValueError(
            f"compute_scale_from_amax: amax and scale must give shape (1,), got amax {amax.shape}, "
            f"scale {None if scale is None else jnp.shape(scale)}"
        )
    return sf


def _format_of(fwd_dtype, bwd_dtype) -> Format:
    pair = (np.dtype(fwd_dtype), np.dtype(bwd_dtype))
    for fmt in (Format.E4M3, Format.E5M2, Format.HYBRID):
        if pair == (np.dtype(fmt.fwd_dtype), np.dtype(fmt.bwd_dtype)):
            return fmt
    raise ValueError(f"no FP8 format has forward dtype {pair[0]} and backward dtype {pair[1]}")


def _recipe_for_mode(mode: ScalingMode, fwd_dtype, bwd_dtype, history_len: int) -> Optional[Recipe]:
    if mode == ScalingMode.NO_SCALING:
        return None
    if mode.is_nvfp4:
        return NVFP4BlockScaling()
    fwd = fwd_dtype if fwd_dtype is not None else jnp.float8_e4m3fn
    mx = mode == ScalingMode.MXFP8_1D_SCALING or mode.is_fp8_block
    bwd = bwd_dtype if bwd_dtype is not None else (jnp.float8_e4m3fn if mx else jnp.float8_e5m2)
    fmt = _format_of(fwd, bwd)  # E5M2/E5M2 per-tensor: the recipe refuses it (no GEMM runs it)
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        return DelayedScaling(fp8_format=fmt, amax_history_len=history_len)
    if mode == ScalingMode.CURRENT_TENSOR_SCALING:
        return Float8CurrentScaling(fp8_format=fmt)
    if mode.is_fp8_block:
        return Float8BlockScaling(fp8_format=fmt)
    return MXFP8BlockScaling(fp8_format=fmt)


def quantizer_set_for_recipe(
    recipe: Optional[Recipe], state: Optional[Mapping] = None, checkpoint_name: Optional[str] = None
) -> QuantizerSet:
    """The QuantizerSet of ``recipe`` (noop for None); DelayedScaling takes its state from
    ``state`` (lowbit's ``{role}_scale`` / ``{role}_amax_history`` keys) or starts fresh.
    ``checkpoint_name``: the quantizers' (TE's quantization_checkpoint_name)."""
    if recipe is None:
        return noop_quantizer_set
    if not isinstance(recipe, Recipe):
        raise TypeError(f"expected a lowbit recipe or None, got {type(recipe).__name__}")
    parts = {}
    for field, role in (("x", "x"), ("kernel", "kernel"), ("dgrad", "grad")):
        scale = hist = None
        if isinstance(recipe, DelayedScaling):
            if state is not None:
                scale, hist = state[f"{role}_scale"], state[f"{role}_amax_history"]
            else:
                scale = jnp.ones((1,), jnp.float32)
                hist = jnp.zeros((recipe.amax_history_len,), jnp.float32)
        delayed = {}
        if isinstance(recipe, DelayedScaling):
            delayed = dict(
                margin=float(recipe.margin), amax_compute_algo=AmaxComputeAlgo(recipe.amax_compute_algo)
            )
        parts[field] = Quantizer(
            recipe.scaling_mode(role),
            recipe.q_dtype(role),
            scale=scale,
            amax_history=hist,
            checkpoint_name=checkpoint_name,
            use_rht=isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_rht and role != "kernel",
            **delayed,
        )
    return QuantizerSet(**parts, recipe=recipe)


def recipe_of(quantizer_set: Optional[QuantizerSet]) -> Tuple[Optional[Recipe], Optional[dict]]:
    """(lowbit recipe, DelayedScaling state or None) that ``quantizer_set`` describes."""
    if quantizer_set is None or quantizer_set.is_noop():
        return None, None
    if not isinstance(quantizer_set, QuantizerSet):
        raise TypeError(
            f"quantizer_set must be a lowbit.te.quantize.QuantizerSet, got {type(quantizer_set).__name__}"
        )
    qs = {"x": quantizer_set.x, "kernel": quantizer_set.kernel, "grad": quantizer_set.dgrad}
    if any(q is None for q in qs.values()):
        raise NotImplementedError(
            "lowbit quantizes all three GEMM operands or none; "
            "a QuantizerSet with some quantizers None is not supported"
        )
    mode = qs["x"].scaling_mode
    if quantizer_set.recipe is not None and not isinstance(quantizer_set.recipe, DelayedScaling):
        return _without_sr_if_no_key(quantizer_set.recipe, qs["grad"]), None
    if mode.is_nvfp4:
        two_d = qs["kernel"].scaling_mode == ScalingMode.NVFP4_2D_SCALING
        return _without_sr_if_no_key(NVFP4BlockScaling(disable_2d_quantization=not two_d), qs["grad"]), None
    if any(q.scaling_mode != mode for q in qs.values()):
        raise NotImplementedError(
            "lowbit needs one scaling mode for x, kernel and dgrad, got "
            f"{[q.scaling_mode.name for q in qs.values()]}"
        )
    hist = qs["x"].amax_history
    recipe = _recipe_for_mode(
        mode, qs["x"].q_dtype, qs["grad"].q_dtype, 1024 if hist is None else int(hist.shape[0])
    )
    if not isinstance(recipe, DelayedScaling):
        return recipe, None
    state = {}
    for role, q in qs.items():
        state[f"{role}_scale"], state[f"{role}_amax_history"] = q.scale, q.amax_history
    return recipe, state


def _without_sr_if_no_key(recipe: Recipe, dgrad: Quantizer) -> Recipe:
    # TE rounds NVFP4 gradients stochastically only when the quantizer has an RNG key; without
    # one it rounds to nearest (lowbit.dense itself requires the key when the recipe asks for it).
    if isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_stochastic_rounding and dgrad.rng is None:
        return dataclasses.replace(recipe, disable_stochastic_rounding=True)
    return recipe


def is_scaling_mode_supported(
    scaling_mode: ScalingMode = ScalingMode.NO_SCALING, gpu_id: Optional[int] = None
) -> Tuple[bool, str]:
    """TE's query: (supported, reason). lowbit answers for every local device (``gpu_id`` is
    accepted and not narrowed to one)."""
    del gpu_id
    return capabilities.is_scaling_mode_supported(scaling_mode)


def is_fp8_available(
    scaling_mode: ScalingMode = ScalingMode.DELAYED_TENSOR_SCALING, gpu_id: Optional[int] = None
) -> Tuple[bool, str]:
    """TE's query: (available, reason) for ``scaling_mode`` on every local device."""
    return is_scaling_mode_supported(scaling_mode, gpu_id)


class QuantizerFactory:
    """TransformerEngine's factory: quantizer sets from a scaling mode and dtypes, a recipe, or
    (with neither) the recipe of the enclosing :func:`autocast`."""

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1,
        scaling_mode: Optional[ScalingMode] = None,
        fwd_dtype=None,
        bwd_dtype=None,
        is_2x2x: Optional[bool] = None,
        n_groups: Optional[int] = None,
        fp8_recipe: Optional[Recipe] = None,
        **kwargs: Any,
    ) -> Union[QuantizerSet, Tuple[QuantizerSet, ...]]:
        """``n_groups``: sets for a grouped GEMM of that many groups (grouped_dense, moe.moe):
        DelayedScaling gets one scale and amax history per group
        (:func:`lowbit.init_grouped_delayed_state`'s layout); other recipes are stateless."""
        if n_groups is not None and (
            isinstance(n_groups, bool) or not isinstance(n_groups, (int, np.integer)) or n_groups < 1
        ):
            raise ValueError(
                f"QuantizerFactory.create_set: n_groups must be a positive int or None, got {n_groups!r}"
            )
        if kwargs:
            raise NotImplementedError(f"QuantizerFactory.create_set: unsupported arguments {sorted(kwargs)}")
        del is_2x2x  # lowbit always writes the copies each GEMM needs
        if fp8_recipe is not None and scaling_mode is not None:
            raise ValueError("QuantizerFactory.create_set: give scaling_mode or fp8_recipe, not both")
        if fp8_recipe is not None:
            recipe = fp8_recipe
        elif scaling_mode is not None:
            recipe = _recipe_for_mode(ScalingMode(int(scaling_mode)), fwd_dtype, bwd_dtype, 1024)
        else:
            recipe = get_recipe()
        state = None
        if n_groups is not None and isinstance(recipe, DelayedScaling):
            state = init_grouped_delayed_state(recipe, int(n_groups))
        sets = tuple(quantizer_set_for_recipe(recipe, state) for _ in range(n_quantizer_sets))
        return sets[0] if n_quantizer_sets == 1 else sets


# ---------------------------------------------------------------------------------------------
# Configuration queries (TE's helper module)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What a recipe means for the quantizers, in TE's attribute names (read-only)."""

    INITIALIZED: bool
    SCALING_MODE: ScalingMode
    FWD_DTYPE: Any
    BWD_DTYPE: Any
    MARGIN: float = 0.0
    AMAX_HISTORY_LEN: int = 1024
    AMAX_COMPUTE_ALGO: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    COLLECTION_NAME: str = NVTE_FP8_COLLECTION_NAME
    RECIPE: Optional[Recipe] = None

    def is_fp8_enabled(self) -> bool:
        return self.INITIALIZED

    @property
    def DISABLE_STOCHASTIC_ROUNDING(self) -> bool:  # noqa: N802 - TE's attribute names
        return bool(getattr(self.RECIPE, "disable_stochastic_rounding", True))

    @property
    def DISABLE_RHT(self) -> bool:  # noqa: N802
        return bool(getattr(self.RECIPE, "disable_rht", True))

    @property
    def DISABLE_2D_QUANTIZATION(self) -> bool:  # noqa: N802
        return bool(getattr(self.RECIPE, "disable_2d_quantization", True))

    def get_scaling_mode(self, tensor_source: Optional[TensorSource] = None) -> ScalingMode:
        """The scaling mode of one GEMM operand (TE's TensorSource X, KERNEL or DGRAD; None: X)."""
        if self.RECIPE is None:
            return ScalingMode.NO_SCALING
        source = TensorSource.X if tensor_source is None else TensorSource(tensor_source)
        return self.RECIPE.scaling_mode(source.value)


def get_quantize_config_with_recipe(fp8_recipe: Optional[Recipe]) -> QuantizeConfig:
    """The :class:`QuantizeConfig` of ``fp8_recipe`` (None: quantization off)."""
    recipe = fp8_recipe
    if recipe is None:
        return QuantizeConfig(False, ScalingMode.NO_SCALING, jnp.bfloat16, jnp.bfloat16)
    delayed = isinstance(recipe, DelayedScaling)
    return QuantizeConfig(
        True,
        recipe.scaling_mode("x"),
        recipe.q_dtype("x"),
        recipe.q_dtype("grad"),
        MARGIN=float(getattr(recipe, "margin", 0)),
        AMAX_HISTORY_LEN=recipe.amax_history_len if delayed else 0,
        AMAX_COMPUTE_ALGO=AmaxComputeAlgo(recipe.amax_compute_algo if delayed else "max"),
        RECIPE=recipe,
    )


def get_global_quantize_recipe() -> Optional[Recipe]:
    """The recipe of the enclosing enabled :func:`autocast`, or None."""
    return get_recipe()


def get_quantize_config() -> QuantizeConfig:
    """The :class:`QuantizeConfig` of the enclosing :func:`autocast`."""
    return get_quantize_config_with_recipe(get_recipe())


def get_delayed_scaling() -> DelayedScaling:
    """The DelayedScaling in effect (TE's query): the autocast recipe, or the default one."""
    r = get_recipe()
    return r if isinstance(r, DelayedScaling) else DelayedScaling()


def fp8_autocast(
    enabled: bool = False, fp8_recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None
):
    """TransformerEngine's older name of :func:`lowbit.autocast`."""
    return autocast(enabled, fp8_recipe, mesh_resource)


Collection = Union[dict, FrozenDict]


def update_collections(new: Collection, original: Collection) -> Collection:
    """``original`` with the top-level entries of ``new`` replacing its own (same type as
    ``original``): how a training step writes back the updated ``_overwrite_with_gradient``."""
    for name, c in (("new", new), ("original", original)):
        if not isinstance(c, (dict, FrozenDict)):
            raise TypeError(
                f"update_collections: {name} must be a dict or FrozenDict, got {type(c).__name__}"
            )
    merged = {**dict(original), **dict(new)}
    return FrozenDict(merged) if isinstance(original, FrozenDict) else merged


__all__ = [
    "AmaxComputeAlgo",
    "NVTE_FP8_COLLECTION_NAME",
    "QuantizeLayout",
    "TensorSource",
    "Quantizer",
    "QuantizerSet",
    "noop_quantizer_set",
    "compute_scale_from_amax",
    "QuantizerFactory",
    "QuantizeConfig",
    "ScalingMode",
    "autocast",
    "fp8_autocast",
    "get_quantize_config",
    "get_quantize_config_with_recipe",
    "get_global_quantize_recipe",
    "get_delayed_scaling",
    "update_collections",
    "is_fp8_available",
    "is_scaling_mode_supported",
    "get_supported_scaling_modes",
    "get_supported_quantization_recipes",
]
