"""The names TE 2.20 has that lowbit.te added last (issue 25): ``compute_scale_from_amax``, TE's
scale_inv padding, ``get_mesh_axis_rank_host``, ``LoRAScope``, ``tex.gemm``, the Quantizer's
``data_layout`` / ``checkpoint_name``, ``quantization_checkpoint_name`` (quantized residuals named
for remat policies), ``return_max_logit`` and the refused ``score_mod`` fields. References are
float64 numpy or shapes worked out by hand from TE's documented layout."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
import lowbit.te.cpp_extensions as tex
import lowbit.te.flax as te_flax
from lowbit import recipe as R
from lowbit.te.flax.transformer import LoRAScope
from lowbit.te.quantize import (
    Quantizer,
    QuantizerFactory,
    ScalingMode,
    apply_padding_to_scale_inv,
    compute_scale_from_amax,
    remove_padding_from_scale_inv,
)
from lowbit.te.sharding import get_mesh_axis_rank_host

pytestmark = pytest.mark.usefixtures("on_cpu")


# ---- compute_scale_from_amax ------------------------------------------------------------------
@pytest.mark.parametrize("dtype,fp8_max", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
@pytest.mark.parametrize("margin", [0, 2.0])
def test_compute_scale_from_amax_matches_float64(dtype, fp8_max, margin):
    for amax in (3.0, 1e-3, 1e4):
        got = compute_scale_from_amax(jnp.array([amax], jnp.float32), dtype, margin)
        want = fp8_max / np.float64(np.float32(amax)) / 2.0**margin
        assert got.shape == (1,) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.float64(got[0]), want, rtol=2e-7)


def test_compute_scale_from_amax_keeps_scale_where_amax_is_zero_or_not_finite():
    prev = jnp.array([7.0], jnp.float32)
    for amax in (0.0, np.inf, np.nan):
        a = jnp.array([amax], jnp.float32)
        assert float(compute_scale_from_amax(a, jnp.float8_e4m3fn, 0, prev)[0]) == 7.0
        assert float(compute_scale_from_amax(a, jnp.float8_e4m3fn, 0)[0]) == 1.0
    with pytest.raises(ValueError, match=r"shape \(1,\)"):
        compute_scale_from_amax(jnp.ones((2,)), jnp.float8_e4m3fn, 0)


# ---- TE's padded scale_inv layout -------------------------------------------------------------
def test_mxfp8_scale_padding_round_trips_lowbit_scales():
    x = jax.random.normal(jax.random.PRNGKey(0), (40, 64))
    s = lowbit.quantize(x, ScalingMode.MXFP8_1D_SCALING).scale_inv  # lowbit: unpadded (40, 64/32)
    assert s.shape == (40, 2)
    p = apply_padding_to_scale_inv(s, ScalingMode.MXFP8_1D_SCALING, x.shape)
    # TE: rows padded to a multiple of 128, column blocks to a multiple of 4
    assert p.shape == (128, 4) and p.dtype == s.dtype
    np.testing.assert_array_equal(np.float32(p[:40, :2]), np.float32(s))
    pad = np.concatenate([np.float32(p[40:]).ravel(), np.float32(p[:40, 2:]).ravel()])
    assert np.all(pad == 2.0**-127)
    back = remove_padding_from_scale_inv(p, ScalingMode.MXFP8_1D_SCALING, x.shape)
    np.testing.assert_array_equal(np.float32(back), np.float32(s))
    # already in the asked-for layout: returned as is
    assert apply_padding_to_scale_inv(p, ScalingMode.MXFP8_1D_SCALING, x.shape) is p
    assert remove_padding_from_scale_inv(s, ScalingMode.MXFP8_1D_SCALING, x.shape) is s


def test_scale_padding_colwise_and_3d_shapes():
    mode = ScalingMode.MXFP8_1D_SCALING
    s = jnp.ones((2, 40), jnp.float32)  # colwise of (64, 40): blocks of 32 rows
    p = apply_padding_to_scale_inv(s, mode, (64, 40), is_colwise=True)
    assert p.shape == (4, 128)
    np.testing.assert_array_equal(remove_padding_from_scale_inv(p, mode, (64, 40), is_colwise=True), s)
    s3 = jnp.arange(2 * 64 * 2, dtype=jnp.float32).reshape(2, 64, 2)  # (2, 64, 64) rowwise
    p3 = apply_padding_to_scale_inv(s3, mode, (2, 64, 64))
    assert p3.shape == (2, 64, 4)
    np.testing.assert_array_equal(remove_padding_from_scale_inv(p3, mode, (2, 64, 64)), s3)


def test_scale_padding_tensor_scaling_and_refusals():
    one = jnp.ones((1,), jnp.float32)
    for mode in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING):
        assert apply_padding_to_scale_inv(one, mode, (8, 8)) is one
        assert remove_padding_from_scale_inv(one, mode, (8, 8)) is one
    with pytest.raises(ValueError, match="transposed"):
        apply_padding_to_scale_inv(jnp.ones((4, 8)), ScalingMode.NVFP4_1D_SCALING, (64, 8), is_colwise=True)
    with pytest.raises(NotImplementedError, match="BLOCK_1D_SCALING"):
        apply_padding_to_scale_inv(jnp.ones((1, 8)), ScalingMode.BLOCK_1D_SCALING, (8, 128))
    with pytest.raises(ValueError, match="must have shape"):
        apply_padding_to_scale_inv(jnp.ones((3, 3)), ScalingMode.MXFP8_1D_SCALING, (40, 64))


# ---- sharding, LoRAScope ----------------------------------------------------------------------
def test_get_mesh_axis_rank_host():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp"))
    assert get_mesh_axis_rank_host("tp", mesh) == 0 and isinstance(get_mesh_axis_rank_host("dp", mesh), int)
    with pytest.raises(ValueError, match="'cp' not found"):
        get_mesh_axis_rank_host("cp", mesh)


def test_lora_scope():
    assert LoRAScope(True, False, True) == LoRAScope(qkv_proj=True, mlp=True)
    assert LoRAScope() != LoRAScope(output_proj=True)


# ---- tex.gemm ---------------------------------------------------------------------------------
def test_gemm_matches_float64_with_any_contracting_dims():
    a = np.random.default_rng(0).standard_normal((64, 3, 5))
    b = np.random.default_rng(1).standard_normal((7, 64))
    bias = np.random.default_rng(2).standard_normal((3, 5, 7))
    y = tex.gemm(jnp.float32(a), jnp.float32(b), jnp.float32(bias), contracting_dims=((0,), (1,)))
    want = np.einsum("kij,nk->ijn", a, b) + bias
    assert y.shape == (3, 5, 7) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.float64(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "recipe", [R.Float8CurrentScaling(), R.MXFP8BlockScaling()], ids=["current", "mxfp8"]
)
def test_gemm_with_quantizers_contracts_the_quantized_values(recipe):
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)
    y = tex.gemm(x, w, lhs_quantizer=qs.x, rhs_quantizer=qs.kernel)
    # reference: each operand quantized along the contraction (w as (N, K)), product in float64
    mode = recipe.scaling_mode("x")
    xq = np.float64(lowbit.dequantize(lowbit.quantize(x, mode, recipe.q_dtype("x"))))
    wq = np.float64(lowbit.dequantize(lowbit.quantize(w.T, mode, recipe.q_dtype("kernel")))).T
    np.testing.assert_allclose(np.float64(y), xq @ wq, rtol=1e-5, atol=1e-4)
    exact = np.float64(x) @ np.float64(w)
    assert np.abs(np.float64(y) - exact).max() > 1e-3  # it did quantize
    np.testing.assert_array_equal(y, tex.gemm(x, w, quantizer_set=qs))


def test_gemm_refusals():
    x = jnp.ones((4, 8))
    with pytest.raises(NotImplementedError, match="collective_op"):
        tex.gemm(x, x.T, collective_op=tex.CollectiveOp.ALL_GATHER)
    with pytest.raises(NotImplementedError, match="fuse_gelu"):
        tex.gemm(x, x.T, fuse_gelu=True)
    with pytest.raises(ValueError, match="different sizes"):
        tex.gemm(x, x, contracting_dims=((1,), (0,)))


# ---- Quantizer fields -------------------------------------------------------------------------
def test_quantizer_data_layout_and_checkpoint_name():
    q = QuantizerFactory.create_set(fp8_recipe=R.MXFP8BlockScaling()).x
    assert q.data_layout == "NT" and q.get_data_layout() == "NT" and q.checkpoint_name is None
    with pytest.raises(NotImplementedError, match="data_layout='NN'"):
        Quantizer(ScalingMode.MXFP8_1D_SCALING, jnp.float8_e4m3fn, data_layout="NN")
    with pytest.raises(TypeError, match="checkpoint_name"):
        Quantizer(ScalingMode.MXFP8_1D_SCALING, jnp.float8_e4m3fn, checkpoint_name=3)


# ---- quantization_checkpoint_name -------------------------------------------------------------
def _mlp_jaxpr(recipe, name):
    with lowbit.autocast(enabled=True, recipe=recipe):
        m = te_flax.LayerNormMLP(
            layernorm_type="rmsnorm", dtype=jnp.bfloat16, quantization_checkpoint_name=name
        )
        x = jnp.ones((128, 128), jnp.bfloat16)
        v = m.init(jax.random.PRNGKey(0), x)
        return jax.make_jaxpr(jax.value_and_grad(lambda x: jnp.mean(m.apply(v, x)[0])))(x)


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling(), R.MXFP8BlockScaling()])
def test_layernorm_mlp_names_its_quantized_residuals(recipe):
    """TE's own count (test_recipe_characteristics): 2 GEMMs x (x, kernel) x 3 arrays each."""
    for name, count in ((None, 0), ("quantization", 12)):
        eqns = _mlp_jaxpr(recipe, name).jaxpr.eqns
        named = [e for e in eqns if e.primitive.name == "name" and e.params["name"] == name]
        assert len(named) == count
        if name:
            assert all(jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating) for e in named)


