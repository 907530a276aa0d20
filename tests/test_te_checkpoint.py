"""Checkpoint interchange with TE: a variable tree laid out as TransformerEngine 2.20's modules
keep it (DelayedScaling state in ``fp8_metas``, ``{role}{postfix}_{amax_history,scale}`` in the
scope of the module running the GEMM) loads into lowbit's modules and converts back by name.

The TE layout here is built from TE's naming rule (its source: ``generate_quantizer_set(postfix)``
with "" for DenseGeneral/LayerNormDenseGeneral and "_0"/"_1" for LayerNormMLP's two GEMMs), not
from lowbit's converter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import unfreeze

import lowbit
from lowbit import recipe
from lowbit.flax import OVERWRITE_WITH_GRADIENT, LayerNormMLP, TransformerLayer
from lowbit.te.checkpoint import TE_FP8_COLLECTION, from_te, to_te

L = 4  # amax history length


def te_fp8_metas(gemm_modules: dict) -> dict:
    """{module path: [postfixes]} -> TE's fp8_metas tree (shapes only, distinct values)."""
    rng = np.random.default_rng(0)
    tree: dict = {}
    for path, postfixes in gemm_modules.items():
        node = tree
        for part in path.split("/"):
            node = node.setdefault(part, {})
        for postfix in postfixes:
            for role in ("x", "kernel", "grad"):
                node[f"{role}{postfix}_amax_history"] = jnp.asarray(rng.uniform(0.5, 2.0, (L,)), jnp.float32)
                node[f"{role}{postfix}_scale"] = jnp.asarray(rng.uniform(0.25, 4.0, (1,)), jnp.float32)
    return tree


ENCODER = {"attention/qkv": [""], "attention/out": [""], "mlp": ["_0", "_1"]}


def _layer():
    return TransformerLayer(
        hidden_size=32, mlp_hidden_size=64, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0
    )


def _init(module, x):
    with lowbit.autocast(recipe.DelayedScaling(amax_history_len=L)):
        return unfreeze(module.init(jax.random.PRNGKey(0), x, deterministic=True))


def _shapes(tree):
    return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


@pytest.mark.parametrize(
    "make,layout",
    [(_layer, ENCODER), (lambda: LayerNormMLP(intermediate_dim=64), {"": ["_0", "_1"]})],
    ids=["TransformerLayer", "LayerNormMLP"],
)
def test_lowbit_state_converts_to_te_names(make, layout):
    x = jnp.ones((2, 8, 32), jnp.float32)
    v = _init(make(), x)
    te = to_te(v)
    expected = te_fp8_metas(layout)
    expected = expected[""] if "" in expected else expected
    assert _shapes(te[TE_FP8_COLLECTION]) == _shapes(expected)
    assert OVERWRITE_WITH_GRADIENT not in te and te["params"].keys() == v["params"].keys()


def test_te_checkpoint_loads_into_lowbit_and_round_trips():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32), jnp.float32)
    layer = _layer()
    fresh = _init(layer, x)
    te = {"params": fresh["params"], TE_FP8_COLLECTION: te_fp8_metas(ENCODER)}
    ours = from_te(te)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(fresh)
    # by name: TE's mlp/x_1_scale is lowbit's mlp/wo_op/x_scale, qkv's x_scale its dense_op/x_scale
    np.testing.assert_array_equal(
        ours[OVERWRITE_WITH_GRADIENT]["mlp"]["wo_op"]["x_scale"], te[TE_FP8_COLLECTION]["mlp"]["x_1_scale"]
    )
    np.testing.assert_array_equal(
        ours[OVERWRITE_WITH_GRADIENT]["attention"]["qkv"]["dense_op"]["kernel_amax_history"],
        te[TE_FP8_COLLECTION]["attention"]["qkv"]["kernel_amax_history"],
    )
    back = to_te(ours)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, te)
    with lowbit.autocast(recipe.DelayedScaling(amax_history_len=L)):
        y_loaded = layer.apply(ours, x, deterministic=True)
        y_fresh = layer.apply(fresh, x, deterministic=True)
    # The loaded scales are used: the forward differs from the fresh state's (scale 1).
    assert bool(jnp.all(jnp.isfinite(y_loaded))) and not np.allclose(y_loaded, y_fresh)


def test_names_without_counterpart_are_refused():
    bad = {TE_FP8_COLLECTION: {"mlp": {"x_7_scale": jnp.ones((1,))}}}
    with pytest.raises(ValueError, match="postfix '_7'"):
        from_te(bad)
    shared = {OVERWRITE_WITH_GRADIENT: {"out": {"dense_op": {"x_scale_call1": jnp.ones((1,))}}}}
    with pytest.raises(ValueError, match="_call"):
        to_te(shared)
