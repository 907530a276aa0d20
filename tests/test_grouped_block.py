"""Float8BlockScaling on the grouped GEMM (mixture of experts): grouped BLOCK_1D quantize bit for
bit against tests/oracle.py, and lowbit.grouped_gemm / make_ragged_dot_cls with the recipe
against a float64 reference (forward and both gradients), uneven and empty groups included.

Tests taking ``device`` run on the CPU and (marked ``gpu``) on the first CUDA device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import is_gpu, run_on, to_cpu
from test_grouped_gemm import bf16_values, ranges, ref_forward, ref_grads, rel, vjp_outputs
from test_quantize import assert_bits, make_x

import lowbit
from lowbit.flax.ragged_dot import make_ragged_dot_cls

SM = lowbit.ScalingMode
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16 = jnp.float32, jnp.bfloat16

# (M, K, sizes): uneven, empty, sum below / above M, groups longer than one 128-row block,
# K not a multiple of 128.
GQ_CASES = {
    "uneven_empty": (40, 200, [13, 0, 20, 7]),
    "long_groups": (300, 130, [0, 150, 129, 1, 0]),
    "sum_below": (64, 128, [10, 20]),
    "sum_above": (50, 64, [30, 30, 30]),
    "negative": (33, 16, [12, -4, 21]),
}


@pytest.mark.parametrize("name", list(GQ_CASES))
@pytest.mark.parametrize("q", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("opts", [(False, 0.0), (True, 0.0), (False, 1e-3)], ids=["f32", "pow2", "eps"])
def test_grouped_quantize_block1d_oracle(device, rng, name, q, opts):
    M, K, sizes = GQ_CASES[name]
    pow2, eps = opts
    x = make_x(rng, (M, K), BF16)
    x[3, 5] = 0.0
    sizes = np.asarray(sizes, np.int32)

    def f(x, s):
        qt = lowbit.grouped_quantize(
            x, s, SM.BLOCK_1D_SCALING, q, layout="both", power_2_scale=pow2, amax_epsilon=eps
        )
        return qt.data, qt.scale_inv, qt.colwise_data, qt.colwise_scale_inv, qt.amax

    got = to_cpu(run_on(device, f, jnp.asarray(x), jnp.asarray(sizes)))
    want = O.grouped_quantize_block1d(x, sizes, q, eps=eps, pow2=pow2)
    for g, key in zip(got, ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax")):
        assert_bits(np.asarray(g), want[key], key)
    # The decoded copies approximate x: within FP8's relative step on each block's scale.
    fmt = O.fmt_of(q)
    dec = O.grouped_block1d_decode(want, K, fmt, "rowwise")
    assert np.allclose(dec, O.to_f32(x), rtol=0.13, atol=float(np.abs(O.to_f32(x)).max()) * 2**-6)


def test_grouped_quantize_block1d_rowwise_only_and_errors(rng):
    x = jnp.asarray(make_x(rng, (20, 40), BF16))
    s = jnp.asarray([5, 15], jnp.int32)
    qt = lowbit.grouped_quantize(x, s, SM.BLOCK_1D_SCALING, E4M3)
    assert qt.colwise_data is None and qt.scale_inv.shape == (20,)
    with pytest.raises(ValueError, match="BLOCK_1D_SCALING for grouped_quantize"):
        lowbit.grouped_quantize(x, s, SM.BLOCK_2D_SCALING, E4M3)
    with pytest.raises(ValueError, match="power_2_scale and amax_epsilon"):
        lowbit.grouped_quantize(x, s, SM.CURRENT_TENSOR_SCALING, E4M3, power_2_scale=True)
