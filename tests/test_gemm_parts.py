"""lowbit.gemm(parts=n): the product's n column blocks written as n arrays in place (the fused
QKV projection's q, k and v), against the float64 product of the decoded operands and against
slices of the whole GEMM; shapes the in-place path cannot take fall back to slicing; errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu

import lowbit
from lowbit import _native
from lowbit._native import EMPTY_F32

SM = lowbit.ScalingMode
F32, BF16 = jnp.float32, jnp.bfloat16


def _operands(rng, M, N, K, kind, bias_dtype):
    x = rng.standard_normal((M, K)).astype(np.float32) * 2
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.3
    b = None if bias_dtype is None else jnp.asarray(rng.standard_normal(N), bias_dtype)
    if kind == "bf16":
        return jnp.asarray(x, BF16), jnp.asarray(w, BF16), b
    a = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn)
    return a, lowbit.quantize(w, SM.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn), b


def _f64(op):
    """Float64 values of a BF16 array or of a per-tensor FP8 ScaledTensor's rowwise copy."""
    if isinstance(op, lowbit.ScaledTensor):
        return np.asarray(op.data).astype(np.float64) * float(np.asarray(op.scale_inv)[0])
    return np.asarray(op, np.float64)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("bias_dtype", [None, BF16, F32], ids=["nobias", "bf16bias", "f32bias"])
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("parts", [2, 3])
def test_parts_are_the_column_blocks(device, rng, kind, bias_dtype, out_dtype, parts):
    M, K, w = 48, 64, 32
    a, b, bias = _operands(rng, M, parts * w, K, kind, bias_dtype)

    def f(a, b, bias):
        return lowbit.gemm(a, b, bias, out_dtype=out_dtype, parts=parts), lowbit.gemm(
            a, b, bias, out_dtype=out_dtype
        )

    got, whole = to_cpu(run_on(device, f, a, b, bias))
    ref = _f64(a) @ _f64(b).T + (0 if bias is None else np.asarray(bias, np.float64))
    assert isinstance(got, tuple) and len(got) == parts
    for i, g in enumerate(got):
        assert g.shape == (M, w) and g.dtype == np.dtype(out_dtype)
        block = ref[:, i * w : (i + 1) * w]
        err = np.linalg.norm(np.asarray(g, np.float64) - block) / np.linalg.norm(block)
        assert err < (4e-3 if out_dtype == BF16 else 1e-5 if not is_gpu(device) else 5e-4), (i, err)
        if not is_gpu(device):  # the CPU kernel computes each element the same way in both calls
            np.testing.assert_array_equal(np.asarray(g), np.asarray(whole)[:, i * w : (i + 1) * w])


def test_parts_are_written_in_place(on_cpu, rng):
    """Per-tensor FP8 blocks of 16-multiples: one GEMM call with n results and no slice of the
    product in the lowered program (the copies this path removes)."""
    a, b, bias = _operands(rng, 32, 3 * 32, 64, "fp8", BF16)
    text = jax.jit(lambda a, b, bias: lowbit.gemm(a, b, bias, parts=3)).lower(a, b, bias).as_text()
    calls = re.findall(r"@lowbit_gemm\(.*?\) \{.*?\} : \(.*?\) -> \((.*?)\)", text)
    assert len(calls) == 1 and calls[0].count("tensor<32x32xbf16>") == 3, calls
    assert "stablehlo.slice" not in text


@pytest.mark.parametrize(
    "M,N,K,kind,parts",
    [(16, 3 * 24, 32, "fp8", 3), (7, 30, 19, "fp8", 2), (9, 12, 5, "bf16", 3)],
    ids=["fp8-blocks-of-24", "fp8-padded", "bf16-odd"],
)
def test_parts_fall_back_to_slices(on_cpu, rng, M, N, K, kind, parts):
    """Blocks cuBLASLt's FP8 alignment cannot take in place (24 wide, padded operands) are slices
    of the whole product: the same values."""
    a, b, bias = _operands(rng, M, N, K, kind, BF16)
    got = lowbit.gemm(a, b, bias, parts=parts)
    whole = np.asarray(lowbit.gemm(a, b, bias))
    w = N // parts
    for i, g in enumerate(got):
        np.testing.assert_array_equal(np.asarray(g), whole[:, i * w : (i + 1) * w])


def test_parts_of_block_scaled_operands_are_slices(on_cpu, rng):
    x = jnp.asarray(rng.standard_normal((32, 128)), BF16)
    w = jnp.asarray(rng.standard_normal((64, 128)), BF16)
    a = lowbit.quantize(x, SM.BLOCK_1D_SCALING)
    b = lowbit.quantize(w, SM.BLOCK_1D_SCALING)
    got = lowbit.gemm(a, b, parts=2)
    whole = np.asarray(lowbit.gemm(a, b))
    np.testing.assert_array_equal(np.asarray(got[1]), whole[:, 32:])


