"""grouped_dequantize lays groups out as grouped_quantize does, whatever the group sizes sum to
(issue 11, point 2: a sum past 2**31 wrapped in an int32 cumsum and decoded to zeros)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit

SM = lowbit.ScalingMode
pytestmark = pytest.mark.usefixtures("on_cpu")


def _x():
    return jnp.asarray(np.random.default_rng(11).standard_normal((64, 32)).astype(np.float32))


@pytest.mark.parametrize(
    "sizes",
    [
        (2147483647, 5),  # the sum wraps int32
        (2147483647, 2147483647),
        (40, 2147483600, 70),
        (10, -3, 70),  # negative counts as 0; the sum passes M
        (0, 64),
        (20, 10),  # rows 30.. are in no group
    ],
)
@pytest.mark.parametrize("mode", [SM.CURRENT_TENSOR_SCALING, SM.MXFP8_1D_SCALING])
def test_sizes_past_rows_agree_with_grouped_quantize(sizes, mode):
    x = _x()
    gs = jnp.array(sizes, jnp.int32)
    qt = lowbit.grouped_quantize(x, gs, mode)
    got = np.asarray(lowbit.grouped_dequantize(qt, gs))
    jit_got = np.asarray(jax.jit(lowbit.grouped_dequantize)(qt, gs))
    # Reference: each group quantized alone, with grouped_quantize's clamped row ranges.
    want = np.zeros((64, 32), np.float32)
    start = 0
    for s in sizes:
        s = max(s, 0)
        b, e = min(start, 64), min(start + s, 64)
        start += s
        if e > b:
            one = lowbit.quantize(x[b:e], mode) if mode == SM.MXFP8_1D_SCALING else None
            if one is None:
                one = lowbit.grouped_quantize(x[b:e], jnp.array([e - b], jnp.int32), mode)
                want[b:e] = np.asarray(lowbit.grouped_dequantize(one, jnp.array([e - b], jnp.int32)))
            else:
                want[b:e] = np.asarray(lowbit.dequantize(one))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jit_got, want)
    if start > 0 and min(start, 64) > 0:
        assert np.any(got != 0)


def test_group_ends_saturate():
    from lowbit.ops.quantize import group_ends

    ends = group_ends(jnp.array([2147483647, 5, -1, 3], jnp.int32), 64)
    np.testing.assert_array_equal(np.asarray(ends), [64, 64, 64, 64])
    ends = group_ends(jnp.array([3, -7, 2147483647], jnp.int32), 2147483647)
    np.testing.assert_array_equal(np.asarray(ends), [3, 3, 2147483647])
