"""Small training programs written as TransformerEngine's tutorials and examples write them
(MNIST-style dense net, encoder-style block, the seeds' dot_general swap, a custom state-module
function), with only the imports pointing at lowbit; each asserts the loss decreases."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import lowbit.te as te
import lowbit.te.flax as te_flax
from lowbit import recipe
from lowbit.te.dense import dense

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _data(n=64, d=32, classes=32, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (n, d), jnp.float32)
    y = jnp.argmax(x @ jax.random.normal(kw, (d, classes)), -1)
    return x, y


def _train(model, x, y, rngs=None, steps=12, lr=3e-2):
    variables = model.init(jax.random.PRNGKey(1), x)
    params, others = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    tx = optax.adam(lr)
    opt = tx.init(params)

    @jax.jit
    def step(params, others, opt):
        def loss_fn(params, others):
            logits = model.apply({"params": params, **others}, x, rngs=rngs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, (gp, go) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, others)
        upd, opt = tx.update(gp, opt, params)
        # DelayedScaling's "gradient" is the new state: written back as TE's examples do.
        return optax.apply_updates(params, upd), te.update_collections(go, others), opt, loss

    losses = []
    for _ in range(steps):
        params, others, opt, loss = step(params, others, opt)
        losses.append(float(loss))
    return losses


class MnistNet(nn.Module):  # TE's examples/jax/mnist layout, Dense layers through te_flax
    @nn.compact
    def __call__(self, x):
        x = te_flax.DenseGeneral(features=64)(x)
        x = nn.relu(x)
        return te_flax.DenseGeneral(features=32)(x)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize(
    "name",
    [
        "delayed",
        pytest.param("current", marks=pytest.mark.slow),
        pytest.param("mxfp8", marks=pytest.mark.slow),
    ],
)
def test_mnist_style(device, name):
    r = {
        "delayed": recipe.DelayedScaling(amax_history_len=4),
        "current": recipe.Float8CurrentScaling(),
        "mxfp8": recipe.MXFP8BlockScaling(),
    }[name]
    x, y = _data()
    with te.autocast(enabled=True, recipe=r, mesh_resource=te.MeshResource()):
        losses = _train(MnistNet(), x, y)
    assert losses[-1] < 0.7 * losses[0]


class EncoderBlock(nn.Module):  # TE's examples/jax/encoder: fused LN+MLP and LN+Dense modules
    @nn.compact
    def __call__(self, x):
        x, _ = te_flax.LayerNormDenseGeneral(features=32, use_bias=True)(x)  # TE: (out, ln_out)
        h, _ = te_flax.LayerNormMLP(
            intermediate_dim=64, activations=("gelu", "linear"), intermediate_dropout_rate=0.0
        )(x, deterministic=True)
        x = x + h
        return te_flax.DenseGeneral(features=32)(x)


@pytest.mark.slow
def test_encoder_style_delayed():
    x, y = _data()
    with te.fp8_autocast(True, recipe.DelayedScaling(amax_history_len=8)):
        losses = _train(EncoderBlock(), x, y)
    assert losses[-1] < 0.7 * losses[0]


class SeedDense(nn.Module):  # the seeds' tutorial: only dot_general changes
    dot_general_cls: object = lambda: None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dot_general=self.dot_general_cls())(x))
        return nn.Dense(32, dot_general=self.dot_general_cls())(x)


@pytest.mark.parametrize("name", [pytest.param("nvfp4", marks=pytest.mark.slow), "delayed"])
def test_seed_dot_general_swap(name):
    r = recipe.NVFP4BlockScaling() if name == "nvfp4" else recipe.DelayedScaling(amax_history_len=4)
    x, y = _data()
    rngs = {"sr_rng": jax.random.PRNGKey(3)} if name == "nvfp4" else None
    losses = _train(SeedDense(te_flax.make_dot_general_cls(r)), x, y, rngs=rngs)
    assert losses[-1] < 0.8 * losses[0]


def _te_dense_fn(generate_quantizer_set, x, kernel):  # TE's own make_dot_general_cls pattern
    return dense(x, kernel, contracting_dims=((x.ndim - 1,), (0,)), quantizer_set=generate_quantizer_set())


class WrappedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        k1 = self.param("k1", nn.initializers.lecun_normal(), (32, 64))
        k2 = self.param("k2", nn.initializers.lecun_normal(), (64, 32))
        r = recipe.DelayedScaling(amax_history_len=4)
        cls = te_flax.wrap_function_in_te_state_module(_te_dense_fn, r, "dense")
        h = nn.relu(cls(name="d1")(x, k1))
        return cls(name="d2")(h, k2)


def test_wrap_function_in_te_state_module():
    x, y = _data()
    v = WrappedNet().init(jax.random.PRNGKey(0), x)
    assert set(v["_overwrite_with_gradient"]["d1"]) == {
        f"{r}_{s}" for r in ("x", "kernel", "grad") for s in ("amax_history", "scale")
    }
    losses = _train(WrappedNet(), x, y)
    assert losses[-1] < 0.7 * losses[0]
