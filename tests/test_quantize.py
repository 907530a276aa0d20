"""Bit-exact tests of lowbit.quantize / dequantize / grouped_quantize against tests/oracle.py.

Every test that takes ``device`` runs on the CPU and (marked ``gpu``) on the first CUDA device;
on the GPU the result is also compared bit for bit with the CPU kernel's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import cpu_device, is_gpu, run_on, to_cpu
from helpers import bits

import lowbit

SM = lowbit.ScalingMode
E4M3, E5M2, E2M1 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
IN_DTYPES = [F32, BF16, F16]
LAYOUTS = ["rowwise", "colwise", "both"]

COMBOS = [
    (SM.DELAYED_TENSOR_SCALING, E4M3),
    (SM.DELAYED_TENSOR_SCALING, E5M2),
    (SM.CURRENT_TENSOR_SCALING, E4M3),
    (SM.CURRENT_TENSOR_SCALING, E5M2),
    (SM.MXFP8_1D_SCALING, E4M3),
    (SM.MXFP8_1D_SCALING, E5M2),
    (SM.NVFP4_1D_SCALING, E2M1),
    (SM.NVFP4_2D_SCALING, E2M1),
]


def combo_id(c):
    return f"{c[0].name}-{np.dtype(c[1]).name}"


def dt_id(d):
    return np.dtype(d).name


# Valid 2-D shapes for "both" layouts (rows, cols), per mode.
SHAPES = {
    SM.NO_SCALING: [(37, 50), (64, 128)],
    SM.DELAYED_TENSOR_SCALING: [(37, 50), (64, 128), (128, 256)],
    SM.CURRENT_TENSOR_SCALING: [(37, 50), (64, 128), (128, 256)],
    SM.MXFP8_1D_SCALING: [(64, 128), (96, 64), (32, 256)],
    SM.NVFP4_1D_SCALING: [(48, 64), (64, 128), (128, 256), (16, 16)],
    SM.NVFP4_2D_SCALING: [(48, 80), (64, 128), (128, 256)],
}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _canon_nan(a):
    """float16/bfloat16/float32 arrays: every NaN as the same NaN (IEEE leaves payloads open and
    CUDA's 1/NaN is 0x7FFFFFFF); 1-byte formats keep their bits (canonical NaN codes are spec)."""
    if a.dtype.itemsize >= 2 and a.dtype.kind == "f" or a.dtype == np.dtype(BF16):
        a = np.where(np.isnan(a.astype(np.float32)), np.array(np.nan, a.dtype), a).astype(a.dtype)
    return a


def assert_bits(got, want, what):
    got, want = _canon_nan(np.asarray(got)), _canon_nan(np.asarray(want))
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    g, w = bits(got), bits(want)
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        idx = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {g.size} differ; first at {idx}: got {g[idx]:#x} ({got[idx]!r}), "
            f"want {w[idx]:#x} ({want[idx]!r})"
        )


def make_x(rng, shape, dtype, spread=4.0):
    """Fresh random input: normal values with per-row magnitudes 2**U(-spread, spread)."""
    shape = tuple(shape)
    mag = 2.0 ** rng.uniform(-spread, spread, size=shape[:-1] + (1,))
    x = rng.standard_normal(shape) * mag
    return x.astype(np.float32).astype(dtype)


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def seed_words(key):
    s = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    return int(s[0]), int(s[1])


def _quantize_fn(x, scale, key, *, mode, q_dtype, dbias=False, **kw):
    if dbias:
        return lowbit.quantize_dbias(x, mode, q_dtype, scale=scale, rng_key=key, **kw)
    return lowbit.quantize(x, mode, q_dtype, scale=scale, rng_key=key, **kw), None


def q_run(device, x, mode, q_dtype=None, *, scale=None, key=None, dbias=False, **kw):
    """lowbit.quantize(_dbias) jitted on ``device``; returns (ScaledTensor of NumPy arrays, dbias)."""
    scale = None if scale is None else jnp.asarray(scale, jnp.float32)
    return to_cpu(
        run_on(
            device, _quantize_fn, jnp.asarray(x), scale, key, mode=mode, q_dtype=q_dtype, dbias=dbias, **kw
        )
    )


def oracle_q(x, mode, q_dtype=None, *, scale=None, key=None, **kw):
    seed = None if key is None else seed_words(key)
    return O.quantize(np.asarray(x), int(mode), q_dtype, scale=scale, seed=seed, **kw)


def _scale_bits(s):
    """float32 scale_inv as is; E8M0 / E4M3 block scales as their uint8 codes."""
    s = np.asarray(s)
    return s if s.dtype == np.float32 else bits(s)


def assert_matches_oracle(qt, r, mode, layout):
    rowwise = layout in ("rowwise", "both")
    colwise = layout in ("colwise", "both")
    assert (qt.data is not None) == rowwise and (qt.colwise_data is not None) == colwise
    if rowwise:
        if mode == SM.NO_SCALING:
            assert_bits(qt.data, r.data, "rowwise data")
        else:
            assert_bits(bits(qt.data), r.data, "rowwise data")
        if mode != SM.NO_SCALING:
            assert_bits(_scale_bits(qt.scale_inv), r.scale_inv, "rowwise scale_inv")
    if colwise:
        if mode == SM.NO_SCALING:
            assert_bits(qt.colwise_data, r.colwise_data, "colwise data")
        else:
            assert_bits(bits(qt.colwise_data), r.colwise_data, "colwise data")
        if mode != SM.NO_SCALING:
            assert_bits(_scale_bits(qt.colwise_scale_inv), r.colwise_scale_inv, "colwise scale_inv")
    assert_bits(qt.amax, r.amax, "amax")
    if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING):
        # Only the entries of the copies that were produced are specified.
        if rowwise:
            assert_bits(qt.global_scale_inv[0], r.global_scale_inv[0], "global_scale_inv[0]")
        if colwise:
            assert_bits(qt.global_scale_inv[1], r.global_scale_inv[1], "global_scale_inv[1]")
    else:
        assert qt.global_scale_inv is None


def assert_same_tree(a, b, what="GPU vs CPU"):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{what}: tree structure differs"
    for i, (u, v) in enumerate(zip(la, lb)):
        assert_bits(u, v, f"{what}: leaf {i}")


def check(device, x, mode, q_dtype=None, *, layout="both", **kw):
    """Quantize on ``device``, compare with the oracle, and on a GPU also with the CPU kernel."""
    qt, _ = q_run(device, x, mode, q_dtype, layout=layout, **kw)
    r = oracle_q(x, mode, q_dtype, layout=layout, **kw)
    assert_matches_oracle(qt, r, mode, layout)
    if is_gpu(device):
        qc, _ = q_run(cpu_device(), x, mode, q_dtype, layout=layout, **kw)
        assert_same_tree(qt, qc)
    return qt, r


def delayed_scale(rng, x, fmax):
    """A non-power-of-two delayed scale near fmax / amax (some values saturate)."""
    a = float(np.max(np.abs(np.asarray(x, np.float32))))
    return np.float32((fmax / max(a, 1e-30)) * rng.uniform(0.7, 1.3))


def kw_for(mode, rng, x, q_dtype):
    if mode == SM.DELAYED_TENSOR_SCALING:
        return dict(scale=delayed_scale(rng, x, O.fmt_of(q_dtype).max))
    return {}


