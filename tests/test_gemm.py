"""lowbit.gemm against float64 references.

Two references per case: the float64 product of the *decoded* operands (what the GEMM must
compute up to float32 accumulation: tight bound), and the float64 product of the unquantized
inputs (the quantization error: a bound per format). Every ``device`` test runs on the CPU and,
marked ``gpu``, on the first CUDA device (cuBLASLt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu
from helpers import rel

import lowbit

SM = lowbit.ScalingMode
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16 = jnp.float32, jnp.bfloat16


def decoded(qt, layout="rowwise"):
    """Float64 values of one copy of a per-tensor FP8 ScaledTensor, as the copy's 2-D matrix."""
    if layout == "rowwise":
        d, s = qt.data, qt.scale_inv
        shape = (qt.rows, qt.cols)
    else:
        d, s = qt.colwise_data, qt.colwise_scale_inv
        shape = (qt.cols, qt.rows)
    return np.asarray(d).astype(np.float64).reshape(shape) * float(np.asarray(s)[0])


def dq64(qt, layout):
    """Float64 of lowbit.dequantize (bit-exact per tests/test_quantize.py), as the copy's 2-D."""
    full = np.asarray(lowbit.dequantize(qt, layout, dtype=F32), np.float64).reshape(qt.rows, qt.cols)
    return full.T if layout == "colwise" else full


def tol(device, fast=False):
    # CPU: float32 accumulation. Hopper's FP8 tensor cores accumulate with fewer mantissa bits
    # between promotions (measured 1.2e-4 at K=128); fast accumulation promotes less often.
    return 5e-3 if fast else (5e-4 if is_gpu(device) else 1e-5)


# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(64, 96, 128), (37, 21, 50)])
def test_bf16(device, rng, out_dtype, shape):
    M, N, K = shape
    a = jnp.asarray(rng.standard_normal((M, K)), BF16)
    b = jnp.asarray(rng.standard_normal((N, K)), BF16)
    bias = jnp.asarray(rng.standard_normal(N), BF16)
    out = to_cpu(run_on(device, lambda a, b, c: lowbit.gemm(a, b, c, out_dtype=out_dtype), a, b, bias))
    assert out.dtype == np.dtype(out_dtype) and out.shape == (M, N)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T + np.asarray(bias, np.float64)
    assert rel(out, ref) < (tol(device) if out_dtype == F32 else 4e-3)


def test_bf16_leading_dims(device, rng):
    a = jnp.asarray(rng.standard_normal((2, 3, 40)), BF16)
    b = jnp.asarray(rng.standard_normal((5, 4, 40)), BF16)
    out = to_cpu(run_on(device, lambda a, b: lowbit.gemm(a, b, out_dtype=F32), a, b))
    assert out.shape == (2, 3, 5, 4)
    ref = np.einsum("ijk,lmk->ijlm", np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert rel(out, ref) < tol(device)


# ---------------------------------------------------------------------------------------------
# Per-tensor FP8
# ---------------------------------------------------------------------------------------------
FP8_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
# Relative error of the GEMM against the unquantized float64 product (Gaussian inputs).
FP8_BOUND = {np.dtype(E4M3): 0.06, np.dtype(E5M2): 0.12}


@pytest.mark.parametrize("qa,qb", FP8_PAIRS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize("bias_dtype", [None, BF16, F32])
@pytest.mark.parametrize("shape", [(64, 96, 128), (5, 7, 19)])  # the second needs padding
def test_fp8(device, rng, qa, qb, out_dtype, bias_dtype, shape):
    M, N, K = shape
    x = rng.standard_normal((M, K)).astype(np.float32) * 3
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.2
    bias = None if bias_dtype is None else jnp.asarray(rng.standard_normal(N), bias_dtype)

    def f(x, w, bias):
        a = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, qa)
        b = lowbit.quantize(w, SM.CURRENT_TENSOR_SCALING, qb)
        return lowbit.gemm(a, b, bias, out_dtype=out_dtype), a, b

    out, a, b = to_cpu(run_on(device, f, x, w, bias))
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    ref_q = decoded(a) @ decoded(b).T
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    if bias is not None:
        ref_q = ref_q + np.asarray(bias, np.float64)
        ref = ref + np.asarray(bias, np.float64)
    assert rel(out, ref_q) < (tol(device) if out_dtype == F32 else 4e-3)
    assert rel(out, ref) < max(FP8_BOUND[np.dtype(qa)], FP8_BOUND[np.dtype(qb)])


def test_fp8_delayed_and_current_mix(device, rng):
    x = rng.standard_normal((32, 48)).astype(np.float32)
    w = rng.standard_normal((16, 48)).astype(np.float32)

    def f(x, w):
        a = lowbit.quantize(x, SM.DELAYED_TENSOR_SCALING, E4M3, scale=jnp.float32(50.0))
        b = lowbit.quantize(w, SM.CURRENT_TENSOR_SCALING, E4M3)
        return lowbit.gemm(a, b, out_dtype=F32), a, b

    out, a, b = to_cpu(run_on(device, f, x, w))
    assert rel(out, decoded(a) @ decoded(b).T) < tol(device)


def test_fp8_colwise_copies(device, rng):
    """The wgrad pattern: both operands' colwise copies, contracting the tokens."""
    x = rng.standard_normal((2, 32, 48)).astype(np.float32)  # tokens (2, 32), K = 48
    dy = rng.standard_normal((2, 32, 24)).astype(np.float32)  # N = 24

    def f(x, dy):
        a = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, E4M3, layout="both", flatten_axis=2)
        b = lowbit.quantize(dy, SM.CURRENT_TENSOR_SCALING, E5M2, layout="both", flatten_axis=2)
        return lowbit.gemm(a, b, a_layout="colwise", b_layout="colwise", out_dtype=F32), a, b

    out, a, b = to_cpu(run_on(device, f, x, dy))
    assert out.shape == (48, 24)
    assert rel(out, decoded(a, "colwise") @ decoded(b, "colwise").T) < tol(device)
    ref = x.reshape(64, 48).astype(np.float64).T @ dy.reshape(64, 24).astype(np.float64)
    assert rel(out, ref) < 0.08