def _saved(capsys, name, policy):
    m = te_flax.DenseGeneral(features=64, quantization_checkpoint_name=name)
    x = jnp.ones((32, 64))
    with lowbit.autocast(enabled=True, recipe=R.Float8CurrentScaling()):
        p = m.init(jax.random.PRNGKey(0), x)["params"]
        f = jax.checkpoint(lambda p, x: jnp.sum(m.apply({"params": p}, x)), policy=policy)
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(f, p, x)
    return capsys.readouterr().out


def test_remat_policy_keeps_the_named_quantized_tensors(capsys):
    keep = jax.checkpoint_policies.save_only_these_names("quantization")
    saved = _saved(capsys, "quantization", keep)
    assert saved.count("f8_e4m3fn") == 2  # x's colwise and the kernel's rowwise copy
    assert "f8_" not in _saved(capsys, None, keep)  # unnamed: recomputed in the backward
    assert "f8_" not in _saved(capsys, "quantization", jax.checkpoint_policies.nothing_saveable)


def test_functional_dense_names_with_the_quantizer_sets_name():
    import lowbit.te.dense as te_dense

    qs = QuantizerFactory.create_set(fp8_recipe=R.Float8CurrentScaling())
    named = dataclasses.replace(
        qs, **{f: dataclasses.replace(getattr(qs, f), checkpoint_name="qn") for f in ("x", "kernel", "dgrad")}
    )
    x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
    for s, count in ((qs, 0), (named, 6)):
        jp = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(te_dense.dense(x, w, quantizer_set=s))))(x)
        assert sum(e.primitive.name == "name" and e.params["name"] == "qn" for e in jp.jaxpr.eqns) == count


