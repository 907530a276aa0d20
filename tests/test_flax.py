"""lowbit.flax: the drop-in dot_general module, its state, RNG stream, errors, and training."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_on, to_cpu

import lowbit
from lowbit import flax as lf

OWG = lf.OVERWRITE_WITH_GRADIENT
RECIPES = {
    "delayed": lowbit.DelayedScaling(),
    "current": lowbit.Float8CurrentScaling(),
    "mxfp8": lowbit.MXFP8BlockScaling(),
    "block": lowbit.Float8BlockScaling(),
    "nvfp4": lowbit.NVFP4BlockScaling(),
}


class MLP(nn.Module):
    """Two Dense layers taking the dot_general the way the seeds' models do."""

    hidden: int = 64
    out: int = 32
    dot_general_cls: object = lambda: None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden, dot_general=self.dot_general_cls())(x)
        x = nn.gelu(x)
        return nn.Dense(self.out, dot_general=self.dot_general_cls())(x)


def rngs_for(recipe, key=0):
    r = {"dropout": jax.random.PRNGKey(7)}
    if isinstance(recipe, lowbit.NVFP4BlockScaling):
        r["sr_rng"] = jax.random.PRNGKey(key)
    return r


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in ("mxfp8", "nvfp4") else n for n in RECIPES]
)
def test_variables(name):
    recipe = RECIPES[name]
    model = MLP(dot_general_cls=lf.make_dot_general_cls(recipe))
    x = jnp.ones((4, 32), jnp.bfloat16)
    v = model.init(jax.random.PRNGKey(0), x)
    plain = MLP().init(jax.random.PRNGKey(0), x)
    # No parameters of its own: the same params (and the same init) as plain Flax.
    assert jax.tree_util.tree_structure(v["params"]) == jax.tree_util.tree_structure(plain["params"])
    for a, b in zip(jax.tree_util.tree_leaves(v["params"]), jax.tree_util.tree_leaves(plain["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name == "delayed":
        assert set(v) == {"params", OWG}
        mods = v[OWG]
        assert set(mods) == {"LowbitWrapper_dot_general_0", "LowbitWrapper_dot_general_1"}
        for m in mods.values():
            assert {k: a.shape for k, a in m.items()} == {
                "x_amax_history": (1024,),
                "x_scale": (1,),
                "kernel_amax_history": (1024,),
                "kernel_scale": (1,),
                "grad_amax_history": (1024,),
                "grad_scale": (1,),
            }
    else:
        assert set(v) == {"params"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in ("mxfp8", "nvfp4") else n for n in RECIPES]
)
def test_matches_dense_and_runs_fwd_bwd(device, name):
    """The module's output is lowbit.dense's; a jitted fwd+bwd runs on each device."""
    recipe = RECIPES[name]
    model = MLP(dot_general_cls=lf.make_dot_general_cls(recipe))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32), jnp.bfloat16)
    v = model.init(jax.random.PRNGKey(0), x)
    k = v["params"]["Dense_0"]["kernel"]
    one = nn.Dense(64, dot_general=lf.make_dot_general_cls(recipe)())
    v1 = dict(one.init(jax.random.PRNGKey(3), x), params=v["params"]["Dense_0"])
    y1 = one.apply(v1, x, rngs=rngs_for(recipe))
    state = lowbit.init_delayed_state(recipe) if name == "delayed" else None
    ref = lowbit.dense(x.astype(jnp.float32), k, recipe=recipe, state=state) + v["params"]["Dense_0"]["bias"]
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(ref))

    dy = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32), jnp.float32)

    def step(v, x, dy):
        f = lambda v, x: jnp.vdot(model.apply(v, x, rngs=rngs_for(recipe)), dy)
        return jax.value_and_grad(f, argnums=(0, 1))(v, x)

    loss, (gv, gx) = to_cpu(run_on(device, step, v, x, dy))
    assert np.isfinite(loss) and gx.shape == x.shape
    assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(gv))