@pytest.mark.gpu
def test_fp8_fast_accum_gpu(gpu_device, rng):
    x = rng.standard_normal((256, 512)).astype(np.float32)
    w = rng.standard_normal((128, 512)).astype(np.float32)

    def f(x, w):
        a = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, E4M3)
        b = lowbit.quantize(w, SM.CURRENT_TENSOR_SCALING, E4M3)
        return lowbit.gemm(a, b, out_dtype=F32, fast_accum=True), a, b

    out, a, b = to_cpu(run_on(gpu_device, f, x, w))
    assert rel(out, decoded(a) @ decoded(b).T) < tol(gpu_device, fast=True)


@pytest.mark.gpu
def test_gpu_matches_cpu(gpu_device, rng):
    """Same quantized operands on both backends: results agree to float32 accumulation order."""
    from conftest import cpu_device

    x = rng.standard_normal((128, 256)).astype(np.float32)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    bias = jnp.asarray(rng.standard_normal(64), BF16)

    def f(x, w, bias):
        a = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, E4M3)
        b = lowbit.quantize(w, SM.CURRENT_TENSOR_SCALING, E5M2)
        return lowbit.gemm(a, b, bias, out_dtype=F32)

    g = to_cpu(run_on(gpu_device, f, x, w, bias))
    c = to_cpu(run_on(cpu_device(), f, x, w, bias))
    assert rel(g, c) < 1e-3


# ---------------------------------------------------------------------------------------------
# Block-scaled study path (MXFP8, NVFP4)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layouts", [("rowwise", "rowwise"), ("colwise", "colwise")])
def test_mxfp8(device, rng, layouts):
    la, lb = layouts
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((64 if la == "colwise" else 32, 96)).astype(np.float32)

    def f(x, w):
        a = lowbit.quantize(x, SM.MXFP8_1D_SCALING, E4M3, layout="both")
        b = lowbit.quantize(w, SM.MXFP8_1D_SCALING, E4M3, layout="both")
        return lowbit.gemm(a, b, a_layout=la, b_layout=lb, out_dtype=F32), a, b

    out, a, b = run_on(device, f, x, w)
    out = to_cpu(out)
    assert rel(out, dq64(a, la) @ dq64(b, lb).T) < tol(device)
    xa = x.astype(np.float64) if la == "rowwise" else x.astype(np.float64).T
    wb = w.astype(np.float64) if lb == "rowwise" else w.astype(np.float64).T
    assert rel(out, xa @ wb.T) < 0.04


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("mode_b", [SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING])
def test_nvfp4(device, rng, rht, mode_b):
    """Forward pattern (rowwise x rowwise, 2-D kernel blocks) and wgrad pattern (colwise copies
    with the Hadamard transform: both carry it, and it cancels in the product)."""
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    colwise = rht
    if rht and mode_b == SM.NVFP4_2D_SCALING:
        pytest.skip("2-D blocks take no Hadamard transform")
    lay = "colwise" if colwise else "rowwise"

    def f(x, w):
        a = lowbit.quantize(x, SM.NVFP4_1D_SCALING, layout="both", rht=rht)
        b = lowbit.quantize(w, mode_b, layout="both", rht=rht)
        return lowbit.gemm(a, b, a_layout=lay, b_layout=lay, out_dtype=F32), a, b

    out, a, b = run_on(device, f, x, w)
    out = to_cpu(out)
    assert rel(out, dq64(a, lay) @ dq64(b, lay).T) < 1e-4
    xa, wb = x.astype(np.float64), w.astype(np.float64)
    ref = xa.T @ wb if colwise else xa @ wb.T
    assert rel(out, ref) < 0.2


