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
from conftest import run_on, to_cpu
from test_grouped_gemm import bf16_values, ranges, recipe_fwd_bwd, ref_forward, ref_grads, rel, vjp_outputs
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
    # The decoded copies approximate x on the groups' rows (rows in no group decode to zero).
    fmt = O.fmt_of(q)
    xf = O.to_f32(x).astype(np.float64)
    covered = want["bounds"][-1][1]
    for layout in ("rowwise", "colwise"):
        dec = O.grouped_block1d_decode(want, K, fmt, layout)
        assert not np.any(dec[covered:])
        assert np.allclose(dec[:covered], xf[:covered], rtol=0.13, atol=float(np.abs(xf).max()) * 2**-6)


@pytest.mark.parametrize("name", ["uneven_empty", "long_groups", "sum_below"])
def test_grouped_dequantize_block1d(device, rng, name):
    M, K, sizes = GQ_CASES[name]
    x = make_x(rng, (M, K), BF16, spread=2.0)
    sizes = np.asarray(sizes, np.int32)

    def f(x, s):
        qt = lowbit.grouped_quantize(x, s, SM.BLOCK_1D_SCALING, E4M3, layout="both")
        return tuple(lowbit.grouped_dequantize(qt, s, layout, dtype=F32) for layout in ("rowwise", "colwise"))

    got = to_cpu(run_on(device, f, jnp.asarray(x), jnp.asarray(sizes)))
    want = O.grouped_quantize_block1d(x, sizes, E4M3)
    for g, layout in zip(got, ("rowwise", "colwise")):
        ref = O.grouped_block1d_decode(want, K, O.E4M3, layout).astype(np.float32)
        assert_bits(np.asarray(g), ref, layout)


def test_grouped_quantize_block1d_rowwise_only_and_errors(rng):
    x = jnp.asarray(make_x(rng, (20, 40), BF16))
    s = jnp.asarray([5, 15], jnp.int32)
    qt = lowbit.grouped_quantize(x, s, SM.BLOCK_1D_SCALING, E4M3)
    assert qt.colwise_data is None and qt.scale_inv.shape == (20,)
    with pytest.raises(ValueError, match="BLOCK_1D_SCALING for grouped_quantize"):
        lowbit.grouped_quantize(x, s, SM.BLOCK_2D_SCALING, E4M3)
    with pytest.raises(ValueError, match="power_2_scale and amax_epsilon"):
        lowbit.grouped_quantize(x, s, SM.CURRENT_TENSOR_SCALING, E4M3, power_2_scale=True)


# ---- grouped GEMM ------------------------------------------------------------------------------
BLOCK_RECIPES = {
    "w2d": lowbit.Float8BlockScaling(),
    "w2d_hybrid_f32": lowbit.Float8BlockScaling(fp8_format=lowbit.Format.HYBRID, use_f32_scales=True),
    "w1d": lowbit.Float8BlockScaling(w_block_scaling_dim=1),
}
# (M, K, N, sizes): uneven with an empty group, groups past one 128-token block (the weight
# gradient's blocks restart at each group), sums below / above M, K / N not multiples of 16.
GEMM_CASES = {
    "uneven_with_empty": (64, 32, 48, [20, 0, 30, 14]),
    "long_groups": (400, 160, 144, [0, 200, 131, 1, 0, 60]),
    "sum_below_M": (64, 32, 32, [10, 20, 5]),
    "sum_above_M": (64, 32, 32, [30, 30, 30]),
    "K_N_not_multiples": (50, 37, 45, [17, 0, 33]),
}


@pytest.mark.parametrize(
    "recipe_name",
    [pytest.param(r, marks=pytest.mark.slow) if r == "w2d_hybrid_f32" else r for r in BLOCK_RECIPES],
)
@pytest.mark.parametrize("name", list(GEMM_CASES))
def test_block_forward_and_grads_vs_float64(device, rng, recipe_name, name):
    recipe = BLOCK_RECIPES[recipe_name]
    M, K, N, sizes = GEMM_CASES[name]
    sizes = np.asarray(sizes, np.int32)
    G = len(sizes)
    lhs, rhs, dout, y, dl, dr = recipe_fwd_bwd(device, rng, recipe, M, K, N, sizes)
    assert y.shape == (M, N) and y.dtype == np.dtype(BF16) and dr.shape == (G, K, N)
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    e5m2_grads = recipe.fp8_format == lowbit.Format.HYBRID
    # The FP8 recipes' tolerances of tests/test_grouped_gemm.py (block scales are finer).
    assert rel(y, ref) < 0.06
    assert rel(dl, rdl) < (0.12 if e5m2_grads else 0.06)
    assert rel(dr, rdr) < (0.12 if e5m2_grads else 0.06)
    covered = sum(s for _, s in ranges(sizes, M))
    assert not np.any(np.asarray(y, np.float32)[covered:])
    assert not np.any(np.asarray(dl, np.float32)[covered:])
    for g, (_, s) in enumerate(ranges(sizes, M)):
        if s == 0:
            assert not np.any(np.asarray(dr[g], np.float32))


