"""lowbit.te's functional ops called the way TransformerEngine's tests call them, checked against
a plain float64 reference (relative Frobenius error, bounds per format as in test_dense.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

from lowbit import recipe
from lowbit.te.activation import activation
from lowbit.te.dense import dense
from lowbit.te.layernorm import layernorm
from lowbit.te.layernorm_dense import layernorm_dense
from lowbit.te.layernorm_mlp import layernorm_mlp
from lowbit.te.quantize import QuantizerFactory, noop_quantizer_set, recipe_of
from lowbit.te.softmax import SoftmaxFusionType, softmax

pytestmark = pytest.mark.usefixtures("on_cpu")
RECIPES = {
    "none": None,
    "current": recipe.Float8CurrentScaling(),
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "nvfp4": recipe.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
BOUNDS = {
    "none": (1e-5, 1e-5),
    "current": (0.04, 0.1),
    "delayed": (0.04, 0.1),
    "mxfp8": (0.04, 0.07),
    "nvfp4": (0.15, 0.3),
}


def qset(name):
    r = RECIPES[name]
    return noop_quantizer_set if r is None else QuantizerFactory.create_set(fp8_recipe=r)


def _ln64(x, g, b, eps=1e-6):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * np.asarray(g, np.float64) + b


@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_contracting_dims(name, rng):
    # x (K, B, S) contracted over axis 0, kernel (N, K) over axis 1: TE's non-default layout.
    x = jnp.asarray(rng.standard_normal((64, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((32, 64)) / 8, jnp.float32)
    b = jnp.asarray(rng.standard_normal((32,)), jnp.float32)
    qs = qset(name)

    def loss(x, k, b, qs):
        y = dense(x, k, b, contracting_dims=((0,), (1,)), quantizer_set=qs)
        return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, y), (dx, dk, db, dqs) = jax.jit(grad)(x, k, b, qs)
    x64, k64 = np.asarray(x, np.float64), np.asarray(k, np.float64)
    ref = np.einsum("kbs,nk->bsn", x64, k64) + np.asarray(b, np.float64)
    g = np.arange(ref.size, dtype=np.float64).reshape(ref.shape) / ref.size
    fwd, bwd = BOUNDS[name]
    assert y.shape == (2, 16, 32) and rel(y, ref) < fwd
    assert rel(dx, np.einsum("bsn,nk->kbs", g, k64)) < bwd
    assert rel(dk, np.einsum("bsn,kbs->nk", g, x64)) < bwd
    assert rel(db, g.sum((0, 1))) < 1e-5
    if name == "delayed":  # the set's "gradient" is the updated state (TE's DelayedScaling contract)
        r, state = recipe_of(dqs)
        assert r == RECIPES["delayed"]
        assert float(state["x_amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
        want = 448.0 / float(jnp.max(jnp.abs(k)))
        assert float(state["kernel_scale"][0]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", ["none", "current", "mxfp8"])
def test_layernorm_dense_and_layernorm(name, rng):
    x = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    g = jnp.asarray(1 + rng.standard_normal(64) / 4, jnp.float32)
    beta = jnp.asarray(rng.standard_normal(64) / 4, jnp.float32)
    k = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
    y = jax.jit(lambda x, k, g, b: layernorm_dense(x, k, g, b, quantizer_set=qset(name)))(x, k, g, beta)
    ln = _ln64(x, g, beta)
    assert rel(y, ln @ np.asarray(k, np.float64)) < BOUNDS[name][0]
    assert rel(layernorm(x, g, beta, "LayerNorm"), ln) < 1e-5
    rms = layernorm(x, g, None, "rmsnorm")
    x64 = np.asarray(x, np.float64)
    rms64 = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(g, np.float64)
    assert rel(rms, rms64) < 1e-5


@pytest.mark.parametrize("name", ["none", "current", "delayed"])
def test_layernorm_mlp_gated(name, rng):
    H, I = 32, 64
    x = jnp.asarray(rng.standard_normal((2, 8, H)), jnp.float32)
    g, b = jnp.ones((H,)), jnp.zeros((H,))
    k1 = jnp.asarray(rng.standard_normal((H, 2, I)) / 6, jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((I, H)) / 8, jnp.float32)
    b1 = jnp.asarray(rng.standard_normal((2, I)) / 4, jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((H,)) / 4, jnp.float32)
    sets = (qset(name), qset(name))
    y = jax.jit(
        lambda *a: layernorm_mlp(*a, "layernorm", activation_type=("silu", "linear"), quantizer_sets=sets)
    )(x, g, b, [k1, k2], [b1, b2])
    h = np.einsum("bsh,hai->bsai", _ln64(x, g, b), np.asarray(k1, np.float64)) + np.asarray(b1, np.float64)
    a = h[..., 0, :] / (1 + np.exp(-h[..., 0, :])) * h[..., 1, :]
    ref = a @ np.asarray(k2, np.float64) + np.asarray(b2, np.float64)
    assert y.shape == x.shape and rel(y, ref) < 2 * BOUNDS[name][0]


def test_activation_layout(rng):
    x = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    relu_gated = np.maximum(x64[:, 0], 0) * x64[:, 1]
    assert rel(activation(x, ("relu", "linear")), relu_gated) < 1e-6
    assert rel(activation(x[:, :1], ("relu",)), np.maximum(x64[:, 0], 0)) < 1e-6
    with pytest.raises(ValueError, match="shape"):
        activation(x, ("gelu",))
    with pytest.raises(TypeError, match="quantizer"):
        activation(x, ("relu", "linear"), quantizer=object())


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_norm_and_activation_quantizer_output_is_dequantized(rng, recipe_name):
    """TE's layernorm/activation with a quantizer: the forward output is the dequantized FP8
    value (within the format's rounding of the unquantized one), the gradient as unquantized."""
    from lowbit import recipe as lr
    from lowbit.te.layernorm import layernorm
    from lowbit.te.quantize import QuantizerFactory

    r = {"current": lr.Float8CurrentScaling(), "mxfp8": lr.MXFP8BlockScaling()}[recipe_name]
    q = QuantizerFactory.create_set(fp8_recipe=r).x
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    g, b = jnp.full((64,), 1.5), jnp.full((64,), 0.25)
    x64 = np.asarray(x, np.float64)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6) * 1.5 + 0.25
    y = layernorm(x, g, b, "layernorm", quantizer=q)
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert 0 < err.max() <= 2.0**-3 * np.abs(ref).max()  # E4M3: 3 mantissa bits
    dy = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    gq = jax.grad(lambda x: (layernorm(x, g, b, "layernorm", quantizer=q) * dy).sum())(x)
    g0 = jax.grad(lambda x: (layernorm(x, g, b, "layernorm") * dy).sum())(x)
    np.testing.assert_array_equal(gq, g0)
    xa = jnp.asarray(rng.standard_normal((32, 2, 64)), jnp.float32)
    ya = activation(xa, ("relu", "linear"), quantizer=q)
    ra = np.maximum(np.asarray(xa[:, 0], np.float64), 0) * np.asarray(xa[:, 1], np.float64)
    assert np.abs(np.asarray(ya, np.float64) - ra).max() <= 2.0**-3 * np.abs(ra).max()