def test_delayed_state_over_training_steps():
    """A training loop that overwrites `_overwrite_with_gradient` with its gradient keeps the
    recipe's state; checked against a hand computation of every history and scale."""
    L = 4
    recipe = lowbit.DelayedScaling(amax_history_len=L, margin=0)
    dense = nn.Dense(32, dot_general=lf.make_dot_general_cls(recipe)())
    rng = np.random.default_rng(0)
    x0 = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    v = dense.init(jax.random.PRNGKey(0), x0)
    tx = optax.sgd(0.05)
    opt = tx.init(v["params"])

    @jax.jit
    def train_step(v, opt, x, t):
        loss = lambda v: jnp.vdot(dense.apply(v, x), t)  # dy = t
        g = jax.grad(loss)(v)
        upd, opt = tx.update(g["params"], opt, v["params"])
        return {"params": optax.apply_updates(v["params"], upd), OWG: g[OWG]}, opt

    hand = {r: ([0.0] * L, np.float32(1)) for r in ("x", "kernel", "grad")}
    fmax = {"x": 448.0, "kernel": 448.0, "grad": 57344.0}
    for step in range(6):
        x = jnp.asarray(rng.standard_normal((16, 32)) * (step + 1), jnp.float32)
        t = jnp.asarray(rng.standard_normal((16, 32)) * 0.1**step, jnp.float32)
        amaxes = {
            "x": np.abs(np.asarray(x)).max(),
            "kernel": np.abs(np.asarray(v["params"]["kernel"])).max(),
            "grad": np.abs(np.asarray(t)).max(),
        }
        v, opt = train_step(v, opt, x, t)
        s = v[OWG]["dot_general"]  # a top-level Dense owns its dot_general attribute
        for role in hand:
            hist = [float(amaxes[role])] + hand[role][0][:-1]
            scale = np.float32(fmax[role]) / np.float32(max(hist))
            hand[role] = (hist, scale)
            np.testing.assert_allclose(
                np.asarray(s[f"{role}_amax_history"]), hist, rtol=1e-7, err_msg=f"step {step} {role}"
            )
            np.testing.assert_allclose(
                np.asarray(s[f"{role}_scale"]), [scale], rtol=1e-6, err_msg=f"step {step} {role}"
            )


def test_nvfp4_sr_rng_stream():
    recipe = RECIPES["nvfp4"]
    model = MLP(dot_general_cls=lf.make_dot_general_cls(recipe))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 32), jnp.float32)
    v = model.init(jax.random.PRNGKey(0), x)  # init needs no sr_rng
    grad = jax.jit(lambda v, k: jax.grad(lambda v: jnp.sum(model.apply(v, x, rngs={"sr_rng": k}) ** 2))(v))
    g1, g1b, g2 = (
        grad(v, jax.random.PRNGKey(1)),
        grad(v, jax.random.PRNGKey(1)),
        grad(v, jax.random.PRNGKey(2)),
    )
    k1, k1b, k2 = (np.asarray(g["params"]["Dense_0"]["kernel"]) for g in (g1, g1b, g2))
    np.testing.assert_array_equal(k1, k1b)  # the key decides the rounding ...
    assert not np.array_equal(k1, k2)  # ... and a different key rounds differently
    with pytest.raises(ValueError, match="sr_rng"):
        jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)


def test_dense_general_and_errors():
    recipe = RECIPES["current"]
    cls = lf.make_dot_general_cls(recipe)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 4, 16), jnp.float32)
    dg = nn.DenseGeneral(features=(2, 32), axis=(-2, -1), dot_general=cls())
    v = dg.init(jax.random.PRNGKey(0), x)
    y = dg.apply(v, x)
    ref = nn.DenseGeneral(features=(2, 32), axis=(-2, -1)).apply(v, x)
    assert y.shape == ref.shape == (2, 8, 2, 32)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.04

    batched = nn.DenseGeneral(features=32, axis=-1, batch_dims=(0,), dot_general=cls())
    with pytest.raises(ValueError, match="batch dimensions are not supported"):
        batched.init(jax.random.PRNGKey(0), x[:, :, 0])
    mod = cls()
    with pytest.raises(ValueError, match="trailing axes"):
        mod.init(jax.random.PRNGKey(0), jnp.ones((16, 8)), jnp.ones((16, 32)), (((0,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="contraction size mismatch"):
        mod.init(jax.random.PRNGKey(0), jnp.ones((8, 16)), jnp.ones((32, 32)), (((1,), (0,)), ((), ())))
    with pytest.raises(TypeError, match="x must be float32"):
        mod.init(
            jax.random.PRNGKey(0), jnp.ones((8, 16), jnp.int32), jnp.ones((16, 32)), (((1,), (0,)), ((), ()))
        )


def test_autocast_and_wrapper_alias():
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32), jnp.float32)
    cls = lf.make_dot_general_cls()  # recipe from autocast, at trace time
    d = nn.Dense(32, dot_general=cls())
    v = d.init(jax.random.PRNGKey(0), x)
    plain = nn.Dense(32).apply(v, x)
    np.testing.assert_allclose(np.asarray(d.apply(v, x)), np.asarray(plain), rtol=1e-6)
    with lowbit.autocast(RECIPES["current"], mesh_resource=lowbit.MeshResource(dp_resource="dp")):
        assert lowbit.global_mesh_resource().dp_resource == "dp"
        yq = d.apply(v, x)
    assert lowbit.global_mesh_resource().dp_resource is None
    assert not np.array_equal(np.asarray(yq), np.asarray(plain))
    assert float(jnp.linalg.norm(yq - plain) / jnp.linalg.norm(plain)) < 0.04

    assert lf.wrap_function_in_te_state_module is lf.wrap_function_in_state_module
    seen = {}

    def f(ctx, a, b):
        seen["recipe"] = ctx.recipe
        return lowbit.dense(a, b, **ctx.dense_kwargs())

    Wrapped = lf.wrap_function_in_te_state_module(f, RECIPES["delayed"], "matmul")
    assert Wrapped.__name__ == "LowbitWrapper_matmul"
    vw = Wrapped().init(jax.random.PRNGKey(0), x, v["params"]["kernel"])
    assert set(vw[OWG]) == set(lowbit.delayed_scaling.STATE_KEYS)
    assert seen["recipe"] is RECIPES["delayed"]


def test_checkpoint_policy_with_flax():
    model = MLP(dot_general_cls=lf.make_dot_general_cls(RECIPES["current"]))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 32), jnp.float32)
    v = model.init(jax.random.PRNGKey(0), x)

    def count(policy):
        fn = jax.checkpoint(lambda v, x: model.apply(v, x), policy=policy)
        g = jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(fn(v, x) ** 2)))
        return g.lower(v, x).as_text().count("@lowbit_gemm"), g(v, x)

    n_new, (l_new, g_new) = count(lowbit.checkpoint_policies.checkpoint_dots_and_te_gemms)
    n_old, (l_old, g_old) = count(jax.checkpoint_policies.checkpoint_dots)
    assert n_new < n_old  # the GEMM output is kept, not recomputed
    np.testing.assert_allclose(float(l_new), float(l_old), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_new), jax.tree_util.tree_leaves(g_old)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Training: a small regression trained for a few hundred steps per recipe