# ---------------------------------------------------------------------------------------------
# bit-exact: every mode x q_dtype x layout x input dtype
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_bitexact(device, rng, combo, in_dtype, layout):
    mode, q_dtype = combo
    x = make_x(rng, pick(rng, SHAPES[mode]), in_dtype)
    check(device, x, mode, q_dtype, layout=layout, **kw_for(mode, rng, x, q_dtype))


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
def test_no_scaling(device, rng, in_dtype):
    x = make_x(rng, pick(rng, SHAPES[SM.NO_SCALING]), in_dtype)
    qt, _ = check(device, x, SM.NO_SCALING, layout="both")
    assert qt.data.dtype == np.dtype(in_dtype) and qt.scale_inv is None
    assert_bits(lowbit.dequantize(qt), x, "NO_SCALING dequantize")


@pytest.mark.parametrize("flatten_axis", [1, 2, -1, -2])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_flatten_axis_3d(device, rng, combo, flatten_axis):
    mode, q_dtype = combo
    shape = (32, 3, 64) if mode == SM.MXFP8_1D_SCALING else (16, 3, 32)
    x = make_x(rng, shape, pick(rng, IN_DTYPES))
    qt, _ = check(
        device, x, mode, q_dtype, layout="both", flatten_axis=flatten_axis, **kw_for(mode, rng, x, q_dtype)
    )
    axis = flatten_axis % 3
    assert qt.data.shape == shape
    assert qt.colwise_data.shape == shape[axis:] + shape[:axis]
    for layout in ("rowwise", "colwise"):
        assert lowbit.dequantize(qt, layout).shape == shape


def test_flatten_axis_0_rowwise(device, rng):
    """flatten_axis=0: one row of everything (R = 1)."""
    x = make_x(rng, (4, 2, 32), F32)
    check(device, x, SM.MXFP8_1D_SCALING, E4M3, layout="rowwise", flatten_axis=0)
    check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="rowwise", flatten_axis=0)


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [None, F32, BF16], ids=lambda d: "same" if d is None else dt_id(d))
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_dequantize_bitexact(device, rng, combo, out_dtype):
    mode, q_dtype = combo
    in_dtype = pick(rng, IN_DTYPES)
    x = make_x(rng, pick(rng, SHAPES[mode]), in_dtype)
    kw = kw_for(mode, rng, x, q_dtype)
    qt, _ = q_run(device, x, mode, q_dtype, layout="both", **kw)
    r = oracle_q(x, mode, q_dtype, layout="both", **kw)
    want_dt = np.dtype(out_dtype if out_dtype is not None else in_dtype)
    for layout in ("rowwise", "colwise"):
        got = to_cpu(run_on(device, lambda q: lowbit.dequantize(q, layout, dtype=out_dtype), qt))
        want = O.dequantize(r, int(mode), q_dtype, x.shape, layout=layout, out_dtype=want_dt)
        assert got.dtype == want_dt
        assert_bits(got, want, f"dequantize {layout}")
        # and it is close to x
        err = np.abs(got.astype(np.float64) - x.astype(np.float64))
        rel = np.linalg.norm(err) / np.linalg.norm(x.astype(np.float64))
        assert rel < (0.15 if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING) else 0.08), rel
    # The method form agrees.
    assert_bits(qt.dequantize("colwise"), lowbit.dequantize(qt, "colwise"), "ScaledTensor.dequantize")


# ---------------------------------------------------------------------------------------------
# edge cases
# ---------------------------------------------------------------------------------------------
def _zero_some_blocks(rng, x, mode):
    x = np.array(x)
    R, C = x.shape
    if mode == SM.NVFP4_2D_SCALING:
        for _ in range(3):
            i, j = rng.integers(R // 16), rng.integers(C // 16)
            x[16 * i : 16 * i + 16, 16 * j : 16 * j + 16] = 0
    else:
        b = 32 if mode == SM.MXFP8_1D_SCALING else 16
        for _ in range(4):
            i, j = rng.integers(R), rng.integers(C // b)
            x[i, b * j : b * j + b] = 0  # a rowwise block
        j = rng.integers(C)
        x[:b, j] = 0  # a colwise block
        x[-b:, j] = -0.0
    return x


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_zero_blocks(device, rng, combo):
    mode, q_dtype = combo
    x = _zero_some_blocks(rng, make_x(rng, (64, 128), pick(rng, IN_DTYPES)), mode)
    qt, r = check(device, x, mode, q_dtype, layout="both", **kw_for(mode, rng, x, q_dtype))
    if mode == SM.MXFP8_1D_SCALING:
        zero = np.all(x.reshape(64, 4, 32) == 0, axis=-1)
        assert np.all(bits(qt.scale_inv)[zero] == 127)
    if mode == SM.NVFP4_1D_SCALING:
        zero = np.all(x.reshape(64, 8, 16) == 0, axis=-1)
        assert np.all(bits(qt.scale_inv)[zero] == 0)


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_all_zero_tensor(device, combo, in_dtype):
    mode, q_dtype = combo
    x = np.zeros((32, 64), in_dtype)
    x[::3, ::5] = -0.0
    kw = dict(scale=np.float32(7.0)) if mode == SM.DELAYED_TENSOR_SCALING else {}
    qt, _ = check(device, x, mode, q_dtype, layout="both", **kw)
    assert float(qt.amax[0]) == 0.0
    d = bits(qt.data) & (0x7 if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING) else 0x7F)
    assert np.all(d == 0)
    if mode == SM.CURRENT_TENSOR_SCALING:
        assert float(qt.scale_inv[0]) == 1.0  # amax 0 -> scale 1
    if mode == SM.MXFP8_1D_SCALING:
        assert np.all(bits(qt.scale_inv) == 127)
    if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING):
        assert np.all(qt.global_scale_inv == 1.0) and np.all(bits(qt.scale_inv) == 0)
    for layout in ("rowwise", "colwise"):
        assert np.all(np.asarray(lowbit.dequantize(qt, layout), np.float32) == 0)


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
@pytest.mark.parametrize(
    "combo", COMBOS + [(SM.NO_SCALING, None)], ids=lambda c: combo_id(c) if c[1] else "NO_SCALING"
)
def test_inf_nan(device, rng, combo, in_dtype):
    mode, q_dtype = combo
    x = make_x(rng, (64, 128), in_dtype)
    x.reshape(-1)[rng.choice(x.size, 20, replace=False)] = np.nan
    x.reshape(-1)[rng.choice(x.size, 5, replace=False)] = np.inf
    x.reshape(-1)[rng.choice(x.size, 5, replace=False)] = -np.inf
    x[5, 32:64] = np.nan  # an all-NaN block (rowwise) for every block size
    kw = dict(scale=np.float32(0.75)) if mode == SM.DELAYED_TENSOR_SCALING else {}
    qt, r = check(device, x, mode, q_dtype, layout="both", **kw)
    assert float(qt.amax[0]) == np.inf  # Inf counts, NaN is ignored
    if mode == SM.NO_SCALING:
        return
    c = bits(qt.data)
    nan, pinf, ninf = np.isnan(x), np.isposinf(x), np.isneginf(x)
    if q_dtype == E2M1:
        assert np.all(c[nan] == 0x7) and np.all(c[pinf] == 0x7) and np.all(c[ninf] == 0xF)
    else:
        mx = {np.dtype(E4M3): 0x7E, np.dtype(E5M2): 0x7B}[np.dtype(q_dtype)]
        assert np.all(c[nan] == 0x7F) and np.all(c[pinf] == mx) and np.all(c[ninf] == (mx | 0x80))
    if mode == SM.CURRENT_TENSOR_SCALING:
        assert float(qt.scale_inv[0]) == 1.0  # amax Inf -> scale 1


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
def test_nan_ignored_by_amax(device, rng, in_dtype):
    x = make_x(rng, (32, 64), in_dtype)
    x.reshape(-1)[rng.choice(x.size, 7, replace=False)] = np.nan
    qt, _ = check(device, x, SM.CURRENT_TENSOR_SCALING, E4M3, layout="both")
    assert float(qt.amax[0]) == float(np.nanmax(np.abs(x.astype(np.float32))))


