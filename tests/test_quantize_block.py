"""FP8 block scaling (BLOCK_1D_SCALING 1x128, BLOCK_2D_SCALING 128x128, float32 scales in the
cuBLASLt layout): quantize / dequantize bit for bit against tests/oracle.py.

Every test that takes ``device`` runs on the CPU and (marked ``gpu``) on the first CUDA device;
on the GPU the result is also compared bit for bit with the CPU kernel's (``check``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import run_on, to_cpu
from test_quantize import assert_bits, check, dt_id, make_x

import lowbit
from lowbit.quantization.scaling_modes import fp8_block_scale_shape

SM = lowbit.ScalingMode
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
MODES = [SM.BLOCK_1D_SCALING, SM.BLOCK_2D_SCALING]
# Ragged on purpose: K (cols) not a multiple of 128, rows not a multiple of 128 (2D) or of 4
# (the 1D scale padding); one shape smaller than a block.
SHAPES = [(130, 300), (256, 128), (5, 7), (129, 257), (64, 384)]


def mode_id(m):
    return m.name


@pytest.mark.parametrize("pow2", [False, True], ids=["f32", "pow2"])
@pytest.mark.parametrize("layout", ["rowwise", "colwise", "both"])
@pytest.mark.parametrize("in_dtype", [F32, BF16, F16], ids=dt_id)
@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=dt_id)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_bitexact(device, rng, mode, q_dtype, in_dtype, layout, pow2):
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    x = make_x(rng, shape, in_dtype)
    check(device, x, mode, q_dtype, layout=layout, power_2_scale=pow2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_scale_shapes(device, rng, mode, shape):
    x = make_x(rng, shape, BF16)
    qt, _ = check(device, x, mode, E4M3, layout="both")
    R, C = shape
    assert qt.scale_inv.shape == fp8_block_scale_shape(mode, R, C)
    assert qt.colwise_scale_inv.shape == fp8_block_scale_shape(mode, C, R)
    if mode == SM.BLOCK_1D_SCALING:
        assert qt.scale_inv.shape == (-(-C // 128), -(-R // 4) * 4)
    else:
        assert qt.scale_inv.shape == (-(-R // 128), -(-(-(-C // 128)) // 4) * 4)


@pytest.mark.parametrize("eps", [0.0, 1e-3, 2.0])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_amax_epsilon(device, rng, mode, eps):
    x = make_x(rng, (130, 260), F32, spread=6.0)
    x[:, :128] = 0.0  # zero blocks: the epsilon decides their scale
    check(device, x, mode, E4M3, layout="both", amax_epsilon=eps, power_2_scale=bool(eps == 2.0))


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_zero_blocks_and_zero_tensor(device, rng, mode):
    x = make_x(rng, (256, 384), BF16)
    x[:128, 128:256] = 0
    x[200, :] = 0
    qt, _ = check(device, x, mode, E4M3, layout="both")
    # A zero block gets scale 1 (scale_inv 1) and zero codes.
    z = np.zeros((130, 200), np.float32)
    qt, _ = check(device, z, mode, E4M3, layout="both", power_2_scale=True)
    assert np.all(np.asarray(qt.scale_inv) == 1.0) and np.all(np.asarray(qt.colwise_scale_inv) == 1.0)


@pytest.mark.parametrize("in_dtype", [F32, BF16, F16], ids=dt_id)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_inf_nan(device, rng, mode, in_dtype):
    x = make_x(rng, (130, 260), F32)
    x[3, 5] = np.nan
    x[140 % 130, 200] = np.inf
    x[129, 259] = -np.inf
    x[64, 130:258] = np.nan  # a whole 1-D block of NaN: amax 0, scale 1, NaN codes
    qt, _ = check(device, x.astype(in_dtype), mode, E4M3, layout="both", power_2_scale=True)
    # Every scale stays finite and nonzero.
    for s in (qt.scale_inv, qt.colwise_scale_inv):
        s = np.asarray(s)
        assert np.all(np.isfinite(s)) and np.all(s > 0)
    # NaN in gives NaN out.
    y = np.asarray(to_cpu(run_on(device, lambda q: lowbit.dequantize(q, "rowwise", F32), qt)))
    assert np.isnan(y[3, 5]) and np.all(np.isnan(y[64, 130:258]))


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_subnormal_inputs(device, rng, mode):
    x = (make_x(rng, (130, 200), F32, spread=1.0) * np.float32(1e-39)).astype(np.float32)
    x[:, 128:] *= np.float32(1e-1)  # some blocks entirely of subnormals
    for pow2 in (False, True):
        check(device, x, mode, E4M3, layout="both", power_2_scale=pow2)
        check(device, x, mode, E5M2, layout="both", power_2_scale=pow2)


@pytest.mark.parametrize("out_dtype", [F32, BF16, F16], ids=dt_id)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_dequantize_bitexact(device, rng, mode, out_dtype):
    x = make_x(rng, (130, 300), BF16)
    qt, r = check(device, x, mode, E4M3, layout="both")
    for layout in ("rowwise", "colwise"):
        got = to_cpu(run_on(device, lambda q, lay=layout: lowbit.dequantize(q, lay, out_dtype), qt))
        want = O.dequantize(r, int(mode), E4M3, x.shape, layout=layout, out_dtype=np.dtype(out_dtype))
        assert_bits(got, want, f"dequantize {layout}")


def test_flatten_axis_3d(device, rng):
    x = make_x(rng, (3, 50, 140), BF16)
    for ax in (1, 2):
        check(device, x, SM.BLOCK_1D_SCALING, E4M3, layout="both", flatten_axis=ax)


def test_dbias(device, rng):
    x = make_x(rng, (130, 260), BF16)
    qt, db = to_cpu(
        run_on(device, lambda v: lowbit.quantize_dbias(v, SM.BLOCK_1D_SCALING, E5M2, layout="both"), x)
    )
    want = np.asarray(x, np.float64).sum(axis=0)
    np.testing.assert_allclose(np.asarray(db, np.float64), want, rtol=2e-2, atol=1e-2)


def test_pow2_scales_are_powers_of_two(rng):
    x = make_x(rng, (256, 256), F32)
    qt = lowbit.quantize(x, SM.BLOCK_2D_SCALING, layout="both", power_2_scale=True)
    m, _ = np.frexp(np.asarray(qt.scale_inv))
    assert np.all(m == 0.5)


def test_option_errors():
    x = jnp.ones((4, 128), F32)
    with pytest.raises(ValueError, match="power_2_scale and amax_epsilon"):
        lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, power_2_scale=True)
    with pytest.raises(ValueError, match="amax_epsilon"):
        lowbit.quantize(x, SM.BLOCK_1D_SCALING, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="amax_epsilon"):
        lowbit.quantize(x, SM.BLOCK_1D_SCALING, amax_epsilon=float("inf"))


def test_validate_refuses_wrong_scale_shape():
    import dataclasses

    qt = lowbit.quantize(jnp.ones((8, 256), F32), SM.BLOCK_1D_SCALING)
    bad = dataclasses.replace(qt, scale_inv=jnp.ones((2, 7), jnp.float32))
    with pytest.raises(ValueError, match="cuBLASLt's layout"):
        lowbit.dequantize(bad)


def test_grouped_quantize_1d(device, rng):
    """Grouped BLOCK_1D: the rows of each group quantized as the plain 1x128 quantize does; rows
    in no group get zero codes and scale_inv 1; amax per group. The scales are in the grouped
    layout the grouped GEMM reads (tests/test_grouped_block.py checks both copies bit for bit)."""
    M, K = 70, 300
    x = make_x(rng, (M, K), BF16)
    sizes = np.array([20, 0, 33, 9], np.int32)  # sum 62 < M: 8 rows in no group

    def f(x, gs):
        qt = lowbit.grouped_quantize(x, gs, SM.BLOCK_1D_SCALING, E4M3, power_2_scale=True)
        return qt, lowbit.grouped_dequantize(qt, gs, dtype=F32)

    qt, dq = to_cpu(run_on(device, f, x, sizes))
    r = O.quantize(np.asarray(x), O.BLOCK_1D, E4M3, power_2_scale=True)
    end = int(sizes.sum())
    want_codes = r.data.copy()
    want_codes[end:] = 0
    assert_bits(np.asarray(qt.data).view(np.uint8), want_codes, "grouped data")
    want = O.grouped_quantize_block1d(np.asarray(x), sizes, E4M3, pow2=True)
    assert_bits(qt.scale_inv, want["scale_inv"], "grouped scale_inv")
    x32 = np.abs(np.asarray(x, np.float32))
    bounds = np.cumsum(np.concatenate([[0], sizes]))
    want_amax = [x32[bounds[g] : bounds[g + 1]].max(initial=0.0) for g in range(len(sizes))]
    np.testing.assert_array_equal(np.asarray(qt.amax), np.asarray(want_amax, np.float32))
    assert np.all(dq[end:] == 0)
    with pytest.raises(ValueError, match="straddle"):
        lowbit.grouped_quantize(jnp.asarray(x), jnp.asarray(sizes), SM.BLOCK_2D_SCALING)
