"""lowbit.gemm with FP8 block-scaled operands (BLOCK_1D_SCALING / BLOCK_2D_SCALING) against the
float64 product of the decoded operands (tests/oracle.py decodes them independently of lowbit's
dequantize), and against the unquantized product (the quantization error).

Every ``device`` test runs on the CPU and, marked ``gpu``, on the first CUDA device (cuBLASLt's
VEC128_32F / BLK128x128_32F block-scaled FP8 GEMM).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import is_gpu, run_on, to_cpu
from helpers import rel

import lowbit

SM = lowbit.ScalingMode
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16 = jnp.float32, jnp.bfloat16
B1, B2 = SM.BLOCK_1D_SCALING, SM.BLOCK_2D_SCALING


def decoded64(qt, layout):
    """Float64 values of one copy (the copy's 2-D matrix), decoded with the oracle's layout."""
    if layout == "rowwise":
        d, s, shape = qt.data, qt.scale_inv, (qt.rows, qt.cols)
    else:
        d, s, shape = qt.colwise_data, qt.colwise_scale_inv, (qt.cols, qt.rows)
    codes = np.asarray(d).reshape(shape).view(np.uint8)
    fmt = O.fmt_of(qt.q_dtype)
    vals = O.decode(codes, fmt).astype(np.float64)
    idx = O.fp8_block_scale_of(int(qt.scaling_mode), *shape)
    return vals * np.asarray(s, np.float64).reshape(-1)[idx]


def tol(device):
    # CPU: float32 accumulation per 128-block; Hopper: split accumulation (promoted per block).
    return 5e-4 if is_gpu(device) else 1e-5


def _q(x, mode, q_dtype=E4M3, **kw):
    return lowbit.quantize(x, mode, q_dtype, layout="both", **kw)


COMBOS = [(B1, B1), (B1, B2), (B2, B1)]


@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0].name[:8]}x{c[1].name[:8]}")
@pytest.mark.parametrize("shape", [(64, 96, 256), (130, 40, 300), (7, 129, 1000), (256, 256, 128)])
def test_vs_decoded_operands(device, rng, combo, shape, out_dtype):
    M, N, K = shape
    a = jnp.asarray(rng.standard_normal((M, K)) * 2.0 ** rng.uniform(-6, 6, (M, 1)), BF16)
    b = jnp.asarray(rng.standard_normal((N, K)) * 2.0 ** rng.uniform(-6, 6, (N, 1)), BF16)

    def f(a, b):
        qa, qb = _q(a, combo[0], power_2_scale=True), _q(b, combo[1])
        return qa, qb, lowbit.gemm(qa, qb, out_dtype=out_dtype)

    qa, qb, out = to_cpu(run_on(device, f, a, b))
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    ref = decoded64(qa, "rowwise") @ decoded64(qb, "rowwise").T
    assert rel(out, ref) < (tol(device) if out_dtype == F32 else 4e-3)
    # The quantization error of 1x128 / 128x128 E4M3 blocks.
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    assert rel(out, exact) < 6e-2


@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
def test_dense_copies_and_bias(device, rng, gemm_name):
    """The copies dense uses: fprop x_row . w_col (+ bias), dgrad dy_row . w_row, wgrad
    x_col . dy_col (1x128 blocks along the token axis)."""
    M, K, N = 72, 200, 136
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.1, BF16)
    dy = jnp.asarray(rng.standard_normal((M, N)), BF16)
    bias = jnp.asarray(rng.standard_normal(N), BF16)
    pick = {
        "fprop": (lambda x, w, dy: (_q(x, B1), _q(w, B2)), "rowwise", "colwise"),
        "dgrad": (lambda x, w, dy: (_q(dy, B1), _q(w, B2)), "rowwise", "rowwise"),
        "wgrad": (lambda x, w, dy: (_q(x, B1), _q(dy, B1)), "colwise", "colwise"),
    }
    make, la, lb = pick[gemm_name]
    use_bias = gemm_name == "fprop"

    def f(x, w, dy, bias):
        qa, qb = make(x, w, dy)
        return (
            qa,
            qb,
            lowbit.gemm(qa, qb, bias if use_bias else None, a_layout=la, b_layout=lb, out_dtype=F32),
        )

    qa, qb, out = to_cpu(run_on(device, f, x, w, dy, bias))
    ref = decoded64(qa, la) @ decoded64(qb, lb).T
    if use_bias:
        ref = ref + np.asarray(bias, np.float64)
    assert rel(out, ref) < tol(device)


def test_hybrid_e5m2_operand(device, rng):
    a = jnp.asarray(rng.standard_normal((64, 256)), BF16)
    b = jnp.asarray(rng.standard_normal((48, 256)), BF16)

    def f(a, b):
        qa, qb = _q(a, B1, E5M2), _q(b, B2, E4M3)
        return qa, qb, lowbit.gemm(qa, qb, out_dtype=F32)

    qa, qb, out = to_cpu(run_on(device, f, a, b))
    assert rel(out, decoded64(qa, "rowwise") @ decoded64(qb, "rowwise").T) < tol(device)


def test_nonfinite_and_zero_blocks(device, rng):
    a = rng.standard_normal((40, 256)).astype(np.float32)
    a[:, :128] = 0.0  # a zero block
    b = rng.standard_normal((24, 256)).astype(np.float32)
    a2 = a.copy()
    a2[3, 200] = np.nan

    def f(a, b):
        return lowbit.gemm(_q(a, B1), _q(b, B2), out_dtype=F32)

    out = to_cpu(run_on(device, f, jnp.asarray(a), jnp.asarray(b)))
    assert np.all(np.isfinite(out))
    out = to_cpu(run_on(device, f, jnp.asarray(a2), jnp.asarray(b)))
    assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, axis=0)))


def test_refusals():
    a = _q(jnp.ones((128, 128), F32), B2)
    with pytest.raises(TypeError, match="both BLOCK_2D_SCALING"):
        lowbit.gemm(a, a)
    with pytest.raises(TypeError, match="FP8 block-scaled"):
        lowbit.gemm(
            _q(jnp.ones((4, 128), F32), B1),
            lowbit.quantize(jnp.ones((4, 128), F32), SM.CURRENT_TENSOR_SCALING),
        )
    with pytest.raises(TypeError, match="E5M2"):
        lowbit.gemm(_q(jnp.ones((4, 128), F32), B1, E5M2), _q(jnp.ones((4, 128), F32), B1, E5M2))