def test_inf_nan_rht(device, rng):
    x = make_x(rng, (64, 64), F32)
    x.reshape(-1)[rng.choice(x.size, 6, replace=False)] = np.nan
    x[3, 7] = np.inf
    x[40, 9] = -np.inf
    check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", rht=True)


def _subnormal_x(rng, shape, in_dtype):
    if np.dtype(in_dtype) == np.dtype(F16):
        # float16 subnormals: |x| < 2**-14 (normal in float32).
        v = rng.uniform(-1, 1, shape) * 2.0**-14
    else:
        # float32 / bfloat16 subnormals: |x| < 2**-126.
        deepest = -20 if np.dtype(in_dtype) == np.dtype(F32) else -5  # bf16's smallest is 2**-133
        v = rng.uniform(-1, 1, shape) * 2.0**-127 * 2.0 ** rng.integers(deepest, 1, shape)
    x = v.astype(np.float32).astype(in_dtype)
    assert np.count_nonzero(x) > x.size // 2
    return x


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_subnormal_inputs(device, rng, combo, in_dtype):
    """All-subnormal tensors (scale overflows to FLT_MAX for current/NVFP4, b = 0 for MXFP8)
    and subnormals mixed with normal values."""
    mode, q_dtype = combo
    x = _subnormal_x(rng, (32, 64), in_dtype)
    kw = dict(scale=np.float32(2.0**100 * 1.37)) if mode == SM.DELAYED_TENSOR_SCALING else {}
    qt, _ = check(device, x, mode, q_dtype, layout="both", **kw)
    if np.dtype(in_dtype) != np.dtype(F16):
        if mode == SM.CURRENT_TENSOR_SCALING:
            assert bits(qt.scale_inv)[0] == bits(O.f32_recip(O.FLT_MAX))
        if mode == SM.MXFP8_1D_SCALING:
            nz = np.any(x.reshape(32, 2, 32) != 0, axis=-1)
            assert np.all(bits(qt.scale_inv)[nz] == 0)
        if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING):
            assert bits(qt.global_scale_inv)[0] == bits(O.f32_recip(O.FLT_MAX))
    # mixed with normal values
    y = make_x(rng, (32, 64), in_dtype)
    y[::2] = x[::2]
    check(device, y, mode, q_dtype, layout="both", **kw_for(mode, rng, y, q_dtype))


@pytest.mark.parametrize("mode", [SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING], ids=lambda m: m.name)
def test_nvfp4_subnormal_blocks_keep_their_values(device, rng, mode):
    """Blocks whose amax is below ~1.8e-38 need an encode factor past float32's range; they are
    encoded as (v * S) / decode(sb) and decode to NVFP4's usual accuracy (they used to encode to
    +-6: errors above 100%)."""
    x = (rng.standard_normal((32, 64)) * 1e-39).astype(np.float32)
    qt, _ = check(device, x, mode, E2M1, layout="both")
    ref = x.astype(np.float64)
    for layout in ("rowwise", "colwise"):
        y = np.asarray(to_cpu(lowbit.dequantize(qt, layout, dtype=F32)), np.float64)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.15, layout