def test_softmax_types(rng):
    x = jnp.asarray(rng.standard_normal((2, 2, 8, 8)), jnp.float32)
    x64 = np.asarray(x, np.float64) * 0.5

    def sm(v):
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    assert rel(softmax(x, scale_factor=0.5), sm(x64)) < 1e-5
    mask = (rng.random((2, 1, 8, 8)) < 0.3).astype(np.uint8)
    mask[..., 0] = 0
    got = softmax(x, jnp.asarray(mask), 0.5, SoftmaxFusionType.SCALED_MASKED)
    assert rel(got, sm(np.where(mask, -np.inf, x64))) < 1e-5
    causal = np.triu(np.ones((8, 8), bool), 1)
    got = softmax(x, None, 0.5, SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED)
    assert rel(got, sm(np.where(causal, -np.inf, x64))) < 1e-5


def test_softmax_fusion_type_renames_and_ignored_masks(rng):
    """TE 2.10 renamed SoftmaxType/softmax_type to SoftmaxFusionType/softmax_fusion_type; a mask
    given with the SCALED or causal types is ignored (lowbit raised before)."""
    import warnings

    import lowbit.te.softmax as te_sm
    from lowbit.flax import Softmax

    x = jnp.asarray(rng.standard_normal((2, 2, 8, 8)), jnp.float32)
    x64 = np.asarray(x, np.float64) * 0.5
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) < 0.3)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    plain = e / e.sum(-1, keepdims=True)
    assert rel(softmax(x, mask, 0.5, softmax_fusion_type=SoftmaxFusionType.SCALED), plain) < 1e-5
    causal = np.where(np.triu(np.ones((8, 8), bool), 1), -np.inf, x64)
    e = np.exp(causal - causal.max(-1, keepdims=True))
    tri = e / e.sum(-1, keepdims=True)
    assert rel(softmax(x, mask, 0.5, "scaled_upper_triang_masked"), tri) < 1e-5
    m = Softmax(scale_factor=0.5, softmax_fusion_type=SoftmaxFusionType.SCALED)
    assert rel(m.apply({}, x, mask), plain) < 1e-5
    with pytest.warns(DeprecationWarning, match="SoftmaxFusionType"):
        old = te_sm.SoftmaxType
    assert old is SoftmaxFusionType
    with pytest.warns(DeprecationWarning, match="softmax_fusion_type"):
        y = softmax(x, None, 0.5, softmax_type=SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED)
    assert rel(y, tri) < 1e-5
    with pytest.warns(DeprecationWarning, match="softmax_fusion_type"):
        y = Softmax(scale_factor=0.5, softmax_type="scaled_upper_triang_masked").apply({}, x)
    assert rel(y, tri) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Softmax(softmax_type="vanilla").apply({}, x)
    with pytest.raises(NotImplementedError, match="softmax_type='off_by_one'"):
        Softmax(softmax_type="off_by_one").apply({}, x)
    with pytest.raises(ValueError, match="softmax_fusion_type"):
        softmax(x, None, 0.5, "causal")


def test_nvfp4_set_without_rng_key_rounds_to_nearest(rng):
    """TE turns NVFP4 stochastic rounding off when the quantizer has no RNG key (lowbit raised):
    the gradients equal those of the recipe with stochastic rounding disabled."""
    from lowbit import recipe as lr
    from lowbit.te.quantize import QuantizerFactory

    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    qs = QuantizerFactory.create_set(fp8_recipe=lr.NVFP4BlockScaling())
    off = QuantizerFactory.create_set(fp8_recipe=lr.NVFP4BlockScaling(disable_stochastic_rounding=True))

    def grads(s):
        return jax.grad(lambda x, k: dense(x, k, quantizer_set=s).astype(jnp.float32).sum(), argnums=(0, 1))(
            x, k
        )

    for a, b in zip(grads(qs), grads(off)):
        np.testing.assert_array_equal(a, b)
