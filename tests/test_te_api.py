"""lowbit.te's configuration surface, written as TransformerEngine users write it: capability
queries, autocast forms, recipes, quantizer factories, sharding names, collections."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax.core.frozen_dict import FrozenDict

# The port: only these imports differ from TransformerEngine code.
import lowbit.te as te
from lowbit import recipe
from lowbit.te import quantize as te_q
from lowbit.te.sharding import BATCH_AXES, HIDDEN_TP_AXES, W_FSDP_AXES, W_TP_AXES, MeshResource

pytestmark = pytest.mark.usefixtures("on_cpu")
ALL = (recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling)


def test_capability_queries_answer_every_recipe_on_cpu():
    assert te.is_fp8_available() == (True, "")
    for mode in te_q.ScalingMode:
        assert te.is_scaling_mode_supported(mode) == (True, "")
        assert te_q.is_fp8_available(mode)[0]
    got = te_q.get_supported_quantization_recipes()
    assert [type(r) for r in got] == [*ALL[:3], recipe.Float8BlockScaling, ALL[3]]
    assert set(te_q.get_supported_scaling_modes()) == set(te_q.ScalingMode)
    with pytest.raises(ValueError, match="scaling_mode"):
        te.is_scaling_mode_supported("mxfp8")


def test_autocast_argument_forms():
    r = recipe.Float8CurrentScaling()
    with te.autocast(True, r) as active:  # TE's positional order
        assert active is r and te_q.get_global_quantize_recipe() is r
    with te.autocast(enabled=True) as active:  # TE's default recipe
        assert isinstance(active, recipe.DelayedScaling)
    with te.autocast() as active:
        assert active is None and not te_q.get_quantize_config().is_fp8_enabled()
    with te.fp8_autocast(True, r, MeshResource("dp")) as active:
        assert active is r and te.sharding.global_mesh_resource().dp_resource == "dp"
    with pytest.warns(UserWarning, match="enabled=True"):
        with te.autocast(recipe=r) as active:
            assert active is None
    with pytest.raises(TypeError, match="enabled"):
        with te.autocast("yes"):
            pass


def test_quantize_config_queries():
    cfg = te_q.get_quantize_config_with_recipe(recipe.DelayedScaling(margin=1, amax_history_len=16))
    assert cfg.is_fp8_enabled() and cfg.SCALING_MODE == te_q.ScalingMode.DELAYED_TENSOR_SCALING
    assert (cfg.MARGIN, cfg.AMAX_HISTORY_LEN, cfg.AMAX_COMPUTE_ALGO) == (1.0, 16, "max")
    assert jnp.dtype(cfg.FWD_DTYPE) == jnp.float8_e4m3fn and jnp.dtype(cfg.BWD_DTYPE) == jnp.float8_e5m2
    with te.autocast(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=8)):
        assert te.get_delayed_scaling().amax_history_len == 8
    assert te.get_delayed_scaling() == recipe.DelayedScaling()
    assert te.NVTE_FP8_COLLECTION_NAME == "_overwrite_with_gradient"


def test_recipe_fields_and_predicates():
    assert recipe.Format.E4M3.value.max_fwd == 448 and recipe.Format.HYBRID.value.max_bwd == 57344
    assert recipe.Format.E2M1.value.max_fwd == 6
    d = recipe.DelayedScaling(margin=2.0)
    assert d.margin == 2 and d == recipe.DelayedScaling(margin=2)
    assert d.reduce_amax and d.scaling_factor_compute_algo is None and not d.fp8_dpa and not d.fp8_mha
    c = recipe.Float8CurrentScaling()
    assert not c.fp8_gemm_fprop.use_split_accumulator and c.fp8_gemm_wgrad.use_split_accumulator
    n = recipe.NVFP4BlockScaling()
    assert n.fp4_format is recipe.Format.E2M1 and n.fp8_format is recipe.Format.E4M3
    assert n.fp4_quant_bwd_grad.stochastic_rounding and n.fp4_quant_fwd_weight.fp4_2d_quantization
    assert recipe.MXFP8BlockScaling().margin == 0
    kinds = ("delayed", "float8_current_scaling", "mxfp8", "nvfp4")
    for cls, kind in zip(ALL, kinds):
        r = cls()
        assert getattr(r, kind)() and cls.__dict__.get(kind) is None
        assert [getattr(r, k)() for k in kinds].count(True) == 1
        assert not r.float8_block_scaling() and not r.custom()
    assert recipe.DelayedScaling.float8_per_tensor_scaling()
    assert not recipe.MXFP8BlockScaling.float8_per_tensor_scaling()


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (recipe.DelayedScaling, "scaling_factor_compute_algo", lambda *a: 1.0),
        (recipe.DelayedScaling, "reduce_amax", False),
        (recipe.MXFP8BlockScaling, "fp8_dpa", True),
        (recipe.MXFP8BlockScaling, "fp8_mha", True),
        (recipe.Float8CurrentScaling, "use_power_2_scales", True),
        (recipe.Float8CurrentScaling, "fp8_gemm_fprop", recipe.MMParams(use_split_accumulator=True)),
        (recipe.Float8CurrentScaling, "fp8_quant_fwd_inp", recipe.QParams(amax_epsilon=1e-3)),
        (recipe.MXFP8BlockScaling, "margin", 1),
        (recipe.MXFP8BlockScaling, "backward_override", "high_precision"),
        (recipe.NVFP4BlockScaling, "nvfp4_4over6", "all"),
        (recipe.NVFP4BlockScaling, "row_scaled_activation", True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_unhonoured_fields_are_refused_by_name(cls, field, value):
    cls(**{field: dataclasses.fields(cls)[[f.name for f in dataclasses.fields(cls)].index(field)].default})
    with pytest.raises(NotImplementedError, match=field):
        cls(**{field: value})


def test_unsupported_recipes_and_formats():
    assert recipe.CustomRecipe.custom()
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        recipe.CustomRecipe()
    assert recipe.Float8BlockScaling.float8_block_scaling()
    with pytest.raises(ValueError, match="fp4_format"):
        recipe.NVFP4BlockScaling(fp4_format=recipe.Format.E4M3)
    with pytest.raises(TypeError, match="fp8_format"):
        recipe.DelayedScaling(fp8_format=recipe.Format.E2M1)
    # TE has Format.E5M2 for per-tensor recipes; lowbit refuses it when built (no GEMM runs
    # E5M2 x E5M2), also when TE code asks for it through a scaling mode and dtypes.
    for cls in (recipe.DelayedScaling, recipe.Float8CurrentScaling):
        with pytest.raises(ValueError, match="fp8_format=Format.E5M2"):
            cls(fp8_format=recipe.Format.E5M2)
    for mode in (te_q.ScalingMode.DELAYED_TENSOR_SCALING, te_q.ScalingMode.CURRENT_TENSOR_SCALING):
        with pytest.raises(ValueError, match="fp8_format"):
            te_q.QuantizerFactory.create_set(
                scaling_mode=mode, fwd_dtype=jnp.float8_e5m2, bwd_dtype=jnp.float8_e5m2
            )
    assert recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E5M2).fp8_format is recipe.Format.E5M2


def test_quantizer_factory():
    qs = te_q.QuantizerFactory.create_set(
        scaling_mode=te_q.ScalingMode.CURRENT_TENSOR_SCALING,
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e5m2,
        is_2x2x=True,
    )
    assert te_q.recipe_of(qs) == (recipe.Float8CurrentScaling(), None)
    assert te_q.QuantizerFactory.create_set() == te_q.noop_quantizer_set  # no autocast: unquantized
    with te.autocast(enabled=True, recipe=recipe.MXFP8BlockScaling()):
        a, b = te_q.QuantizerFactory.create_set(n_quantizer_sets=2)
    assert a == b and a.x.scaling_mode == te_q.ScalingMode.MXFP8_1D_SCALING
    d = te_q.QuantizerFactory.create_set(fp8_recipe=recipe.DelayedScaling(amax_history_len=4))
    assert d.kernel.amax_history.shape == (4,) and d.dgrad.scale.shape == (1,)
    assert te_q.recipe_of(d)[0] == recipe.DelayedScaling(amax_history_len=4)
    assert {e.name for e in te_q.QuantizeLayout} == {"ROWWISE", "COLWISE", "ROWWISE_COLWISE"}
    assert {e.name for e in te_q.TensorSource} == {"X", "KERNEL", "DGRAD"}
    g = te_q.QuantizerFactory.create_set(fp8_recipe=recipe.DelayedScaling(amax_history_len=4), n_groups=3)
    assert g.x.amax_history.shape == (4, 3) and g.kernel.scale.shape == (3,)  # one per group
    with pytest.raises(ValueError, match="n_groups"):
        te_q.QuantizerFactory.create_set(n_groups=0)


def test_mesh_resource_and_axis_rules():
    mr = MeshResource("dp", "tp", None, "fsdp")  # TE's positional order
    assert (mr.dp_resource, mr.tp_resource, mr.tpsp_resource, mr.fsdp_resource) == ("dp", "tp", None, "fsdp")
    assert MeshResource(ep_resource="ep").ep_resource == "ep"
    with te.sharding.global_shard_guard(mr):
        rules = dict(te.flax.extend_logical_axis_rules((("embed", None),)))
        assert rules["embed"] is None and rules[BATCH_AXES] == "fsdp" and rules[W_FSDP_AXES] == "fsdp"
        assert rules[HIDDEN_TP_AXES] == "tp" and rules[W_TP_AXES] == "tp"
        with pytest.raises(ValueError, match="conflicts"):
            te.flax.extend_logical_axis_rules(((W_TP_AXES, "dp"),))


def test_update_collections():
    old = {"params": {"w": 1}, "_overwrite_with_gradient": {"x_scale": 1}}
    new = {"_overwrite_with_gradient": {"x_scale": 2}}
    got = te.update_collections(new, old)
    assert got == {"params": {"w": 1}, "_overwrite_with_gradient": {"x_scale": 2}} and type(got) is dict
    assert isinstance(te.update_collections(new, FrozenDict(old)), FrozenDict)
    with pytest.raises(TypeError, match="original"):
        te.update_collections(new, [old])