def check_vs_decoded_operands(lhs, rhs, dout, sizes, y, dl, dr, grad_dtype=E4M3):
    """y, dlhs and drhs against the float64 products of the operands as the recipe quantizes
    them (1x128 x, gradient in ``grad_dtype``; 128x128 weights), decoded with their block scales
    by the oracle: one bfloat16 rounding and float32 sums in another order apart."""
    K, N, G = lhs.shape[1], dout.shape[1], len(sizes)
    gfmt = O.E5M2 if np.dtype(grad_dtype) == np.dtype(E5M2) else O.E4M3
    qx = O.grouped_quantize_block1d(lhs, sizes, E4M3)
    qg = O.grouped_quantize_block1d(dout, sizes, grad_dtype)
    xq = O.grouped_block1d_decode(qx, K, O.E4M3, "rowwise")
    rq = O.quantize(rhs.reshape(G * K, N), O.BLOCK_2D, E4M3, layout="both")
    wq = O.dequantize_copy(rq.data, rq.scale_inv, O.BLOCK_2D, O.E4M3).astype(np.float64).reshape(G, K, N)
    tol = 1e-2
    assert rel(y, ref_forward(xq, wq, sizes)) < tol
    g_r = O.grouped_block1d_decode(qg, N, gfmt, "rowwise")
    assert rel(dl, ref_grads(xq, wq, sizes, g_r)[0]) < tol
    x_c = O.grouped_block1d_decode(qx, K, O.E4M3, "colwise")
    g_c = O.grouped_block1d_decode(qg, N, gfmt, "colwise")
    assert rel(dr, ref_grads(x_c, wq, sizes, g_c)[1]) < tol


@pytest.mark.parametrize("name", ["uneven_with_empty", "long_groups"])
def test_block_gemm_vs_decoded_operands(device, rng, name):
    """The GEMMs themselves, tightly: forward and both gradients against the float64 products
    of the operands as quantized."""
    recipe = lowbit.Float8BlockScaling(use_f32_scales=True)
    M, _, _, sizes = GEMM_CASES[name]
    K, N = 256, 144  # K a multiple of 128, N of 16: no padding
    sizes = np.asarray(sizes, np.int32)
    lhs, rhs, dout, y, dl, dr = recipe_fwd_bwd(device, rng, recipe, M, K, N, sizes)
    check_vs_decoded_operands(lhs, rhs, dout, sizes, y, dl, dr)


def test_block_inside_jit_and_ragged_dot_module(device, rng):
    recipe = lowbit.Float8BlockScaling()
    M, K, N, G = 96, 64, 32, 4
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.1)
    mod = make_ragged_dot_cls(recipe)()

    def f(a, b, counts):
        sizes = jnp.bincount(counts, length=G).astype(jnp.int32)  # computed on the device
        params = mod.init(jax.random.PRNGKey(0), a, b, sizes)
        return mod.apply(params, a, b, sizes), sizes

    counts = np.sort(rng.integers(0, G, size=M)).astype(np.int32)
    y, sizes = to_cpu(
        run_on(device, jax.jit(f), jnp.asarray(lhs, BF16), jnp.asarray(rhs, BF16), jnp.asarray(counts))
    )
    assert rel(y, ref_forward(lhs, rhs, np.asarray(sizes))) < 0.06


def test_block_errors(rng):
    x, w = jnp.zeros((8, 16), BF16), jnp.zeros((2, 16, 8), BF16)
    s = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="x_block_scaling_dim=2"):
        lowbit.grouped_gemm(
            x, w, s, recipe=lowbit.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
        )
    with pytest.raises(ValueError, match="state is only used with DelayedScaling"):
        lowbit.grouped_gemm(x, w, s, recipe=lowbit.Float8BlockScaling(), state={})


# ---- GPU: MoE-sized shapes -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["w2d", "w1d", "w2d_hybrid_f32"])
def test_gpu_block_medium_uneven(gpu_device, rng, recipe_name):
    recipe = BLOCK_RECIPES[recipe_name]
    G, M, K, N = 16, 4096, 512, 768
    w = rng.gamma(1.0, size=G)
    sizes = np.floor(w / w.sum() * (M - 100)).astype(np.int32)  # 100+ trailing rows in no group
    sizes[3] = 0
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.05)
    dout = bf16_values(rng, (M, N))
    f = lambda a, b, s, d: vjp_outputs(
        lambda a, b, s: lowbit.grouped_gemm(a, b, s, recipe=recipe), a, b, s, d
    )
    args = [jnp.asarray(a, BF16) for a in (lhs, rhs)] + [jnp.asarray(sizes), jnp.asarray(dout, BF16)]
    y, dl, dr = to_cpu(run_on(gpu_device, f, *args))
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    e5m2 = recipe.fp8_format == lowbit.Format.HYBRID
    assert (
        rel(y, ref) < 0.06
        and rel(dl, rdl) < (0.12 if e5m2 else 0.06)
        and rel(dr, rdr) < (0.12 if e5m2 else 0.06)
    )
    assert not np.any(np.asarray(y, np.float32)[int(sizes.sum()) :])
    assert not np.any(np.asarray(dr[3], np.float32))
    # The GPU kernels (CUTLASS) against the CPU reference kernel on the same inputs.
    yc, dlc, drc = to_cpu(run_on(jax.devices("cpu")[0], f, *args))
    assert rel(y, np.asarray(yc, np.float64)) < 1e-2
    assert rel(dl, np.asarray(dlc, np.float64)) < 1e-2
    assert rel(dr, np.asarray(drc, np.float64)) < 1e-2