@pytest.mark.parametrize("bias_dtype", [None, BF16], ids=["nobias", "bf16bias"])
@pytest.mark.parametrize("parts", [2, 3])
def test_block_scaled_parts_are_the_column_blocks(device, rng, bias_dtype, parts):
    """Float8BlockScaling's fused QKV forward: x 1x128, the kernel 128x128 with blocks of whole
    128-row bands. The blocks equal the float64 product of the decoded operands and (CPU, where
    each element is computed the same way in both calls) the whole GEMM's columns bit for bit."""
    M, K, w = 48, 256, 128
    x = rng.standard_normal((M, K)).astype(np.float32) * 2
    k = rng.standard_normal((parts * w, K)).astype(np.float32) * 0.3
    bias = None if bias_dtype is None else jnp.asarray(rng.standard_normal(parts * w), bias_dtype)

    def f(x, k, bias):
        a = lowbit.quantize(x, SM.BLOCK_1D_SCALING, layout="rowwise")
        b = lowbit.quantize(k, SM.BLOCK_2D_SCALING, layout="rowwise")
        deq = lowbit.dequantize(a, dtype=F32), lowbit.dequantize(b, dtype=F32)
        return lowbit.gemm(a, b, bias, parts=parts), lowbit.gemm(a, b, bias), deq

    got, whole, (xa, kb) = to_cpu(run_on(device, f, jnp.asarray(x, BF16), jnp.asarray(k, BF16), bias))
    ref = np.asarray(xa, np.float64) @ np.asarray(kb, np.float64).T
    ref = ref + (0 if bias is None else np.asarray(bias, np.float64))
    assert isinstance(got, tuple) and len(got) == parts
    for i, g in enumerate(got):
        block = ref[:, i * w : (i + 1) * w]
        assert g.shape == (M, w)
        err = np.linalg.norm(np.asarray(g, np.float64) - block) / np.linalg.norm(block)
        assert err < 4e-3, (i, err)
        if not is_gpu(device):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(whole)[:, i * w : (i + 1) * w])


def test_block_scaled_parts_are_written_in_place(on_cpu, rng):
    """A 128x128-scaled kernel split into 128-row multiples: one GEMM call with n results and no
    slice of the product (the three slice kernels of the block layer's QKV forward, 0.12 ms on
    the H200, gone); a 1x128-scaled kernel still slices the whole product."""
    x = lowbit.quantize(
        jnp.asarray(rng.standard_normal((32, 256)), BF16), SM.BLOCK_1D_SCALING, layout="rowwise"
    )
    k = jnp.asarray(rng.standard_normal((3 * 128, 256)), BF16)
    bias = jnp.zeros((3 * 128,), BF16)
    for mode, in_place in ((SM.BLOCK_2D_SCALING, True), (SM.BLOCK_1D_SCALING, False)):
        b = lowbit.quantize(k, mode, layout="rowwise")
        text = jax.jit(lambda a, b, bias: lowbit.gemm(a, b, bias, parts=3)).lower(x, b, bias).as_text()
        calls = re.findall(r"@lowbit_gemm\(.*?\) \{.*?\} : \(.*?\) -> \((.*?)\)", text)
        assert len(calls) == 1, calls
        assert (calls[0].count("tensor<32x128xbf16>") == 3) == in_place, (mode, calls)
        assert ("stablehlo.slice" not in text) == in_place, mode


def test_parts_errors(on_cpu):
    a = jnp.ones((4, 16), BF16)
    b = jnp.ones((12, 16), BF16)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"gemm: parts must be a positive int dividing N=12"):
            lowbit.gemm(a, b, parts=bad)


def test_ffi_rejects_mismatched_split_outputs(on_cpu):
    """The handler itself refuses outputs that are not (M, N / n) of one dtype (a misuse of the
    FFI target, past the Python checks): an error, not a write out of bounds."""
    a = jnp.ones((4, 16), BF16)
    b = jnp.ones((12, 16), BF16)

    def call(*outs):
        return _native.ffi_call(
            "gemm", outs, a, b, EMPTY_F32, EMPTY_F32, EMPTY_F32, workspace=(), flags=np.int32(0)
        )

    with pytest.raises(Exception, match=r"each of the n outputs must be \(M, N / n\)"):
        call(jax.ShapeDtypeStruct((4, 5), BF16), jax.ShapeDtypeStruct((4, 5), BF16))
    for second in (jax.ShapeDtypeStruct((4, 4), BF16), jax.ShapeDtypeStruct((4, 6), F32)):
        with pytest.raises(Exception, match=r"every split output must be \(M, N / n\) of one dtype"):
            call(jax.ShapeDtypeStruct((4, 6), BF16), second)
