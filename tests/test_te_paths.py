"""The TransformerEngine names that lowbit.te re-exports as "same" and that the port-style tests
reach only indirectly: each used directly, as TE code uses it, against a float64 reference."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The port: only these imports differ from TransformerEngine code.
import lowbit.te.flax as te_flax
from lowbit import recipe
from lowbit.te import checkpoint_policies
from lowbit.te.sharding import MeshResource, global_mesh_resource, global_shard_guard

pytestmark = pytest.mark.usefixtures("on_cpu")
BOUND = {
    "DelayedScaling": 0.06,
    "Float8CurrentScaling": 0.06,
    "MXFP8BlockScaling": 0.06,
    "NVFP4BlockScaling": 0.25,
}


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("MXFP8BlockScaling", "NVFP4BlockScaling") else n
        for n in sorted(BOUND)
    ],
)
def test_make_dot_general_cls_in_nn_dense_vs_float64(name):
    r = getattr(recipe, name)()
    layer = nn.Dense(96, dot_general=te_flax.make_dot_general_cls(r)())
    kx, kp = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (4, 32, 128), jnp.float32)
    variables = layer.init({"params": kp, "sr_rng": kp}, x)
    y = layer.apply(variables, x, rngs={"sr_rng": kp})
    p = variables["params"]
    ref = np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)
    assert y.shape == (4, 32, 96)
    assert _rel(y, ref) < BOUND[name]


def test_checkpoint_dots_and_te_gemms_keeps_gradients():
    r = recipe.Float8CurrentScaling()

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            cls = te_flax.make_dot_general_cls(r)
            h = nn.Dense(64, dot_general=cls())(x)
            return nn.Dense(32, dot_general=cls())(jax.nn.gelu(h))

    x = jax.random.normal(jax.random.PRNGKey(0), (16, 48), jnp.float32)
    plain = Block()
    remat = nn.remat(Block, policy=checkpoint_policies.checkpoint_dots_and_te_gemms)()
    variables = plain.init(jax.random.PRNGKey(1), x)

    def grads(model):
        return jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)

    g_plain, g_remat = grads(plain), grads(remat)
    for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_global_shard_guard_sets_and_restores_the_mesh_resource():
    outer = global_mesh_resource()
    mr = MeshResource("data", "model")
    assert (mr.dp_resource, mr.tp_resource) == ("data", "model")
    with global_shard_guard(mr):
        assert global_mesh_resource() == mr
        with global_shard_guard(MeshResource(fsdp_resource="fsdp")):
            assert global_mesh_resource().fsdp_resource == "fsdp"
        assert global_mesh_resource() == mr
    assert global_mesh_resource() == outer