def _boundary_values(fmt):
    """Every representable positive value, the midpoints between neighbours (ties), their
    float32 neighbours, and values at and past max."""
    grid = np.unique(np.abs(O.decode(np.arange(1 << (1 + fmt.ebits + fmt.mbits)), fmt)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    m32 = mids.astype(np.float32)
    vals = np.concatenate(
        [
            grid,
            mids,
            np.nextafter(m32, np.float32(0)),
            np.nextafter(m32, np.float32(np.inf)),
            [
                fmt.max * 1.0001,
                fmt.max * 1.0625,
                fmt.max * 1.125,
                fmt.max * 1.2,
                fmt.max * 2,
                3e38,
                np.inf,
                grid[1] / 2,
                grid[1] / 4,
                grid[1] * 0.75,
                1e-30,
                1e-45,
            ],
        ]
    )
    vals = vals.astype(np.float32)
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=dt_id)
def test_rne_ties_saturation_tiny_fp8(device, q_dtype):
    """Delayed scaling with scale 1: codes of grid points, ties (to even), neighbours of ties,
    values past max (saturate), tiny values (to +-0, sign kept)."""
    fmt = O.fmt_of(q_dtype)
    v = _boundary_values(fmt)
    n = -(-v.size // 64) * 64
    x = np.resize(v, n).reshape(-1, 64)
    qt, _ = check(device, x, SM.DELAYED_TENSOR_SCALING, q_dtype, layout="rowwise", scale=np.float32(1.0))
    c = bits(qt.data).reshape(-1)[: v.size]
    # Independent spot checks of the rules (not via oracle.encode).
    mx = 0x7E if fmt is O.E4M3 else 0x7B
    for val, code in zip(v, c):
        a = abs(float(val))
        if a >= fmt.max:
            assert code & 0x7F == mx, (val, hex(code))
        if a <= float(O.decode(1, fmt)) / 2:
            assert code & 0x7F == 0, (val, hex(code))  # half the smallest subnormal ties to 0
        assert (code >> 7) == int(np.signbit(val)), (val, hex(code))
    grid = np.unique(np.abs(O.decode(np.arange(256), fmt)))
    grid = grid[np.isfinite(grid)]
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    got_mid = c[grid.size : grid.size + mids.size]
    assert np.all(got_mid % 2 == 0), "ties must round to the even code"
    # bf16 inputs: the same values rounded to bf16 first
    xb = x.astype(BF16)
    check(device, xb, SM.DELAYED_TENSOR_SCALING, q_dtype, layout="both", scale=np.float32(1.0))


def test_scale_product_overflow(device, rng):
    """x * scale overflowing float32 becomes Inf and saturates to max."""
    x = make_x(rng, (16, 32), F32) + 10.0
    qt, _ = check(device, x, SM.DELAYED_TENSOR_SCALING, E4M3, layout="both", scale=np.float32(3e38))
    assert np.all(bits(qt.data) & 0x7F == 0x7E)


def test_delayed_tiny_scale(device, rng):
    """The delayed formula taken literally: q = enc(x * scale), scale_inv = 1 / scale."""
    x = make_x(rng, (16, 32), F32)
    check(device, x, SM.DELAYED_TENSOR_SCALING, E4M3, layout="both", scale=np.float32(1e-30))


@pytest.mark.parametrize("scale", [-1.7, 0.0, -0.0, np.inf, np.nan], ids=str)
def test_delayed_bad_traced_scale_acts_as_one(device, rng, scale):
    """A traced scale that is not positive and finite is replaced by 1 (docs/numerics.md); a
    concrete one is refused (tests/test_bad_values.py)."""
    x = make_x(rng, (16, 32), F32)
    one, _ = check(device, x, SM.DELAYED_TENSOR_SCALING, E4M3, layout="both", scale=np.float32(1.0))
    bad, _ = q_run(device, x, SM.DELAYED_TENSOR_SCALING, E4M3, layout="both", scale=np.float32(scale))
    assert_same_tree(bad, one)


def test_rne_ties_e2m1(device, rng):
    """NVFP4 with S = 1 and block scale 1 (global amax 2688, block amax 6): the E2M1 values,
    ties and their neighbours go through unchanged (w = v), so RNE on the E2M1 grid is visible."""
    grid = O.e2m1_grid()
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.concatenate(
        [
            grid,
            mids,
            np.nextafter(mids.astype(np.float32), np.float32(0)),
            np.nextafter(mids.astype(np.float32), np.float32(9)),
            [0.1, 0.24, 0.26, 5.9],
        ]
    ).astype(np.float32)
    vals = []
    for blk in np.resize(v, (v.size + 14) // 15 * 15).reshape(-1, 15):
        vals.append(np.concatenate([[6.0], blk]))  # block amax exactly 6
    body = np.concatenate(vals).astype(np.float32)
    signs = np.where(rng.random(body.size) < 0.5, -1.0, 1.0).astype(np.float32)
    body = body * signs
    row = np.concatenate([body, np.zeros((-body.size) % 16, np.float32)])
    x = np.zeros((16, max(64, -(-row.size // 64) * 64)), np.float32)
    x[0, : row.size] = row
    x[1, :16] = 2688.0  # global amax -> S = 1
    x[2:, :] = make_x(rng, (14, x.shape[1]), F32)
    qt, r = check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="rowwise")
    assert float(qt.global_scale_inv[0]) == 1.0
    sb = bits(qt.scale_inv)[0, : row.size // 16]
    assert np.all(O.decode(sb, O.E4M3) == 1.0)
    c = bits(qt.data)[0, : body.size]
    mag = O.decode(c & 0x7, O.E2M1)
    a = np.abs(body.astype(np.float64))
    # nearest grid value, ties to the even code
    d = np.abs(a[:, None] - grid[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = np.where(d == best, np.arange(8)[None, :], 99)
    even = np.where(cand % 2 == 0, cand, 99).min(axis=1)
    want_code = np.where((d == best).sum(axis=1) > 1, even, cand.min(axis=1))
    assert np.array_equal(mag, grid[want_code])
    assert np.array_equal(c >> 3, np.signbit(body).astype(np.uint8))


@pytest.mark.parametrize(
    "mode,q_dtype,shape,layout",
    [
        (SM.DELAYED_TENSOR_SCALING, E4M3, (1, 1), "both"),
        (SM.CURRENT_TENSOR_SCALING, E5M2, (7, 13), "both"),
        (SM.CURRENT_TENSOR_SCALING, E4M3, (17,), "both"),
        (SM.MXFP8_1D_SCALING, E4M3, (48, 96), "rowwise"),
        (SM.MXFP8_1D_SCALING, E5M2, (1, 32), "rowwise"),
        (SM.MXFP8_1D_SCALING, E4M3, (3, 64), "rowwise"),
        (SM.MXFP8_1D_SCALING, E4M3, (96, 48), "colwise"),
        (SM.MXFP8_1D_SCALING, E4M3, (32, 7), "colwise"),
        (SM.MXFP8_1D_SCALING, E5M2, (96, 160), "both"),
        (SM.NVFP4_1D_SCALING, E2M1, (1, 16), "rowwise"),
        (SM.NVFP4_1D_SCALING, E2M1, (5, 48), "rowwise"),
        (SM.NVFP4_1D_SCALING, E2M1, (48, 16), "both"),
        (SM.NVFP4_1D_SCALING, E2M1, (48, 6), "colwise"),
        (SM.NVFP4_2D_SCALING, E2M1, (48, 80), "both"),
        (SM.NVFP4_2D_SCALING, E2M1, (16, 16), "rowwise"),
    ],
    ids=lambda v: str(v) if not hasattr(v, "name") else v.name,
)
def test_odd_valid_shapes(device, rng, mode, q_dtype, shape, layout):
    x = make_x(rng, shape, pick(rng, IN_DTYPES))
    check(device, x, mode, q_dtype, layout=layout, **kw_for(mode, rng, x, q_dtype))


def test_nvfp4_2d_colwise_is_transpose(device, rng):
    x = make_x(rng, (48, 64), F32)
    qt, _ = check(device, x, SM.NVFP4_2D_SCALING, E2M1, layout="both")
    assert_bits(bits(qt.colwise_data), bits(qt.data).T, "2D colwise data == rowwise data transposed")
    # scale of row r, block j == tile (r // 16, j)
    s = bits(qt.scale_inv)
    assert np.all(s.reshape(3, 16, 4)[:, :1] == s.reshape(3, 16, 4))


@pytest.mark.parametrize("mode", [SM.DELAYED_TENSOR_SCALING, SM.CURRENT_TENSOR_SCALING])
def test_tensor_colwise_is_transpose(device, rng, mode):
    x = make_x(rng, (32, 48), BF16)
    qt, _ = check(device, x, mode, E5M2, layout="both", **kw_for(mode, rng, x, E5M2))
    assert_bits(bits(qt.colwise_data), bits(qt.data).T, "colwise == rowwise^T")
    assert_bits(qt.colwise_scale_inv, qt.scale_inv, "same scale_inv")


def test_mxfp8_exponent_rule(device, rng):
    """Blocks whose amax sits exactly at fmax * 2**k and just above: b = 127 + k and 128 + k."""
    x = make_x(rng, (8, 128), F32) * 0.01
    for r, k in enumerate([-3, 0, 5, 20]):
        x[r, 0] = 448.0 * 2.0**k  # exactly fmax * 2^k -> no saturation at s = 2^k
        x[r, 32] = np.nextafter(np.float32(448.0 * 2.0**k), np.float32(np.inf))  # just above -> 2^(k+1)
    qt, _ = check(device, x, SM.MXFP8_1D_SCALING, E4M3, layout="rowwise")
    b = bits(qt.scale_inv).astype(int)
    for r, k in enumerate([-3, 0, 5, 20]):
        assert b[r, 0] == 127 + k and b[r, 1] == 128 + k
        assert bits(qt.data)[r, 0] == 0x7E  # fmax, not saturated past it
    # no block ever saturates: |decode| <= fmax
    assert np.all(np.abs(O.decode(bits(qt.data), O.E4M3)) <= 448)


# ---------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,rht",
    [(SM.NVFP4_1D_SCALING, False), (SM.NVFP4_1D_SCALING, True), (SM.NVFP4_2D_SCALING, False)],
    ids=["1D", "1D-rht", "2D"],
)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
def test_stochastic_bitexact(device, rng, mode, in_dtype, rht):
    x = make_x(rng, pick(rng, SHAPES[mode]), in_dtype)
    key = jax.random.key(int(rng.integers(1 << 31)))
    qt, _ = check(device, x, mode, E2M1, layout="both", key=key, rht=rht)
    # Rowwise codes differ from round-to-nearest somewhere; 2-D colwise is not the transpose.
    rne, _ = q_run(device, x, mode, E2M1, layout="both", rht=rht)
    assert np.any(bits(qt.data) != bits(rne.data))
    assert_bits(qt.scale_inv, rne.scale_inv, "SR does not change the scales")
    if mode == SM.NVFP4_2D_SCALING:
        assert np.any(bits(qt.colwise_data) != bits(qt.data).T)


def test_stochastic_keys(device, rng):
    x = make_x(rng, (32, 64), F32)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a, _ = q_run(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", key=k1)
    b, _ = q_run(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", key=k1)
    c, _ = q_run(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", key=k2)
    assert_same_tree(a, b, "same key")
    diff = np.mean(bits(a.data) != bits(c.data))
    assert diff > 0.05, f"different keys changed only {diff:.3%} of the codes"
    assert np.mean(bits(a.colwise_data) != bits(c.colwise_data)) > 0.05


def test_stochastic_unbiased(device, rng):
    """Mean over many keys of the decoded codes equals w = v * f (per element within a binomial
    bound; aggregated within 5 sigma); elements already on the grid never move."""
    N = 256
    x = make_x(rng, (32, 64), F32, spread=2)
    x[0, :16] = np.array([6, 0.5, 1, 1.5, 2, 3, 4, -4, -0.5, 0, 0, 0, 0, 0, 0, 0], np.float32)  # on the grid
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), N)

    def f(x, keys):
        qs = jax.vmap(lambda k: lowbit.quantize(x, SM.NVFP4_1D_SCALING, layout="both", rng_key=k))(keys)
        return qs.data, qs.colwise_data

    rw, cw = to_cpu(run_on(device, f, jnp.asarray(x), keys))
    # vmapped keys are bit-exact too
    for i in range(3):
        r = oracle_q(x, SM.NVFP4_1D_SCALING, E2M1, layout="both", key=keys[i])
        assert_bits(bits(rw[i]), r.data, f"vmapped key {i} rowwise")
        assert_bits(bits(cw[i]), r.colwise_data, f"vmapped key {i} colwise")
    v = x.astype(np.float32)
    for codes, vv in ((rw, v), (cw, np.ascontiguousarray(v.T))):
        w = O.nvfp4_w(vv).astype(np.float64)
        w = np.clip(w, -6.0, 6.0)  # |w| can exceed 6 slightly (E4M3 block scale rounded down): saturates
        dec = O.decode(bits(codes), O.E2M1).reshape(N, *vv.shape)
        mean = dec.mean(axis=0)
        grid = O.e2m1_grid()
        a = np.abs(w)
        k = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 6)
        lo, hi = np.where(a >= 6, 6.0, grid[k]), grid[k + 1]
        p = np.where(a >= 6, 0.0, (a - lo) / np.where(hi > lo, hi - lo, 1.0))
        var = (hi - lo) ** 2 * p * (1 - p)
        # exact grid values never move
        on_grid = p == 0
        assert np.all(dec[:, on_grid] == w[on_grid]), "SR moved a value that is on the grid"
        # per element: count of 'hi' draws within 8 sigma (+3) of N p
        n_hi = np.round(np.abs(mean - np.sign(w) * lo) / np.where(hi > lo, hi - lo, 1) * N)
        assert np.all(np.abs(n_hi - N * p) <= 8 * np.sqrt(N * p * (1 - p)) + 3)
        # aggregated: total deviation over all elements ~ N(0, 1)
        z = np.sum((mean - w)[~on_grid]) / np.sqrt(np.sum(var[~on_grid]) / N)
        assert abs(z) < 5, z
        # within each grid interval too
        for kk in range(7):
            sel = (k == kk) & ~on_grid & (a < 6)
            if sel.sum() > 20:
                zk = np.sum(np.abs(mean[sel]) - a[sel]) / np.sqrt(np.sum(var[sel]) / N)
                assert abs(zk) < 5, (kk, zk)
        # and SR is much closer in expectation than round-to-nearest
        rne = O.decode(O.encode(w.astype(np.float32), O.E2M1), O.E2M1)
        assert np.abs(np.mean(mean - w)) <= np.abs(np.mean(rne - w)) + 3 * np.sqrt(np.sum(var)) / (
            N**0.5 * w.size
        )


# ---------------------------------------------------------------------------------------------
# random Hadamard transform
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0xA759, 0x0000, 0xFFFF, 0x1234], ids=hex)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
def test_rht_bitexact(device, rng, in_dtype, mask):
    x = make_x(rng, pick(rng, [(64, 64), (128, 48), (32, 256)]), in_dtype)
    qt, r = check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", rht=True, rht_sign_mask=mask)
    assert qt.rht and qt.rht_sign_mask == mask
    # rowwise copy is untouched by rht
    plain, _ = q_run(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="rowwise")
    assert_bits(qt.data, plain.data, "rowwise copy unchanged by rht")
    # dequantize(colwise) inverts the transform: bit-exact vs the oracle, and close to x
    got = to_cpu(run_on(device, lambda q: lowbit.dequantize(q, "colwise", dtype=F32), qt))
    want = O.dequantize(
        r,
        int(SM.NVFP4_1D_SCALING),
        E2M1,
        x.shape,
        layout="colwise",
        out_dtype=np.float32,
        rht=True,
        rht_sign_mask=mask,
    )
    assert_bits(got, want, "rht dequantize")
    x64 = x.astype(np.float64)
    rel = np.linalg.norm(got - x64) / np.linalg.norm(x64)
    assert rel < 0.15, rel
    # an NVFP4 error bound per 16-block of the transformed copy (H/4 is orthogonal, so the error
    # norm of a block is that of its quantization error: <= 1/4 of the block amax per element,
    # plus the E4M3 rounding of the block scale)
    vh = r.prequant_colwise.astype(np.float64)  # (C, R), transformed
    err = (got.reshape(-1, x.shape[-1]).T - x64.reshape(-1, x.shape[-1]).T).reshape(vh.shape[0], -1, 16)
    amax_b = np.abs(vh.reshape(vh.shape[0], -1, 16)).max(axis=-1)
    assert np.all(np.linalg.norm(err, axis=-1) <= 4 * amax_b * 0.3 + 1e-6)


def test_hadamard_orthogonal():
    """The transform of the spec is (H/4) D: orthogonal, self-inverse up to the signs, and the
    oracle's butterflies equal the matrix product."""
    rng = np.random.default_rng(7)
    for mask in (0xA759, 0, 0xFFFF, int(rng.integers(1 << 16))):
        M = O.hadamard_matrix(mask)
        assert np.allclose(M @ M.T, np.eye(16), atol=1e-15)
        v = rng.standard_normal((8, 64)).astype(np.float32)
        h = O.hadamard(v, mask)
        ref = (v.astype(np.float64).reshape(8, 4, 16) @ M.T).reshape(8, 64)
        assert np.allclose(h, ref, rtol=1e-6, atol=1e-6)
        assert np.allclose(O.inverse_hadamard(h, mask), v, rtol=1e-6, atol=1e-6)
        # norms preserved per block
        assert np.allclose(
            np.linalg.norm(h.reshape(-1, 16), axis=1), np.linalg.norm(v.reshape(-1, 16), axis=1), rtol=1e-6
        )
        # powers of two: exact integer arithmetic end to end
        vi = rng.integers(-8, 9, (4, 16)).astype(np.float32)
        assert np.array_equal(O.inverse_hadamard(O.hadamard(vi, mask), mask), vi)


def test_rht_gemm_invariance(device, rng):
    """Two colwise copies transformed with the same mask give ~the same wgrad GEMM (contracting
    over R) as the untransformed operands; the transformed-domain values are reached by
    dequantizing with rht=False."""
    R = 128
    xa = make_x(rng, (R, 32), F32, spread=1)
    xb = make_x(rng, (R, 48), F32, spread=1)
    qa, ra = check(device, xa, SM.NVFP4_1D_SCALING, E2M1, layout="colwise", rht=True)
    qb, rb = check(device, xb, SM.NVFP4_1D_SCALING, E2M1, layout="colwise", rht=True)
    ha = np.asarray(lowbit.dequantize(dataclasses.replace(qa, rht=False), "colwise"), np.float64)  # (R, 32)
    hb = np.asarray(lowbit.dequantize(dataclasses.replace(qb, rht=False), "colwise"), np.float64)
    # transformed domain == oracle's Hadamard of x.T (within NVFP4 error)
    hx = O.hadamard(np.ascontiguousarray(xa.T), 0xA759).T.astype(np.float64)
    assert np.linalg.norm(ha - hx) / np.linalg.norm(hx) < 0.15
    exact = xa.T.astype(np.float64) @ xb.astype(np.float64)
    hexact = hx.T @ O.hadamard(np.ascontiguousarray(xb.T), 0xA759).T.astype(np.float64)
    assert np.allclose(hexact, exact, rtol=1e-4, atol=1e-3 * np.abs(exact).max())
    got = ha.T @ hb
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.2


# ---------------------------------------------------------------------------------------------
# dbias
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dt_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_dbias(device, rng, combo, in_dtype):
    mode, q_dtype = combo
    shape = (32, 2, 64) if mode != SM.NVFP4_2D_SCALING else (16, 2, 32)
    x = make_x(rng, shape, in_dtype, spread=2)
    kw = kw_for(mode, rng, x, q_dtype)
    axis = pick(rng, [1, 2])
    qt, db = q_run(device, x, mode, q_dtype, layout="both", dbias=True, flatten_axis=axis, **kw)
    plain, _ = q_run(device, x, mode, q_dtype, layout="both", flatten_axis=axis, **kw)
    assert_same_tree(qt, plain, "quantize_dbias vs quantize")
    x2 = x.reshape(int(np.prod(shape[:axis])), -1).astype(np.float64)
    ref = x2.sum(axis=0)
    assert db.shape == (x2.shape[1],) and db.dtype == np.dtype(in_dtype)
    eps = {np.dtype(F32): 2.0**-24, np.dtype(BF16): 2.0**-8, np.dtype(F16): 2.0**-11}[np.dtype(in_dtype)]
    tol = eps * np.abs(ref) + x2.shape[0] * 2.0**-23 * np.abs(x2).sum(axis=0) + 1e-30
    err = np.abs(db.astype(np.float64) - ref)
    assert np.all(err <= tol), (err.max(), tol[np.argmax(err)])
    if is_gpu(device):
        _, dbc = q_run(cpu_device(), x, mode, q_dtype, layout="both", dbias=True, flatten_axis=axis, **kw)
        assert np.allclose(db.astype(np.float64), dbc.astype(np.float64), rtol=4 * eps, atol=float(tol.max()))


def test_dbias_no_scaling_and_sr(device, rng):
    x = make_x(rng, (48, 32), BF16)
    _, db = q_run(device, x, SM.NO_SCALING, dbias=True, layout="rowwise")
    ref = x.astype(np.float64).sum(axis=0)
    assert np.allclose(db.astype(np.float64), ref, rtol=2**-7, atol=1e-3)
    qt, db2 = q_run(
        device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both", dbias=True, key=jax.random.key(3), rht=True
    )
    assert np.allclose(db2.astype(np.float64), ref, rtol=2**-7, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# jit / vmap / grad
# ---------------------------------------------------------------------------------------------
def test_eager_equals_jit(device, rng):
    x = make_x(rng, (64, 64), BF16)
    for mode, q_dtype in COMBOS:
        kw = kw_for(mode, rng, x, q_dtype)
        eager = to_cpu(lowbit.quantize(jax.device_put(x, device), mode, q_dtype, layout="both", **kw))
        jitted, _ = q_run(device, x, mode, q_dtype, layout="both", **kw)
        assert_same_tree(eager, jitted, f"eager vs jit {mode.name}")


@pytest.mark.parametrize("combo", [COMBOS[2], COMBOS[4], COMBOS[6], COMBOS[7]], ids=combo_id)
def test_vmap_per_example(device, rng, combo):
    mode, q_dtype = combo
    B = 3
    xs = np.stack([make_x(rng, (32, 64), F32) * 10.0**i for i in range(B)])

    def f(xs):
        qs = jax.vmap(lambda x: lowbit.quantize(x, mode, q_dtype, layout="both"))(xs)
        return qs, jax.vmap(lambda q: lowbit.dequantize(q, "colwise"))(qs)

    qs, deq = to_cpu(run_on(device, f, jnp.asarray(xs)))
    for b in range(B):
        r = O.quantize(xs[b], int(mode), q_dtype, layout="both")
        assert_bits(bits(qs.data[b]), r.data, f"example {b} data")
        assert_bits(bits(qs.colwise_data[b]), r.colwise_data, f"example {b} colwise")
        assert_bits(bits(qs.scale_inv[b]), bits(r.scale_inv), f"example {b} scale_inv")
        assert_bits(qs.amax[b], r.amax, f"example {b} amax")
        if r.global_scale_inv is not None:
            assert_bits(qs.global_scale_inv[b], r.global_scale_inv, f"example {b} global_scale_inv")
        want = O.dequantize(r, int(mode), q_dtype, xs[b].shape, layout="colwise")
        assert_bits(deq[b], want, f"example {b} dequantize")


@pytest.mark.parametrize("layout", ["rowwise", "colwise"])
@pytest.mark.parametrize("mode", [SM.DELAYED_TENSOR_SCALING, SM.CURRENT_TENSOR_SCALING], ids=lambda m: m.name)
def test_grad_dequantize_scale_inv(device, rng, mode, layout):
    """d/d scale_inv of sum(g * dequantize(q)) == sum(g * decode(q))."""
    x = make_x(rng, (32, 48), F32)
    g = rng.standard_normal((32, 48)).astype(np.float32)
    kw = kw_for(mode, rng, x, E4M3)
    qt, r = check(device, x, mode, E4M3, layout="both", **kw)

    def loss(s, g, qt):
        return jnp.sum(
            g * lowbit.dequantize(dataclasses.replace(qt, scale_inv=s, colwise_scale_inv=s), layout)
        )

    qt_dev = jax.device_put(jax.tree_util.tree_map(jnp.asarray, qt), device)
    grad = to_cpu(run_on(device, jax.grad(loss), jnp.asarray(qt.scale_inv), jnp.asarray(g), qt_dev))
    codes = r.data if layout == "rowwise" else r.colwise_data.T
    want = np.sum(g.astype(np.float64) * O.decode(codes, O.E4M3))
    assert grad.shape == (1,) and grad.dtype == np.float32
    assert np.allclose(grad[0], want, rtol=1e-5, atol=1e-5 * np.sum(np.abs(g)))
    # and the value gradient is linear: d/dg is dequantize itself
    dg = to_cpu(run_on(device, jax.grad(loss, argnums=1), jnp.asarray(qt.scale_inv), jnp.asarray(g), qt_dev))
    assert_bits(dg, np.asarray(lowbit.dequantize(qt_dev, layout)), "d/dg")


# ---------------------------------------------------------------------------------------------
# grouped quantize
# ---------------------------------------------------------------------------------------------
GROUP_CASES = {
    "regular": [16, 8, 24, 16],
    "empty_middle": [20, 0, 44],
    "empty_first_last": [0, 32, 32, 0],
    "sum_lt_M": [10, 20, 5],
    "G1": [64],
    "G1_partial": [40],
    "all_empty": [0, 0, 0],
    "negative": [16, -5, 30],
    "sum_gt_M": [30, 20, 40],
    "past_M": [40, 30, 10],
    "G16": [8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 4, 0, 4, 8],
}
GROUPED_COMBOS = [c for c in COMBOS if c[0] in (SM.DELAYED_TENSOR_SCALING, SM.CURRENT_TENSOR_SCALING)] + [
    (SM.MXFP8_1D_SCALING, E4M3),
    (SM.MXFP8_1D_SCALING, E5M2),
]


def _grouped_fn(x, sizes_in, scale, *, mode, q_dtype, layout):
    # Group sizes are computed on the device inside the jitted function.
    csum = jnp.cumsum(sizes_in)
    sizes = (csum - jnp.concatenate([jnp.zeros((1,), csum.dtype), csum[:-1]])).astype(jnp.int32)
    qt = lowbit.grouped_quantize(x, sizes, mode, q_dtype, scale=scale, layout=layout)
    dq = lowbit.grouped_dequantize(qt, sizes, layout="rowwise" if qt.data is not None else "colwise")
    return qt, dq


def _check_grouped(device, x, sizes, mode, q_dtype, layout, scale):
    qt, dq = to_cpu(
        run_on(
            device,
            _grouped_fn,
            jnp.asarray(x),
            jnp.asarray(sizes, jnp.int32),
            None if scale is None else jnp.asarray(scale),
            mode=mode,
            q_dtype=q_dtype,
            layout=layout,
        )
    )
    r = O.grouped_quantize(x, sizes, int(mode), q_dtype, scale=scale, layout=layout)
    G = len(sizes)
    assert_bits(qt.amax, r["amax"], "grouped amax")
    assert qt.amax.shape == (G,)
    grouped = r["grouped_rows"]
    if layout in ("rowwise", "both"):
        assert_bits(bits(qt.data), r["data"], "grouped rowwise data")
        if mode == SM.MXFP8_1D_SCALING:
            # Rows in no group: the spec only says their data is zero (scales unspecified).
            assert_bits(bits(qt.scale_inv)[grouped], r["scale_inv"][grouped], "grouped MXFP8 scale_inv")
        else:
            assert_bits(qt.scale_inv, r["scale_inv"], "grouped scale_inv")
    if layout in ("colwise", "both"):
        assert_bits(bits(qt.colwise_data), r["colwise_data"], "grouped colwise data")
        assert_bits(qt.colwise_scale_inv, r["colwise_scale_inv"], "grouped colwise scale_inv")
    # grouped_dequantize: per-row decode, zero outside the groups
    codes = r["data"] if "data" in r else r["colwise_data"].T
    fmt = O.fmt_of(q_dtype)
    if mode == SM.MXFP8_1D_SCALING:
        s = np.repeat(O.decode_e8m0(bits(qt.scale_inv)), 32, axis=1)
        want = O.mul32(O.decode(codes, fmt).astype(np.float32), s.astype(np.float32))
    else:
        row_si = np.zeros(x.shape[0], np.float32)
        for g, (s0, e0) in enumerate(r["bounds"]):
            row_si[s0:e0] = r["scale_inv"][g] if "scale_inv" in r else r["colwise_scale_inv"][g]
        want = O.mul32(O.decode(codes, fmt).astype(np.float32), row_si[:, None])
    want = np.where(grouped[:, None], want, np.float32(0)).astype(x.dtype)
    assert_bits(dq, want, "grouped_dequantize")
    return qt, r


@pytest.mark.parametrize("case", list(GROUP_CASES), ids=str)
@pytest.mark.parametrize(
    "combo",
    [
        c
        if c[0] == SM.MXFP8_1D_SCALING or c == (SM.DELAYED_TENSOR_SCALING, E4M3)
        else pytest.param(c, marks=pytest.mark.slow)
        for c in GROUPED_COMBOS
    ],
    ids=combo_id,
)
def test_grouped(device, rng, combo, case):
    mode, q_dtype = combo
    sizes = GROUP_CASES[case]
    layout = "rowwise" if mode == SM.MXFP8_1D_SCALING else pick(rng, LAYOUTS)
    x = make_x(rng, (64, 64), pick(rng, IN_DTYPES))
    # give groups very different magnitudes so per-group scaling matters
    x = (x.astype(np.float32) * np.repeat(2.0 ** rng.integers(-6, 7, 8), 8)[:, None]).astype(x.dtype)
    scale = None
    if mode == SM.DELAYED_TENSOR_SCALING:
        scale = (2.0 ** rng.uniform(-3, 6, len(sizes))).astype(np.float32)
    qt, r = _check_grouped(device, x, sizes, mode, q_dtype, layout, scale)
    for g, (s, e) in enumerate(r["bounds"]):
        if e == s:
            assert float(qt.amax[g]) == 0.0
            if mode == SM.CURRENT_TENSOR_SCALING:
                assert float((qt.scale_inv if qt.scale_inv is not None else qt.colwise_scale_inv)[g]) == 1.0
    if is_gpu(device):
        qc = to_cpu(
            run_on(
                cpu_device(),
                _grouped_fn,
                jnp.asarray(x),
                jnp.asarray(sizes, jnp.int32),
                None if scale is None else jnp.asarray(scale),
                mode=mode,
                q_dtype=q_dtype,
                layout=layout,
            )
        )[0]
        if mode == SM.MXFP8_1D_SCALING:
            qt = dataclasses.replace(qt, scale_inv=bits(qt.scale_inv)[r["grouped_rows"]])
            qc = dataclasses.replace(qc, scale_inv=bits(qc.scale_inv)[r["grouped_rows"]])
        assert_same_tree(qt, qc)


@pytest.mark.parametrize("combo", GROUPED_COMBOS, ids=combo_id)
def test_grouped_subnormal(device, rng, combo):
    """Groups of float32 subnormals (~1e-39, ~1e-40) next to a normal group: grouped_dequantize
    keeps them (docs/numerics.md: no flush to zero), bit for bit as the oracle and dequantize.
    The plain XLA product flushed them on the CPU (tracker issue 11, point 8)."""
    mode, q_dtype = combo
    layout = "rowwise" if mode == SM.MXFP8_1D_SCALING else "both"
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:24] *= np.float32(1e-39)
    x[24:40] *= np.float32(1e-40)
    scale = None
    if mode == SM.DELAYED_TENSOR_SCALING:
        scale = np.array([2.0**126, 2.0**127, 1.0], np.float32)
    sizes = [24, 16, 24]
    qt, r = _check_grouped(device, x, sizes, mode, q_dtype, layout, scale)
    sc = None if scale is None else jnp.asarray(scale)
    dq = to_cpu(
        run_on(
            device,
            _grouped_fn,
            jnp.asarray(x),
            jnp.asarray(sizes, jnp.int32),
            sc,
            mode=mode,
            q_dtype=q_dtype,
            layout=layout,
        )
    )[1]
    tiny = np.abs(x[:40]) > 0
    assert np.count_nonzero(dq[:40][tiny]) > 0.9 * tiny.sum()


def test_grouped_sizes_from_routing(device, rng):
    """MoE-style: group sizes from a bincount of expert ids, in the same jitted function."""
    M, K, G = 64, 32, 4
    x = make_x(rng, (M, K), BF16)
    expert = np.sort(rng.integers(0, G, M - 7)).astype(np.int32)  # 7 padding rows at the end

    def f(x, expert):
        sizes = jnp.bincount(expert, length=G).astype(jnp.int32)
        return lowbit.grouped_quantize(x, sizes, SM.CURRENT_TENSOR_SCALING, E4M3, layout="both")

    qt = to_cpu(run_on(device, f, jnp.asarray(x), jnp.asarray(expert)))
    sizes = np.bincount(expert, minlength=G)
    r = O.grouped_quantize(x, sizes, int(SM.CURRENT_TENSOR_SCALING), E4M3, layout="both")
    assert_bits(bits(qt.data), r["data"], "data")
    assert_bits(bits(qt.colwise_data), r["colwise_data"], "colwise")
    assert_bits(qt.scale_inv, r["scale_inv"], "scale_inv")
    assert np.all(bits(qt.data)[M - 7 :] == 0)
    # each group equals a plain quantize of its rows
    for g, (s, e) in enumerate(r["bounds"]):
        if e > s:
            single = O.quantize(x[s:e], int(SM.CURRENT_TENSOR_SCALING), E4M3)
            assert_bits(bits(qt.data)[s:e], single.data, f"group {g} == quantize of its rows")


# ---------------------------------------------------------------------------------------------
# targeted rounding-order tests (values built to land on format midpoints)
# ---------------------------------------------------------------------------------------------
def _e4m3_midpoints():
    grid = np.unique(np.abs(O.decode(np.arange(127), O.E4M3)))
    return (grid[:-1] + grid[1:]) / 2


def _near(v, k):
    """float32 v moved by k ulps."""
    v = np.float32(v)
    return np.float32(v + np.float32(k) * np.spacing(v))


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=dt_id)
@pytest.mark.parametrize("mode", [SM.DELAYED_TENSOR_SCALING, SM.CURRENT_TENSOR_SCALING], ids=lambda m: m.name)
def test_tensor_scale_product_at_midpoints(device, rng, mode, q_dtype):
    """x * scale (one float32 rounding, then enc) for x within a few ulps of midpoint / scale,
    half of them chosen where x / scale_inv would give another code."""
    fmt = O.fmt_of(q_dtype)
    grid = np.unique(np.abs(O.decode(np.arange(1 << 7), fmt)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    mids = mids[mids * 1.01 < fmt.max]
    for _ in range(50):
        A = np.float32(rng.uniform(1, 100))
        scale = (
            np.float32(rng.uniform(0.5, 3) * fmt.max / A)
            if mode == SM.DELAYED_TENSOR_SCALING
            else O.scale_from_amax(A, fmt.max)
        )
        cand = np.array([_near(m / scale, k) for m in rng.choice(mids, 3000) for k in (-1, 0, 1)], np.float32)
        cand = cand[cand < A]
        sep = O.encode(O.mul32(cand, scale), fmt) != O.encode(O.div32(cand, O.f32_recip(scale)), fmt)
        if sep.sum() >= 8:
            break
    else:
        pytest.fail("no separating values found")
    vals = np.concatenate([np.resize(cand[sep], 1024), rng.choice(cand[~sep], 1024)])
    vals = vals * np.where(rng.random(vals.size) < 0.5, -1, 1).astype(np.float32)
    x = rng.permutation(vals).reshape(32, 64).astype(np.float32)
    x[0, 0] = A  # the tensor amax (current scaling)
    kw = dict(scale=scale) if mode == SM.DELAYED_TENSOR_SCALING else {}
    check(device, x, mode, q_dtype, layout="rowwise", **kw)


@pytest.mark.parametrize("in_dtype", [F32, BF16], ids=dt_id)
def test_nvfp4_block_scale_at_midpoints(device, rng, in_dtype):
    """Block amaxes a placed so that (a / 6) * S lands within ulps of an E4M3 midpoint, half of
    them where a * (S / 6) would give another block scale: the spec divides first."""
    mids = _e4m3_midpoints()[10:]
    bf = np.dtype(in_dtype) == np.dtype(BF16)
    for _ in range(50):
        A = np.float32(rng.uniform(100, 1000))
        if bf:
            A = np.float32(np.float32(A).astype(BF16))
        S = O.scale_from_amax(A, 2688.0)
        cand = np.array([_near(6 * m / S, k) for m in mids for k in range(-3, 4)], np.float32)
        if bf:  # bf16 values around each target
            b = cand.astype(BF16).astype(np.float32)
            cand = np.concatenate(
                [
                    b,
                    np.nextafter(b.astype(BF16), BF16(np.inf)).astype(np.float32),
                    np.nextafter(b.astype(BF16), BF16(0)).astype(np.float32),
                ]
            )
        cand = np.unique(cand[(cand > 0) & (cand < A)])
        q1 = O.encode(O.mul32(O.div32(cand, np.float32(6)), S), O.E4M3)
        sep = q1 != O.encode(O.mul32(cand, O.div32(S, np.float32(6))), O.E4M3)
        if sep.sum() >= 4:
            break
    else:
        pytest.fail("no separating block amaxes found")
    amaxes = np.concatenate([np.resize(cand[sep], 256), rng.choice(cand[~sep], 256)])
    blocks = (rng.uniform(-1, 1, (amaxes.size, 16)) * amaxes[:, None]).astype(np.float32)
    blocks[np.arange(amaxes.size), rng.integers(0, 16, amaxes.size)] = amaxes * rng.choice(
        [-1, 1], amaxes.size
    )
    x = rng.permutation(blocks).reshape(64, 128)
    x[0, 0:16] = A
    x = x.astype(in_dtype)
    check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="rowwise")


def test_nvfp4_wide_range_tiny_block_scales(device, rng):
    """Blocks 1e-9..1e6 of the tensor amax: E4M3 block scales that are subnormal or round to 0
    (then f = 0 and the block encodes to +-0)."""
    x = make_x(rng, (64, 64), F32, spread=1)
    x = x * (10.0 ** rng.uniform(-9, 0, (64, 4, 1))).repeat(16, axis=2).reshape(64, 64).astype(np.float32)
    x[0, 0] = 1e6
    qt, r = check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="both")
    check(device, x, SM.NVFP4_2D_SCALING, E2M1, layout="both")
    sb = bits(qt.scale_inv)
    assert np.any(sb == 0) and np.any((sb & 0x78) == 0) and np.any(sb > 8), "want zero, subnormal, normal sb"
    zero_blocks = np.repeat(sb == 0, 16, axis=1)
    assert np.all(bits(qt.data)[zero_blocks] & 0x7 == 0)


def test_stochastic_threshold_is_strict(device, rng):
    """With S = 1 and block scale 1 (w = v), v = u * 2**-25 in [0, 0.5) makes p * 2**24 == u:
    the spec's strict ``float(u) < p * 2**24`` gives lo (0); one more step gives hi (0.5)."""
    key = jax.random.key(int(rng.integers(1 << 31)))
    s0, s1 = seed_words(key)
    R, C = 16, 64
    u = O.sr_uniform(R * C, s0, s1).reshape(R, C).astype(np.float64)
    x = (u * 2.0**-25).astype(np.float32)  # p * 2^24 == u exactly -> lo
    x[:, 1::2] = ((u[:, 1::2] + 1) * 2.0**-25).astype(np.float32)  # p * 2^24 == u + 1 -> hi (when < 0.5)
    x[:, 0::16] = 6.0  # block amax 6 -> sb = 1, f = 1
    x[1, 0:16] = 2688.0  # global amax -> S = 1
    x[1, 16] = 6.0
    qt, r = check(device, x, SM.NVFP4_1D_SCALING, E2M1, layout="rowwise", key=key)
    c = bits(qt.data)
    sel = np.ones((R, C), bool)
    sel[:, 0::16] = False
    sel[1] = False
    even, odd = sel.copy(), sel.copy()
    even[:, 1::2] = False
    odd[:, 0::2] = False
    assert np.all(c[even] == 0), "u == p * 2^24 must round down"
    fits = odd & ((u + 1) * 2.0**-25 < 0.5)
    assert np.all(c[fits] == 1), "u < p * 2^24 must round up"
