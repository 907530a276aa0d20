"""lowbit.flax.apply_updates_with_fp8_weights: the MoE block's FP8 expert copies written by the
optimizer update (optax.adamw) train exactly as the loop that refreshes them in a separate pass
(refresh_fp8_weights): every loss, parameter, DelayedScaling state and copy byte-equal over
several steps; the copies are quantize_experts of the updated masters with the new state's
scales; under DelayedScaling the whole train step runs no weight cast kernel."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_moe_fp8_weights import Net, _x

import lowbit
from lowbit.flax import (
    FP8_WEIGHTS,
    OVERWRITE_WITH_GRADIENT,
    apply_updates_with_fp8_weights,
    refresh_fp8_weights,
)
from lowbit.moe import quantize_experts

DELAYED = lowbit.DelayedScaling(amax_history_len=4)


def _step(net, tx, in_update):
    def step(v, opt, x):
        def loss(v):
            y, aux = net.apply(v, x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux

        val, g = jax.value_and_grad(loss)(v)
        updates, opt = tx.update(g["params"], opt, v["params"])
        if in_update:
            # in_update True: the jnp copies (fused=True); "kernel": the default, lowbit's cast
            new = apply_updates_with_fp8_weights(
                {**g, "params": v["params"]}, updates, fused=in_update is True
            )
            return val, new, opt
        return val, refresh_fp8_weights({**g, "params": optax.apply_updates(v["params"], updates)}), opt

    return jax.jit(step)


def _train(recipe, in_update, steps=3):
    net, tx = Net(recipe), optax.adamw(1e-2)
    v = refresh_fp8_weights(net.init(jax.random.PRNGKey(1), _x()))
    opt, step, losses = tx.init(v["params"]), _step(net, tx, in_update), []
    for i in range(steps):
        val, v, opt = step(v, opt, _x(10 + i))
        losses.append(float(val))
    return losses, v, step, opt


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("mode", [True, "kernel"], ids=["fused", "kernel"])
@pytest.mark.parametrize("recipe", [DELAYED, lowbit.Float8CurrentScaling()], ids=["delayed", "current"])
def test_in_update_copies_train_as_the_refresh(device, recipe, mode):
    la, a, _, _ = _train(recipe, in_update=False)
    lb, b, _, _ = _train(recipe, in_update=mode)
    assert la == lb and all(np.isfinite(la))
    assert b[FP8_WEIGHTS]["moe"]["experts"].ready
    ta, tb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in ta] == [p for p, _ in tb] and len(ta) > 10
    for (path, u), (_, w) in zip(ta, tb):
        np.testing.assert_array_equal(_bytes(u), _bytes(w), err_msg=jax.tree_util.keystr(path))


def test_copies_are_the_updated_masters_cast_with_the_new_state(device):
    _, v, step, opt = _train(DELAYED, in_update=True, steps=2)
    _, new, _ = step(v, opt, _x(20))
    states = new[OVERWRITE_WITH_GRADIENT]["moe"]
    assert (np.asarray(states["fc1_state"]["kernel_scale"]) != 1).all()  # the scales moved on
    c = new[FP8_WEIGHTS]["moe"]["experts"]
    for name, st in (("wi", "fc1_state"), ("wo", "fc2_state")):
        state = {k: states[st][k] for k in lowbit.delayed_scaling.STATE_KEYS}
        ref = quantize_experts(nn.meta.unbox(new["params"])["moe"][name], DELAYED, state)
        got = getattr(c, name)
        assert got.kn == ref.kn
        for f in ("row", "row_s", "col", "col_s", "amax"):
            np.testing.assert_array_equal(
                _bytes(getattr(got, f)), _bytes(getattr(ref, f)), err_msg=f"{name}.{f}"
            )
        assert np.isfinite(np.asarray(got.row_s)).all()  # not the NaN-poisoned "gradient" of the copies


def test_the_train_step_casts_no_weight():
    from helpers import jaxpr_eqns

    def casts(in_update):
        net, tx = Net(DELAYED), optax.adamw(1e-2)
        v = refresh_fp8_weights(net.init(jax.random.PRNGKey(1), _x()))
        step = _step(net, tx, in_update)
        eqns = jaxpr_eqns(jax.make_jaxpr(step)(v, tx.init(v["params"]), _x()).jaxpr)
        return sum(e.params.get("target_name") == "lowbit_grouped_quantize" for e in eqns)

    assert casts(in_update=False) == 6 and casts(in_update=True) == 4  # x, h, two gradients
    assert casts(in_update="kernel") == 6  # the default: the weights' two casts after the update


def test_bad_arguments_are_named():
    v = refresh_fp8_weights(Net(DELAYED).init(jax.random.PRNGKey(1), _x()))
    with pytest.raises(ValueError, match="apply_updates_with_fp8_weights: variables must hold 'params'"):
        apply_updates_with_fp8_weights({FP8_WEIGHTS: v[FP8_WEIGHTS]}, {})
    with pytest.raises(ValueError, match="updates must have the tree structure of variables\\['params'\\]"):
        apply_updates_with_fp8_weights(v, {"moe": {}})
    params = nn.meta.unbox(v["params"])
    wrong = dict(params, moe=dict(params["moe"], wi=params["moe"]["wi"][:, :4]))
    with pytest.raises(
        ValueError,
        match=r"updates\['moe'\]\['wi'\] must have its parameter's shape \(8, 32, 96\), got \(8, 4, 96\)",
    ):
        apply_updates_with_fp8_weights({**v, "params": params}, wrong)


def test_without_copies_it_is_optax_apply_updates():
    import flax

    v = Net(None).init(jax.random.PRNGKey(1), _x())  # BF16: no "fp8_weights"
    updates = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.25), v["params"])
    for variables in (v, flax.core.freeze(v)):
        out = apply_updates_with_fp8_weights(variables, updates)
        assert isinstance(out, flax.core.FrozenDict) == isinstance(variables, flax.core.FrozenDict)
        assert FP8_WEIGHTS not in out
        want = optax.apply_updates(v["params"], updates)
        for a, b in zip(jax.tree_util.tree_leaves(out["params"]), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unexpected_collection_entry_names_the_caller():
    params = {"w": jnp.zeros((2,), jnp.float32)}
    bad = {"params": params, FP8_WEIGHTS: {"moe": 3}}
    with pytest.raises(TypeError, match=r"apply_updates_with_fp8_weights: unexpected int"):
        apply_updates_with_fp8_weights(bad, {"w": jnp.ones((2,), jnp.float32)})
    with pytest.raises(TypeError, match=r"refresh_fp8_weights: unexpected int"):
        refresh_fp8_weights(bad)


def test_fused_must_be_a_bool():
    params = {"w": jnp.zeros((2,), jnp.float32)}
    with pytest.raises(ValueError, match=r"apply_updates_with_fp8_weights: fused must be a bool, got 'yes'"):
        apply_updates_with_fp8_weights({"params": params}, {"w": params["w"]}, fused="yes")
