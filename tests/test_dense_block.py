"""Float8BlockScaling end to end: lowbit.dense on ragged shapes, the per-operand copies it uses,
the norm / activation outputs quantized for the recipe, the Flax paths (make_dot_general_cls,
DenseGeneral, LayerNormDenseGeneral, LayerNormMLP under autocast), and a small training run
with optax whose loss decreases."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_on, to_cpu
from helpers import rel

import lowbit
import lowbit.flax as lf

SM = lowbit.ScalingMode
F32, BF16 = jnp.float32, jnp.bfloat16
BLOCK = lowbit.Float8BlockScaling()


def dense_vjp(recipe, x, w, b, dy):
    y, vjp = jax.vjp(lambda x, w, b: lowbit.dense(x, w, b, recipe=recipe), x, w, b)
    return (y,) + vjp(dy)


@pytest.mark.parametrize(
    "recipe",
    [
        BLOCK,
        lowbit.Float8BlockScaling(use_f32_scales=True),
        lowbit.Float8BlockScaling(w_block_scaling_dim=1),
        pytest.param(
            lowbit.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1), marks=pytest.mark.slow
        ),
        pytest.param(lowbit.Float8BlockScaling(fp8_format=lowbit.Format.HYBRID), marks=pytest.mark.slow),
    ],
    ids=["default", "f32_scales", "w1d", "x2d", "hybrid"],
)
@pytest.mark.parametrize("shape", [(70, 200, 136), (3 * 50, 384, 64)], ids=["ragged", "whole_k"])
def test_ragged_forward_and_grads(device, rng, recipe, shape):
    M, K, N = shape
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    y, dx, dw, db = to_cpu(run_on(device, lambda *a: dense_vjp(recipe, *a), x, w, b, dy))
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    bwd = 0.1 if recipe.fp8_format is lowbit.Format.HYBRID else 0.07
    assert rel(y, x64 @ w64 + b) < 0.04
    assert rel(dx, dy64 @ w64.T) < bwd
    assert rel(dw, x64.T @ dy64) < bwd
    assert rel(db, dy64.sum(0)) < 1e-5


def test_dense_uses_the_block_modes(device, rng):
    """x and dy 1x128, the kernel 128x128; three FP8 GEMMs in the jaxpr."""
    x = jnp.asarray(rng.standard_normal((32, 256)), BF16)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, BF16)
    seen = []
    orig = lowbit.ops.dense.quantize

    def spy(x, **kw):
        seen.append((kw["scaling_mode"], kw.get("power_2_scale")))
        return orig(x, **kw)

    lowbit.ops.dense.quantize = spy
    try:
        jax.grad(lambda x, w: jnp.sum(lowbit.dense(x, w, recipe=BLOCK).astype(F32)), argnums=(0, 1))(x, w)
    finally:
        lowbit.ops.dense.quantize = orig
    assert (SM.BLOCK_1D_SCALING, True) in seen and (SM.BLOCK_2D_SCALING, True) in seen


def test_norm_and_activation_outputs(device, rng):
    """The fused ops' outputs for this recipe: the op, then lowbit.quantize (same bits)."""
    h = jnp.asarray(rng.standard_normal((8, 16, 256)), BF16)
    g, be = jnp.ones((256,), BF16), jnp.zeros((256,), BF16)
    spec = (SM.BLOCK_1D_SCALING, jnp.float8_e4m3fn, None, "both", True)
    qn = lowbit.layernorm(h, g, be, norm_type="layernorm", quantize=spec)
    ref = lowbit.quantize(
        lowbit.layernorm(h, g, be, norm_type="layernorm"),
        SM.BLOCK_1D_SCALING,
        layout="both",
        power_2_scale=True,
    )
    for f in ("data", "scale_inv", "colwise_data", "colwise_scale_inv"):
        np.testing.assert_array_equal(np.asarray(getattr(qn, f)), np.asarray(getattr(ref, f)))
    qa = lowbit.activation(h, ("gelu",), quantize=spec)
    ref = lowbit.quantize(
        lowbit.activation(h, ("gelu",)), SM.BLOCK_1D_SCALING, layout="both", power_2_scale=True
    )
    np.testing.assert_array_equal(np.asarray(qa.scale_inv), np.asarray(ref.scale_inv))
    with pytest.raises(ValueError, match="power_2_scale"):
        lowbit.layernorm(h, g, be, quantize=(SM.CURRENT_TENSOR_SCALING, None, None, "both", True))


@pytest.mark.slow
def test_flax_dot_general_and_modules(device, rng):
    x = jnp.asarray(rng.standard_normal((4, 24, 160)), BF16)
    key = jax.random.PRNGKey(0)
    layer = nn.Dense(136, dot_general=lf.make_dot_general_cls(BLOCK)(), dtype=BF16)
    v = layer.init(key, x)
    y = layer.apply(v, x)
    ref = nn.Dense(136, dtype=F32).apply(v, x.astype(F32))
    assert rel(y, np.asarray(ref, np.float64)) < 0.05
    with lowbit.autocast(BLOCK):
        for mod in (
            lf.DenseGeneral(features=96),
            lf.LayerNormDenseGeneral(features=96),
            lf.LayerNormMLP(intermediate_dim=192, intermediate_dropout_rate=0.0),
        ):
            variables = mod.init(key, x)

            def first(v, mod=mod):
                out = mod.apply(v, x)
                return out[0] if isinstance(out, tuple) else out

            out = first(variables)
            grads = jax.grad(lambda v: jnp.sum(jnp.square(first(v).astype(F32))))(variables)
            assert np.all(np.isfinite(np.asarray(out, np.float32)))
            assert all(
                np.all(np.isfinite(np.asarray(g, np.float32))) for g in jax.tree_util.tree_leaves(grads)
            )


def test_training_step_loss_decreases(device, rng):
    """A two-layer MLP regression with Flax + optax under autocast(Float8BlockScaling())."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = lf.DenseGeneral(features=256, name="fc1")(x)
            h = jax.nn.gelu(h)
            return lf.DenseGeneral(features=128, name="fc2")(h)

    key = jax.random.PRNGKey(0)
    x = jnp.asarray(rng.standard_normal((64, 128)), BF16)
    target = jnp.asarray(np.tanh(rng.standard_normal((128, 128)) * 0.3), F32)
    y_true = (x.astype(F32) @ target).astype(BF16)
    model = MLP()
    with lowbit.autocast(BLOCK):
        params = model.init(key, x)
        opt = optax.adam(3e-3)
        opt_state = opt.init(params)

        @jax.jit
        def step(params, opt_state):
            def loss_fn(p):
                return jnp.mean(jnp.square(model.apply(p, x).astype(F32) - y_true.astype(F32)))

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        losses = []
        for _ in range(30):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