@pytest.mark.parametrize("mag", [1e-39, 1e-40])
@pytest.mark.parametrize(
    "mode", [SM.MXFP8_1D_SCALING, SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING], ids=lambda m: m.name
)
def test_block_scaled_subnormal(device, rng, mode, mag):
    """An operand below float32's normal range (tracker issue 11, point 8): the GEMM of the
    quantized operands must match their float64 product. The BF16 decode of the MXFP8 study path
    lost significand bits (subnormal BF16), and NVFP4's ga * gb underflowed to 0."""
    x = (rng.standard_normal((64, 96)) * mag).astype(np.float32)
    x[:, :32] *= 4.0  # mixed block magnitudes
    w = rng.standard_normal((32, 96)).astype(np.float32)
    w[:16] *= mag  # both operands tiny in part: products far below the float32 range are 0

    def f(x, w):
        a = lowbit.quantize(x, mode, layout="rowwise")
        b = lowbit.quantize(w, mode, layout="rowwise")
        return lowbit.gemm(a, b, out_dtype=F32), a, b

    out, a, b = run_on(device, f, x, w)
    out = to_cpu(out)
    ref = dq64(a, "rowwise") @ dq64(b, "rowwise").T
    # Columns 16..31: tiny x normal, outputs around float32's normal limit. Columns 0..15: tiny x
    # tiny, ~1e-78, below float32 entirely (0 is the float32 answer there).
    assert rel(out[:, 16:], ref[:, 16:]) < tol(device)
    assert np.count_nonzero(out[:, 16:]) > 0.9 * out[:, 16:].size


# ---------------------------------------------------------------------------------------------
# Edge cases and errors
# ---------------------------------------------------------------------------------------------
def test_empty_contraction_gives_bias():
    a = jnp.zeros((3, 0), BF16)
    b = jnp.zeros((4, 0), BF16)
    out = lowbit.gemm(a, b, jnp.arange(4, dtype=BF16), out_dtype=F32)
    np.testing.assert_array_equal(np.asarray(out), np.tile(np.arange(4, dtype=np.float32), (3, 1)))


def test_jit_is_deterministic(rng):
    a = jnp.asarray(rng.standard_normal((16, 32)), BF16)
    b = jnp.asarray(rng.standard_normal((8, 32)), BF16)
    f = jax.jit(lambda a, b: lowbit.gemm(a, b, out_dtype=F32))
    np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(f(a, b)))


def test_errors(rng):
    x = jnp.asarray(rng.standard_normal((8, 32)), F32)
    xb = x.astype(BF16)
    q4 = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, E4M3, layout="rowwise")
    q5 = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, E5M2)
    mx = lowbit.quantize(x, SM.MXFP8_1D_SCALING, E4M3)
    with pytest.raises(TypeError, match="bfloat16"):
        lowbit.gemm(x, xb)
    with pytest.raises(TypeError, match="bfloat16"):
        lowbit.gemm(xb, np.ones((4, 32), np.int32))
    with pytest.raises(ValueError, match="contraction sizes differ"):
        lowbit.gemm(xb, jnp.zeros((4, 16), BF16))
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        lowbit.gemm(q5, q5)
    with pytest.raises(TypeError, match="must both be"):
        lowbit.gemm(q4, xb)
    with pytest.raises(TypeError, match="must both be"):
        lowbit.gemm(q4, mx)
    with pytest.raises(ValueError, match="no colwise copy"):
        lowbit.gemm(q4, q4, a_layout="colwise")
    with pytest.raises(TypeError, match="out_dtype"):
        lowbit.gemm(xb, xb, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="bias must have N=8"):
        lowbit.gemm(xb, xb, jnp.zeros((3,), BF16))
    with pytest.raises(TypeError, match="bias must be"):
        lowbit.gemm(xb, xb, jnp.zeros((8,), jnp.int32))
    n_rht = lowbit.quantize(jnp.ones((32, 32)), SM.NVFP4_1D_SCALING, layout="both", rht=True)
    n_plain = lowbit.quantize(jnp.ones((32, 32)), SM.NVFP4_1D_SCALING, layout="both")
    with pytest.raises(ValueError, match="Hadamard"):
        lowbit.gemm(n_rht, n_plain, a_layout="colwise", b_layout="colwise")
    with pytest.raises(TypeError, match="same block-scaled format"):
        lowbit.gemm(lowbit.quantize(jnp.ones((32, 32)), SM.MXFP8_1D_SCALING), n_plain)
