"""FP8 primary expert weights in the Flax MoEBlock (lowbit.flax.fp8_weights): init only declares
the "fp8_weights" collection (no arrays); a training loop that refreshes it after each update
(refresh_fp8_weights) trains bit for bit as the loop that casts in the step, for every FP8
recipe, with the step casting no weight; its gradients are within FP8 bounds of the float64
reference; a loop without the refresh is unchanged, one that carries the copies' "gradient"
unrefreshed fails loudly (NaN); the block falls back to casting where the copies do not fit."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_block import COEFF, E, H, K, T, inputs, reference, rel

import lowbit
from lowbit.flax import FP8_WEIGHTS, OVERWRITE_WITH_GRADIENT, MoEBlock, refresh_fp8_weights
from lowbit.flax.fp8_weights import ExpertCopies

RECIPES = [
    lowbit.Float8CurrentScaling(),
    lowbit.DelayedScaling(amax_history_len=4),
    pytest.param(lowbit.Float8BlockScaling(), marks=pytest.mark.slow),
]
IDS = ["current", "delayed", "block"]
F = 48


class Net(nn.Module):
    """The block one scope down (as in a model), so the copies' path is not the root."""

    recipe: object

    @nn.compact
    def __call__(self, x):
        blk = MoEBlock(
            num_experts=E, num_experts_per_tok=K, intermediate_size=F, aux_loss_coeff=COEFF,
            quantization_recipe=self.recipe, fp8_primary_weights=True, name="moe",
        )  # fmt: skip
        y, aux, _ = blk(x)
        return y, aux


def _x(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (4, 12, H), jnp.float32)


def _train(recipe, refresh, steps=3):
    """A README-style loop (plain SGD; the non-params collections take their "gradient")."""
    net = Net(recipe)
    v = net.init(jax.random.PRNGKey(1), _x())
    if refresh:
        v = refresh_fp8_weights(v)

    @jax.jit
    def step(v, x):
        def loss(v):
            y, aux = net.apply(v, x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux

        g = jax.grad(loss)(v)
        params = jax.tree_util.tree_map(lambda p, d: p - 0.5 * d, v["params"], g["params"])
        new = {**g, "params": params}
        return refresh_fp8_weights(new) if refresh else new

    for i in range(steps):
        v = step(v, _x(10 + i))
    return v, step


def test_init_declares_the_collection_without_arrays():
    v = Net(lowbit.Float8CurrentScaling()).init(jax.random.PRNGKey(1), _x())
    entry = v[FP8_WEIGHTS]["moe"]["experts"]
    assert isinstance(entry, ExpertCopies) and not entry.ready
    assert jax.tree_util.tree_leaves(v[FP8_WEIGHTS]) == []
    assert FP8_WEIGHTS not in Net(None).init(jax.random.PRNGKey(1), _x())  # BF16: nothing


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_refreshed_loop_equals_the_casting_loop(recipe):
    a, _ = _train(recipe, refresh=False)
    b, step = _train(recipe, refresh=True)
    assert b[FP8_WEIGHTS]["moe"]["experts"].ready
    for name in ("params", OVERWRITE_WITH_GRADIENT):
        if name in a:
            la, lb = jax.tree_util.tree_leaves(a[name]), jax.tree_util.tree_leaves(b[name])
            assert len(la) == len(lb) > 0
            for u, w in zip(la, lb):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(w))
    if not isinstance(recipe, lowbit.Float8BlockScaling):  # the step's fwd+bwd casts no weight
        assert _casts(recipe, a) == 6 and _casts(recipe, b) == 4  # x, h, two grads (+ wi, wo)


def _casts(recipe, v):
    from helpers import jaxpr_eqns

    net = Net(recipe)
    grad = jax.grad(lambda v: jnp.sum(net.apply(v, _x())[0].astype(jnp.float32)))
    eqns = jaxpr_eqns(jax.make_jaxpr(grad)(v).jaxpr)
    return sum(e.params.get("target_name") == "lowbit_grouped_quantize" for e in eqns)


def test_primary_gradients_within_fp8_bounds_of_float64():
    x, gate, wi, wo, _, _ = inputs(2)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    recipe = lowbit.Float8CurrentScaling()
    blk = MoEBlock(
        num_experts=E, num_experts_per_tok=K, intermediate_size=F, aux_loss_coeff=COEFF,
        quantization_recipe=recipe, fp8_primary_weights=True,
    )  # fmt: skip
    xb = x.reshape(4, 12, H)
    v = blk.init(jax.random.PRNGKey(0), xb)
    v = refresh_fp8_weights({**v, "params": {"gate_kernel": gate, "wi": wi, "wo": wo}})
    assert v[FP8_WEIGHTS]["experts"].ready

    def loss(params, xb):
        y, aux, _ = blk.apply({**v, "params": params}, xb)
        return jnp.sum(y.reshape(T, H).astype(jnp.float32) * dy) + aux, y

    (_, y), (g, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(v["params"], xb)
    ref_y, _, ref_g = reference(x, gate, wi, wo, None, None, dy)
    assert rel(y.reshape(T, H), ref_y) < 8e-2
    assert rel(gx.reshape(T, H), ref_g["x"]) < 1.2e-1
    for name, key in (("gate", "gate_kernel"), ("wi", "wi"), ("wo", "wo")):
        assert rel(g[key], ref_g[name]) < 1.2e-1, (name, rel(g[key], ref_g[name]))


def test_unrefreshed_copies_fail_loudly_and_absent_ones_fall_back():
    recipe = lowbit.Float8CurrentScaling()
    net = Net(recipe)
    v = refresh_fp8_weights(net.init(jax.random.PRNGKey(1), _x()))

    def loss(v):
        y, aux = net.apply(v, _x())
        return jnp.mean(y.astype(jnp.float32) ** 2) + aux

    g = jax.grad(loss)(v)
    stale = {**g, "params": v["params"]}  # the copies' "gradient" carried over, no refresh
    assert np.isnan(float(loss(stale)))
    plain = {"params": v["params"]}  # no collection: the block casts in the step
    assert float(loss(plain)) == float(loss(v))
    other = refresh_fp8_weights(Net(lowbit.DelayedScaling()).init(jax.random.PRNGKey(1), _x()))
    mixed = {**v, FP8_WEIGHTS: other[FP8_WEIGHTS]}  # copies made for another recipe: ignored
    assert float(loss(mixed)) == float(loss(v))


def test_te_block_and_refresh_without_collection():
    from lowbit.te.flax import _MoEBlock

    default = _MoEBlock(num_experts=E, num_experts_per_tok=K, intermediate_size=F,
                        quantization_recipe=lowbit.Float8CurrentScaling())  # fmt: skip
    assert FP8_WEIGHTS not in default.init(jax.random.PRNGKey(0), _x())  # TE's collections by default
    blk = default.clone(fp8_primary_weights=True)
    v = refresh_fp8_weights(blk.init(jax.random.PRNGKey(0), _x()))
    assert v[FP8_WEIGHTS]["experts"].ready
    plain = {"params": v["params"]}
    assert refresh_fp8_weights(plain) is plain
    with pytest.raises(ValueError, match="params"):
        refresh_fp8_weights({FP8_WEIGHTS: v[FP8_WEIGHTS]})