# ---- return_max_logit, score_mod --------------------------------------------------------------
def _max_logit_f64(q, k, scale, masked, bias):
    q, k = np.float64(q), np.float64(k)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        s = s + np.float64(bias)
    s = np.where(masked, -np.inf, s)
    return s.max(axis=(0, 2, 3))


@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask"])
def test_return_max_logit_is_the_per_head_max_of_the_softmax_input(mask_type):
    b, s, h, g, d = 2, 6, 4, 2, 8
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v = (jax.random.normal(kk, (b, s, n, d)) for kk, n in zip(ks, (h, g, g)))
    bias = jax.random.normal(ks[3], (1, h, s, s))
    pad = np.zeros((b, 1, s, s), bool)
    pad[1, :, :, 4:] = True  # the second sequence's last 2 keys are padding
    masked = np.broadcast_to(pad if mask_type == "padding" else False, (b, h, s, s))
    if mask_type == "causal":
        masked = masked | np.triu(np.ones((s, s), bool), 1)
    mask = jnp.asarray(pad) if mask_type == "padding" else None
    kw = dict(head_dim=d, num_attention_heads=h, num_gqa_groups=g, attn_mask_type=mask_type)
    dpa = te_flax.DotProductAttention(**kw, return_max_logit=True)
    (out, ml), _ = dpa.init_with_output(jax.random.PRNGKey(0), q, k, v, mask, bias, deterministic=True)
    plain = te_flax.DotProductAttention(**kw).apply({}, q, k, v, mask, bias, deterministic=True)
    np.testing.assert_array_equal(out, plain)
    assert ml.shape == (h,) and ml.dtype == out.dtype
    np.testing.assert_allclose(
        np.float64(ml), _max_logit_f64(q, k, 1 / math.sqrt(d), masked, bias), rtol=1e-6
    )
    # no gradient flows through max_logit (TE's has none); the output's does
    g_ml = jax.grad(lambda q: jnp.sum(dpa.apply({}, q, k, v, mask, bias, deterministic=True)[1]))(q)
    assert not np.any(g_ml)


