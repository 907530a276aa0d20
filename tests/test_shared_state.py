"""A module called several times in one step (shared or tied weights) keeps the DelayedScaling
state that separate modules would: one state per call, not the sum of the calls' updates
(issue 11, point 5)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowbit
import lowbit.flax as lf
from lowbit.te import flax as te_flax
from lowbit.te.dense import dense as te_dense

OWG = lf.OVERWRITE_WITH_GRADIENT
DN = (((1,), (0,)), ((), ()))
RECIPE = lowbit.DelayedScaling(amax_history_len=4)
RNG = np.random.default_rng(0)


class SharedDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.normal(0.3), (32, 32))
        dg = lf.make_dot_general_cls(RECIPE)(name="dg")
        return dg(jnp.tanh(dg(x, k, DN)), k, DN)


class SeparateDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.normal(0.3), (32, 32))
        h = lf.make_dot_general_cls(RECIPE)(name="dg")(x, k, DN)
        return lf.make_dot_general_cls(RECIPE)(name="dg1")(jnp.tanh(h), k, DN)


class SharedRagged(nn.Module):
    @nn.compact
    def __call__(self, x, gs):
        w = self.param("w", nn.initializers.normal(0.3), (2, 32, 32))
        rd = lf.make_ragged_dot_cls(RECIPE)(name="rd")
        return rd(jnp.tanh(rd(x, w, gs)), w, gs)


class SeparateRagged(nn.Module):
    @nn.compact
    def __call__(self, x, gs):
        w = self.param("w", nn.initializers.normal(0.3), (2, 32, 32))
        h = lf.make_ragged_dot_cls(RECIPE)(name="rd")(x, w, gs)
        return lf.make_ragged_dot_cls(RECIPE)(name="rd1")(jnp.tanh(h), w, gs)


def _te_fn(generate_quantizer_set, x, kernel):
    return te_dense(x, kernel, contracting_dims=((1,), (0,)), quantizer_set=generate_quantizer_set())


class SharedTE(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.normal(0.3), (32, 32))
        d = te_flax.wrap_function_in_te_state_module(_te_fn, RECIPE)(name="dg")
        return d(jnp.tanh(d(x, k)), k)


class SeparateTE(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.normal(0.3), (32, 32))
        cls = te_flax.wrap_function_in_te_state_module(_te_fn, RECIPE)
        return cls(name="dg1")(jnp.tanh(cls(name="dg")(x, k)), k)


def _train(model, *extra, steps=4):
    x0 = jnp.zeros((32, 32), jnp.float32)
    v = model.init(jax.random.PRNGKey(0), x0, *extra)
    tx = optax.sgd(0.1)
    opt = tx.init(v["params"])

    @jax.jit
    def step(v, opt, x, t):
        (loss, y), g = jax.value_and_grad(
            lambda v: (lambda y: (jnp.mean((y - t) ** 2), y))(model.apply(v, x, *extra)), has_aux=True
        )(v)
        upd, opt = tx.update(g["params"], opt, v["params"])
        return {"params": optax.apply_updates(v["params"], upd), OWG: g[OWG]}, opt, y

    ys, rng = [], np.random.default_rng(1)
    for i in range(steps):
        x = jnp.asarray(rng.standard_normal((32, 32)) * (4 - i), jnp.float32)
        t = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
        v, opt, y = step(v, opt, x, t)
        ys.append(y)
    return v, ys


def _by_call(state: dict, first: str, second: str) -> dict:
    """Separate modules' states renamed as a shared module's (second call: ``_call1``)."""
    out = dict(state[first])
    out.update({lf.state_module.state_variable_name(k, 1): a for k, a in state[second].items()})
    return out


def _check_same(shared, separate, first, second):
    (v_sh, ys_sh), (v_sep, ys_sep) = shared, separate
    for a, b in zip(ys_sh, ys_sep):
        np.testing.assert_array_equal(a, b)
    jax.tree.map(np.testing.assert_array_equal, v_sh["params"], v_sep["params"])
    st = v_sh[OWG][first]
    assert sorted(st) == sorted(_by_call(v_sep[OWG], first, second))
    jax.tree.map(np.testing.assert_array_equal, st, _by_call(v_sep[OWG], first, second))
    for k in ("x_scale", "x_scale_call1", "kernel_scale"):  # never a summed (too large) scale
        amax = np.max(np.asarray(st[k.replace("scale", "amax_history")]), axis=0)
        assert np.all(np.asarray(st[k]) * amax <= 448 * (1 + 1e-6)), k


def test_shared_dot_general_matches_separate_modules():
    _check_same(_train(SharedDense()), _train(SeparateDense()), "dg", "dg1")


def test_shared_ragged_dot_matches_separate_modules():
    gs = jnp.array([12, 20], jnp.int32)
    _check_same(_train(SharedRagged(), gs), _train(SeparateRagged(), gs), "rd", "rd1")


def test_shared_te_state_module_matches_separate_modules():
    _check_same(_train(SharedTE()), _train(SeparateTE()), "dg", "dg1")


def test_shared_nn_dense_gets_one_state_per_call():
    for kw in (
        dict(dot_general=lf.make_dot_general_cls(RECIPE)()),
        dict(dot_general_cls=lf.make_dot_general_cls(RECIPE)),
    ):
        d = nn.Dense(32, **kw)
        v = d.init(jax.random.PRNGKey(0), jnp.ones((8, 32)), method=lambda m, x: m(m(x)))
        (state,) = v[OWG].values()
        assert "x_scale" in state and "x_scale_call1" in state and "x_scale_call2" not in state
