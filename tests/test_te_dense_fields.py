"""DenseGeneral / LayerNormDenseGeneral fields TE 2.20 has: ``input_axes``,
``layernorm_input_axes``, ``dot_input_axes`` (sharding constraints only), ``depth_scaling`` (the
output divided by it), ``transpose_batch_sequence`` and ``quantization_checkpoint_name`` (no
effect on the math)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

from lowbit.flax import DenseGeneral, LayerNormDenseGeneral


def _ref_ln_dense(x, p, scale=1.0):
    x = np.asarray(x, np.float64)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + 1e-6) * np.asarray(p["scale"], np.float64) + np.asarray(
        p["ln_bias"], np.float64
    )
    return (y @ np.asarray(p["kernel"], np.float64)) / scale


@pytest.mark.parametrize("depth_scaling", [None, 4.0])
def test_layernorm_dense_depth_scaling_and_axes(depth_scaling):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32), jnp.float32)
    m = LayerNormDenseGeneral(
        features=16,
        depth_scaling=depth_scaling,
        layernorm_input_axes=("batch", "seq", "embed"),
        dot_input_axes=("batch", "seq", "embed"),
        transpose_batch_sequence=True,
        quantization_checkpoint_name="q",
    )
    v = m.init(jax.random.PRNGKey(1), x)
    out, ln = m.apply(v, x)
    assert ln is None
    assert rel(out, _ref_ln_dense(x, nn.unbox(v)["params"], depth_scaling or 1.0)) < 1e-5


def test_dense_general_te_fields_change_nothing():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32), jnp.float32)
    plain = DenseGeneral(features=16)
    v = plain.init(jax.random.PRNGKey(1), x)
    te = DenseGeneral(
        features=16,
        input_axes=("batch", "seq", "embed"),
        transpose_batch_sequence=True,
        quantization_checkpoint_name="q",
    )
    np.testing.assert_array_equal(te.apply(v, x), plain.apply(v, x))
    with pytest.raises(ValueError, match="logical axes"):
        DenseGeneral(features=16, input_axes=("batch", "embed")).apply(v, x)
