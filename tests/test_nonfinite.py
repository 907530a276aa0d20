"""Nothing silently wrong: an Inf in an input or a gradient gives a non-finite output or gradient
under every recipe (not one saturated to the format's max), and never enters a DelayedScaling
amax history, so optax.apply_if_finite skips the step and training carries on (issue 11, 4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_on, to_cpu

import lowbit
import lowbit.flax as lf
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

OWG = lf.OVERWRITE_WITH_GRADIENT
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((32, 64)), jnp.float32)
W = jnp.asarray(RNG.standard_normal((64, 32)) * 0.1, jnp.float32)
DY = jnp.asarray(RNG.standard_normal((32, 32)), jnp.float32)
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "block": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _with_inf(a, at=(3, 5)):
    return a.at[at].set(jnp.inf)


def _finite(a) -> bool:
    return bool(jnp.all(jnp.isfinite(a)))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "mxfp8" else n for n in RECIPES]
)
def test_dense_inf_gives_nonfinite_output_and_gradients(name):
    r = RECIPES[name]
    state = lowbit.init_delayed_state(r) if name == "delayed" else None

    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: lowbit.dense(x, w, recipe=r, state=state), x, w)
        return y, *vjp(dy)

    assert all(_finite(a) for a in run(X, W, DY))
    y, dx, dw = run(_with_inf(X), W, DY)
    assert not _finite(y) and not _finite(dw)  # forward, and wgrad from x's copy
    y, dx, dw = run(X, _with_inf(W), DY)
    assert not _finite(y) and not _finite(dx)  # forward, and dgrad from the kernel's copy
    y, dx, dw = run(X, W, _with_inf(DY))
    assert _finite(y) and not _finite(dx) and not _finite(dw)


@pytest.mark.parametrize("name", RECIPES)
def test_dense_inf_makes_every_product_reading_it_nan(name, device):
    """docs/numerics.md: every product that reads an operand with an Inf amax is NaN, not merely
    non-finite (NVFP4 read its NaN global_scale_inv as a finite scale: finite and +-Inf outputs)."""
    r = RECIPES[name]
    state = lowbit.init_delayed_state(r) if name == "delayed" else None

    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: lowbit.dense(x, w, recipe=r, state=state), x, w)
        return y, *vjp(dy)

    def nan(a) -> bool:
        return bool(np.isnan(a).all())

    y, dx, dw = to_cpu(run_on(device, run, _with_inf(X), W, DY))
    assert nan(y) and nan(dw) and _finite(dx)  # dgrad dy . w^T does not read x
    y, dx, dw = to_cpu(run_on(device, run, X, _with_inf(W), DY))
    assert nan(y) and nan(dx) and _finite(dw)
    y, dx, dw = to_cpu(run_on(device, run, X, W, _with_inf(DY)))
    assert _finite(y) and nan(dx) and nan(dw)


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_grouped_gemm_inf_gives_nonfinite_output_and_gradients(name):
    r = RECIPES[name]
    gs = jnp.array([12, 20], jnp.int32)
    rhs = jnp.stack([W, -W])
    state = lowbit.init_grouped_delayed_state(r, 2) if name == "delayed" else None

    def run(lhs, rhs, dy):
        y, vjp = jax.vjp(lambda a, b: lowbit.grouped_gemm(a, b, gs, recipe=r, state=state), lhs, rhs)
        return y, *vjp(dy)

    assert all(_finite(a) for a in run(X, rhs, DY))
    y, dl, dr = run(_with_inf(X), rhs, DY)
    assert not _finite(y) and not _finite(dr)
    y, dl, dr = run(X, _with_inf(rhs, (1, 3, 5)), DY)
    assert not _finite(y) and not _finite(dl)
    y, dl, dr = run(X, rhs, _with_inf(DY))
    assert _finite(y) and not _finite(dl) and not _finite(dr)


def test_nonfinite_amax_never_enters_the_history():
    r = DelayedScaling(amax_history_len=4)
    h, s = jnp.array([2.0, 1.0, 0.0, 0.0]), jnp.array([224.0])
    for bad in (jnp.inf, jnp.nan):
        h2, s2 = lowbit.delayed_scaling.update_delayed_scale(h, s, bad, r, jnp.float8_e4m3fn)
        np.testing.assert_array_equal(h2, h)
        np.testing.assert_array_equal(s2, s)
    grads = jax.grad(lambda st: jnp.sum(lowbit.dense(_with_inf(X), W, recipe=r, state=st)))(
        lowbit.init_delayed_state(r)
    )
    for k, v in grads.items():  # the whole step leaves the state as it was
        np.testing.assert_array_equal(v, lowbit.init_delayed_state(r)[k], err_msg=k)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_apply_if_finite_skips_the_inf_step_and_training_recovers(name):
    """Two runs: one sees a batch with an Inf at step 2, the other never does. The Inf step's
    loss is NaN, apply_if_finite skips it, the state stays finite, and afterwards both runs
    have the same parameters, histories and scales."""
    r = RECIPES[name]
    model = nn.Dense(32, dot_general=lf.make_dot_general_cls(r)())
    v0 = model.init(jax.random.PRNGKey(0), X)
    tx = optax.apply_if_finite(optax.sgd(0.05), max_consecutive_errors=5)

    @jax.jit
    def step(v, opt, x, t):
        loss, g = jax.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - t) ** 2))(v)
        upd, opt = tx.update(g["params"], opt, v["params"])
        new = {"params": optax.apply_updates(v["params"], upd)}
        if OWG in g:
            new[OWG] = g[OWG]
        return new, opt, loss

    batches = [
        (
            jnp.asarray(RNG.standard_normal((32, 64)) * (i + 1), jnp.float32),
            jnp.asarray(RNG.standard_normal((32, 32)), jnp.float32),
        )
        for i in range(5)
    ]
    bad = (_with_inf(batches[1][0]), batches[1][1])

    def train(seq):
        v, opt, losses = v0, tx.init(v0["params"]), []
        for x, t in seq:
            v, opt, loss = step(v, opt, x, t)
            losses.append(float(loss))
            assert all(_finite(a) for a in jax.tree.leaves(v))
        return v, losses

    v_bad, l_bad = train(batches[:2] + [bad] + batches[2:])
    v_ref, l_ref = train(batches)
    assert not np.isfinite(l_bad[2])
    np.testing.assert_array_equal(l_bad[:2] + l_bad[3:], l_ref)
    jax.tree.map(np.testing.assert_array_equal, v_bad, v_ref)