# ---------------------------------------------------------------------------------------------
def _train(dot_general_cls, recipe, steps=300, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((32, 64)) / np.sqrt(32)
    w2 = rng.standard_normal((64, 32)) / np.sqrt(64)
    xs = rng.standard_normal((steps, 64, 32)).astype(np.float32)
    ys = (np.tanh(xs @ w1) @ w2).astype(np.float32)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            kw = dict(dtype=dtype)
            if dot_general_cls is not None:
                kw["dot_general"] = dot_general_cls()
            h = nn.gelu(nn.Dense(64, **kw)(x))
            kw = dict(dtype=dtype)
            if dot_general_cls is not None:
                kw["dot_general"] = dot_general_cls()
            return nn.Dense(32, **kw)(h)

    net = Net()
    v = net.init(jax.random.PRNGKey(0), xs[0])
    tx = optax.adam(3e-3)
    opt = tx.init(v["params"])

    @jax.jit
    def step(v, opt, x, y, key):
        def loss(v):
            out = net.apply(v, x, rngs=rngs_for(recipe, key)).astype(jnp.float32)
            return jnp.mean((out - y) ** 2)

        l, g = jax.value_and_grad(loss)(v)
        upd, opt = tx.update(g["params"], opt, v["params"])
        new = dict(v, params=optax.apply_updates(v["params"], upd))
        if OWG in g:
            new[OWG] = g[OWG]
        return new, opt, l

    losses = []
    for i in range(steps):
        v, opt, l = step(v, opt, xs[i], ys[i], i)
        losses.append(float(l))
    return float(np.mean(losses[-30:])), float(np.mean(losses[:10]))


@pytest.fixture(scope="module")
def bf16_loss():
    return _train(None, None, dtype=jnp.bfloat16)[0]


# Final loss relative to BF16 training (same data, same init; measured: FP8 +2%, NVFP4 +30%):
# FP8 tracks it closely, NVFP4 is coarser but must still learn.
TRAIN_RATIO = {"delayed": 1.1, "current": 1.1, "mxfp8": 1.1, "block": 1.1, "nvfp4": 1.6}


@pytest.mark.parametrize(
    "name", [n if n == "delayed" else pytest.param(n, marks=pytest.mark.slow) for n in RECIPES]
)
def test_training_reaches_bf16_loss(bf16_loss, name):
    recipe = RECIPES[name]
    final, first = _train(lf.make_dot_general_cls(recipe), recipe)
    assert final < first / 5, f"{name} did not learn: {first} -> {final}"
    assert final < TRAIN_RATIO[name] * bf16_loss, f"{name}: {final} vs bf16 {bf16_loss}"
