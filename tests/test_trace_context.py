"""The recipe and sharding contexts are part of jax.jit's cache key: a function traced under
one context is traced again under another, never reused stale (issue 11, point 6)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import lowbit
from lowbit.flax import make_dot_general_cls
from lowbit.recipe import Float8CurrentScaling, MXFP8BlockScaling
from lowbit.sharding import MeshResource, global_shard_guard, tensor_parallel_layout

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(KEY, (32, 64), jnp.float32)
W = jax.random.normal(jax.random.fold_in(KEY, 1), (64, 32), jnp.float32)
REF = X @ W


def _err(y):
    return float(jnp.max(jnp.abs(y - REF)) / jnp.max(jnp.abs(REF)))


def test_jit_retraces_when_the_recipe_changes():
    f = jax.jit(lambda x, w: lowbit.dense(x, w))
    with lowbit.autocast(Float8CurrentScaling()):
        fp8 = f(X, W)
    assert _err(fp8) > 1e-3
    with lowbit.autocast(None):
        assert _err(f(X, W)) < 1e-6  # unquantized, not the stale FP8 trace
    with lowbit.autocast(enabled=True, recipe=Float8CurrentScaling()):  # TE's form, back again
        np.testing.assert_array_equal(f(X, W), fp8)
    with lowbit.autocast(MXFP8BlockScaling()):
        mx = f(X, W)
    np.testing.assert_array_equal(mx, lowbit.dense(X, W, recipe=MXFP8BlockScaling()))
    assert not np.array_equal(mx, fp8)
    assert _err(f(X, W)) < 1e-6  # outside any autocast


def test_flax_apply_retraces_when_the_recipe_changes():
    model = nn.Dense(32, use_bias=False, dot_general_cls=make_dot_general_cls())
    variables = {"params": {"kernel": W}}
    apply = jax.jit(model.apply)
    with lowbit.autocast(Float8CurrentScaling()):
        fp8 = apply(variables, X)
    np.testing.assert_array_equal(fp8, lowbit.dense(X, W, recipe=Float8CurrentScaling()))
    with lowbit.autocast(enabled=False):
        assert _err(apply(variables, X)) < 1e-6


def test_jit_retraces_when_the_sharding_context_changes():
    traces = []

    @jax.jit
    def f(x):
        traces.append(lowbit.sharding.tp_layout())
        return x + 1

    with tensor_parallel_layout("column"):
        f(X)
        f(X)
    with tensor_parallel_layout("row"):
        f(X)
    with tensor_parallel_layout("column"):
        f(X)
    assert traces == ["column", "row"]  # one trace per layout, each reused for its own layout
    with global_shard_guard(MeshResource(dp_resource="dp")):
        f(X)
    with lowbit.autocast(Float8CurrentScaling(), mesh_resource=MeshResource(tp_resource="tp")):
        f(X)
    assert len(traces) == 4
