"""Values that used to give all-NaN or all-zero results silently (issue 11, point 7): a concrete
bad value is refused naming the argument; a traced bad scale follows docs/numerics.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit

SM = lowbit.ScalingMode
pytestmark = pytest.mark.usefixtures("on_cpu")
BAD = [0.0, -1.0, float("nan"), float("inf")]
X = jnp.linspace(-2, 2, 32 * 32, dtype=jnp.float32).reshape(32, 32)


@pytest.mark.parametrize("bad", BAD)
def test_concrete_delayed_scale_refused(bad):
    s = jnp.float32(bad)
    for call in (
        lambda: lowbit.quantize(X, SM.DELAYED_TENSOR_SCALING, scale=s),
        lambda: lowbit.quantize_dbias(X, SM.DELAYED_TENSOR_SCALING, scale=s),
        lambda: lowbit.grouped_quantize(
            X,
            jnp.array([16, 16], jnp.int32),
            SM.DELAYED_TENSOR_SCALING,
            scale=jnp.array([1.0, bad], jnp.float32),
        ),
        lambda: lowbit.layernorm(
            X, jnp.ones((32,)), jnp.zeros((32,)), quantize=(SM.DELAYED_TENSOR_SCALING, jnp.float8_e4m3fn, s)
        ),
    ):
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            call()


@pytest.mark.parametrize("role", ["x", "kernel", "grad"])
@pytest.mark.parametrize("bad", BAD)
def test_concrete_state_scale_refused(role, bad):
    r = lowbit.DelayedScaling(amax_history_len=4)
    state = dict(lowbit.init_delayed_state(r), **{f"{role}_scale": jnp.full((1,), bad, jnp.float32)})
    with pytest.raises(ValueError, match=f"state\\['{role}_scale'\\] must be positive and finite"):
        lowbit.dense(X, X, recipe=r, state=state)
    gstate = dict(
        lowbit.init_grouped_delayed_state(r, 2), **{f"{role}_scale": jnp.array([1.0, bad], jnp.float32)}
    )
    with pytest.raises(ValueError, match=f"state\\['{role}_scale'\\]"):
        lowbit.grouped_gemm(X, jnp.ones((2, 32, 16)), jnp.array([16, 16], jnp.int32), recipe=r, state=gstate)


@pytest.mark.parametrize("bad", BAD)
def test_traced_bad_scale_acts_as_one(bad):
    # Documented rule: a traced non-positive or non-finite scale is replaced by 1.
    f = jax.jit(lambda s: lowbit.quantize(X, SM.DELAYED_TENSOR_SCALING, scale=s).dequantize())
    got, one = f(jnp.float32(bad)), f(jnp.float32(1.0))
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(one))
    r = lowbit.DelayedScaling(amax_history_len=4)
    state = dict(lowbit.init_delayed_state(r), x_scale=jnp.full((1,), bad, jnp.float32))
    y = jax.jit(lambda st: lowbit.dense(X, X, recipe=r, state=st))(state)
    y1 = lowbit.dense(X, X, recipe=r, state=lowbit.init_delayed_state(r))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y1))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_softmax_scale_factor_must_be_finite(bad):
    with pytest.raises(ValueError, match="scale_factor must be finite"):
        lowbit.softmax(X, bad)


def test_dense_rank0_input():
    with pytest.raises(ValueError, match="dense: x must have shape"):
        lowbit.dense(jnp.float32(1.0), jnp.ones((1, 4)))
    with pytest.raises(ValueError, match="dense: kernel must have shape"):
        lowbit.dense(jnp.ones((4,)), jnp.float32(1.0))


def test_grouped_dequantize_group_count_mismatch():
    gs = jnp.array([16, 16], jnp.int32)
    qt = lowbit.grouped_quantize(X, gs, SM.CURRENT_TENSOR_SCALING)
    with pytest.raises(ValueError, match="group_sizes has 3 groups but qt.scale_inv has 2"):
        lowbit.grouped_dequantize(qt, jnp.array([8, 8, 16], jnp.int32))
