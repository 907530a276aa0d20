"""Group sizes of an integer dtype wider than int32 (uint32 past 2**31, int64 past 2**32, as a
host value or a traced array) mean what docs/numerics.md says for any size: a size past M ends
the groups at row M, a negative one counts as 0. They used to wrap in the int32 narrowing
(2**32 - 1 -> -1, 2**32 + 10 -> 10), so most rows went to the wrong expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import run_on, to_cpu
from helpers import bits, rel
from test_grouped_gemm import bf16_values, ref_forward, ref_grads

import lowbit

SM = lowbit.ScalingMode
BF16 = jnp.bfloat16
M, K, N = 64, 32, 48
# (sizes, dtype, traced): traced sizes are a jit argument (clamped on the device), the others
# a NumPy array closed over (clamped on the host, before jnp.asarray would wrap an int64).
WIDE = {
    "uint32_max_traced": ([2**32 - 1, 30], jnp.uint32, True),
    "uint32_max_host": ([2**32 - 1, 30], np.uint32, False),
    "int64_past_2_32_host": ([2**32 + 10, 30], np.int64, False),
    "int64_negative_host": ([-(2**32) + 5, 40, 10], np.int64, False),
}


def _call(fn, sizes, dtype, traced):
    """``fn(sizes, *arrays)`` with the sizes as a traced argument or a host constant."""
    if traced:
        return lambda s, *a: fn(s, *a), (jnp.asarray(np.asarray(sizes, dtype)),)
    host = np.asarray(sizes, dtype)
    return lambda *a: fn(host, *a), ()


@pytest.mark.parametrize("name", list(WIDE))
def test_grouped_gemm_wide_sizes_are_clamped(device, rng, name):
    sizes, dtype, traced = WIDE[name]
    G = len(sizes)
    lhs, rhs, dout = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N)), bf16_values(rng, (M, N))

    def vjp(s, a, b, d):
        y, f = jax.vjp(lambda a, b: lowbit.grouped_gemm(a, b, s), a, b)
        return (y,) + f(d)

    fn, size_args = _call(vjp, sizes, dtype, traced)
    args = [jnp.asarray(a, BF16) for a in (lhs, rhs, dout)]
    y, dl, dr = to_cpu(run_on(device, fn, *size_args, *args))
    # The float64 ragged_dot with the sizes as Python ints (clamped there, no narrowing).
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    assert rel(y, ref) < 6e-3 and rel(dl, rdl) < 6e-3 and rel(dr, rdr) < 6e-3


@pytest.mark.parametrize("name", [n for n, (_, _, traced) in WIDE.items() if not traced])
def test_grouped_quantize_wide_host_sizes_are_clamped(device, rng, name):
    sizes, dtype, _ = WIDE[name]
    x = rng.standard_normal((M, K)).astype(np.float32) * np.repeat(2.0 ** np.arange(-4, 4), M // 8)[:, None]
    fn, _ = _call(lambda s, x: lowbit.grouped_quantize(x, s, SM.CURRENT_TENSOR_SCALING), sizes, dtype, False)
    qt = to_cpu(run_on(device, fn, jnp.asarray(x, jnp.float32)))
    r = O.grouped_quantize(x, sizes, int(SM.CURRENT_TENSOR_SCALING), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(bits(qt.amax), bits(r["amax"]))
    np.testing.assert_array_equal(bits(qt.scale_inv), bits(r["scale_inv"]))
    np.testing.assert_array_equal(bits(qt.data), r["data"])


def test_grouped_quantize_still_refuses_a_traced_wide_dtype():
    x = jnp.ones((M, K), jnp.float32)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        jax.jit(lambda s: lowbit.grouped_quantize(x, s, SM.CURRENT_TENSOR_SCALING))(
            jnp.array([2**32 - 1, 30], jnp.uint32)
        )


@pytest.mark.parametrize("name", list(WIDE))
def test_grouped_dequantize_block1d_wide_sizes_are_clamped(device, rng, name):
    """BLOCK_1D's layout depends on the group ends: decoded with the wide sizes it equals the
    decode with the same sizes clamped to [0, M] as int32."""
    sizes, dtype, traced = WIDE[name]
    clamped = np.clip(np.asarray(sizes, np.int64), 0, M).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((M, 256)), jnp.float32)
    qt = lowbit.grouped_quantize(x, clamped, SM.BLOCK_1D_SCALING, layout="both")
    for layout in ("rowwise", "colwise"):
        fn, size_args = _call(lambda s, qt: lowbit.grouped_dequantize(qt, s, layout), sizes, dtype, traced)
        got = to_cpu(run_on(device, fn, *size_args, qt))
        want = to_cpu(lowbit.grouped_dequantize(qt, clamped, layout))
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=layout)