def test_return_max_logit_refused_where_lowbit_cannot():
    q = jnp.ones((1, 4, 2, 8))
    dpa = te_flax.DotProductAttention(
        head_dim=8, num_attention_heads=2, softmax_type="off_by_one", return_max_logit=True
    )
    with pytest.raises(NotImplementedError, match="return_max_logit"):
        dpa.init(jax.random.PRNGKey(0), q, q, q, deterministic=True)


@pytest.mark.parametrize("field", ["score_mod", "score_mod_bprop"])
def test_score_mod_is_refused_naming_the_field(field):
    q = jnp.ones((1, 4, 2, 8))
    fn = lambda *a: a  # noqa: E731
    dpa = te_flax.DotProductAttention(head_dim=8, num_attention_heads=2, **{field: fn})
    with pytest.raises(NotImplementedError, match=f"DotProductAttention\\({field}="):
        dpa.init(jax.random.PRNGKey(0), q, q, q, deterministic=True)
    layer = te_flax.TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, **{field: fn})
    with pytest.raises(NotImplementedError, match=field):
        layer.init(jax.random.PRNGKey(0), jnp.ones((1, 4, 16)), deterministic=True)


def test_get_xla_flag(monkeypatch):
    from lowbit.te.cpp_extensions.misc import get_xla_flag

    monkeypatch.setenv("XLA_FLAGS", "--xla_a --xla_b=3 --xla_c=x")
    assert get_xla_flag("--xla_a") is True and get_xla_flag("--xla_b", cast=int) == 3
    assert get_xla_flag("--xla_c") == "x" and get_xla_flag("--xla_c", cast=None) == "x"
    assert get_xla_flag("--xla_d", default=5) == 5 and get_xla_flag("--xla") is None
    with pytest.raises(ValueError):
        get_xla_flag("--xla_c", cast=int)
    monkeypatch.delenv("XLA_FLAGS")
    assert get_xla_flag("--xla_a") is None


def test_nvfp4_quantizers_say_where_lowbit_applies_the_hadamard_transform():
    qs = QuantizerFactory.create_set(fp8_recipe=R.NVFP4BlockScaling())
    assert (qs.x.use_rht, qs.kernel.use_rht, qs.dgrad.use_rht) == (True, False, True)
    off = QuantizerFactory.create_set(fp8_recipe=R.NVFP4BlockScaling(disable_rht=True))
    assert not any(q.use_rht for q in (off.x, off.kernel, off.dgrad))
