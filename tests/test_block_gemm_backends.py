"""The routed FP8 block-scaled GEMM (csrc/kernels/cuda/block_gemm.cu): lowbit.gemm on
Float8BlockScaling operands with each backend forced (LOWBIT_BLOCK_GEMM=cublaslt / cutlass /
sm90own) and
chosen by measurement (auto), against the float64 product of the decoded operands plus the bias.

The bias goes to the GEMM's epilogue where a kernel has one (the CPU kernel, lowbit's CUTLASS
kernels) and is added to an F32 product otherwise (cuBLASLt): both round ``acc + bias`` once, so
every backend meets the same tolerance. Shapes are ragged (M, N, K not multiples of 16 or 128:
lowbit.gemm pads them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu
from helpers import rel
from test_gemm_block import decoded64

import lowbit

SM = lowbit.ScalingMode
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16 = jnp.float32, jnp.bfloat16
B1, B2 = SM.BLOCK_1D_SCALING, SM.BLOCK_2D_SCALING

# (a mode, a format, b mode, b format): fprop / dgrad (1x128 . 128x128, HYBRID's E5M2 gradient)
# and wgrad (1x128 . 1x128).
COMBOS = {
    "fprop": (B1, E4M3, B2, E4M3),
    "dgrad_e5m2": (B1, E5M2, B2, E4M3),
    "wgrad": (B1, E4M3, B1, E4M3),
    "wgrad_e5m2": (B1, E4M3, B1, E5M2),
}


def _case(device, rng, combo, shape, out_dtype, bias_dtype):
    am, af, bm, bf = COMBOS[combo]
    M, N, K = shape
    a = jnp.asarray(rng.standard_normal((M, K)) * 2.0 ** rng.uniform(-4, 4, (M, 1)), BF16)
    b = jnp.asarray(rng.standard_normal((N, K)) * 2.0 ** rng.uniform(-4, 4, (N, 1)), BF16)
    bias = None if bias_dtype is None else jnp.asarray(rng.standard_normal(N) * 4.0, bias_dtype)

    def f(a, b, bias):
        qa = lowbit.quantize(a, am, af, layout="rowwise")
        qb = lowbit.quantize(b, bm, bf, layout="rowwise")
        return qa, qb, lowbit.gemm(qa, qb, bias, out_dtype=out_dtype)

    qa, qb, out = to_cpu(run_on(device, f, a, b, bias))
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    ref = decoded64(qa, "rowwise") @ decoded64(qb, "rowwise").T
    if bias is not None:
        ref = ref + np.asarray(bias, np.float64)
    # F32: split accumulation, promoted per 128-block (CPU: float32 sums); BF16: one rounding.
    tol = (5e-4 if is_gpu(device) else 1e-5) if out_dtype == F32 else 4e-3
    assert rel(out, ref) < tol


def _need_sm90(gpu_device):
    if not str(getattr(gpu_device, "compute_capability", "9.0")).startswith("9."):
        pytest.skip("sm90own needs compute capability 9.x")


def _sm90own_cases(gpu_device, rng, monkeypatch, config, combo, out_dtype, bias_dtype):
    """The forced sm90own configuration on three shapes; the last has more tiles than an
    H100/H200 has SMs, so each persistent CTA walks several."""
    _need_sm90(gpu_device)
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", config)
    for shape in [(130, 200, 300), (7, 129, 1000), (2100, 2200, 512)]:
        _case(gpu_device, rng, combo, shape, out_dtype, bias_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cublaslt", "cutlass", "auto"])
@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias_dtype", [None, BF16, F32], ids=["nobias", "bias_bf16", "bias_f32"])
def test_backends_vs_float64(gpu_device, rng, monkeypatch, backend, combo, out_dtype, bias_dtype):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", backend)
    _case(gpu_device, rng, combo, (130, 200, 300), out_dtype, bias_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cublaslt", "cutlass"])
@pytest.mark.parametrize("shape", [(7, 129, 1000), (256, 384, 512), (1000, 264, 1408)])
def test_backends_shapes(gpu_device, rng, monkeypatch, backend, shape):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", backend)
    _case(gpu_device, rng, "fprop", shape, BF16, BF16)
    _case(gpu_device, rng, "wgrad", shape, F32, None)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["coop128x128_c1x2", "coop128x128_c2x1", "ping64x128_c1x2"])
def test_each_cutlass_variant(gpu_device, rng, monkeypatch, variant):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", f"cutlass:{variant}")
    for combo in COMBOS:
        _case(gpu_device, rng, combo, (200, 136, 640), BF16, F32)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        "sm90own",
        "sm90own:n128/group8",
        "sm90own:n128_mc/group16",
        "sm90own:n192/group8",
        "sm90own:n192_mc/group8",
    ],
)
@pytest.mark.parametrize("combo", ["fprop", "dgrad_e5m2"])
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias_dtype", [None, BF16, F32], ids=["nobias", "bias_bf16", "bias_f32"])
def test_sm90own_vs_float64(gpu_device, rng, monkeypatch, config, combo, out_dtype, bias_dtype):
    """lowbit's own sm_90a kernel on 1x128 . 128x128, forced: the router's pick among its
    configurations, and single ones (BLOCK_N 128/192, TMA multicast)."""
    _sm90own_cases(gpu_device, rng, monkeypatch, config, combo, out_dtype, bias_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["sm90own", "sm90own:n128/group16", "sm90own:n128_mc/group8"])
@pytest.mark.parametrize("combo", ["wgrad", "wgrad_e5m2"])
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias_dtype", [None, BF16, F32], ids=["nobias", "bias_bf16", "bias_f32"])
def test_sm90own_wgrad_vs_float64(gpu_device, rng, monkeypatch, config, combo, out_dtype, bias_dtype):
    """lowbit's own kernel on 1x128 . 1x128 (wgrad; n128, unicast or with A multicast over an N
    pair; B's column scales per K block), forced by name."""
    _sm90own_cases(gpu_device, rng, monkeypatch, config, combo, out_dtype, bias_dtype)


@pytest.mark.gpu
def test_sm90own_wgrad_has_no_n192(gpu_device, rng, monkeypatch):
    _need_sm90(gpu_device)
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "sm90own:n192/group8")
    with pytest.raises(Exception, match="no block-scaled GEMM"):
        _case(gpu_device, rng, "wgrad", (64, 128, 128), BF16, None)


@pytest.mark.gpu
def test_bad_override_is_an_error(gpu_device, rng, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "fastest-please")
    with pytest.raises(Exception, match="LOWBIT_BLOCK_GEMM must be"):
        _case(gpu_device, rng, "fprop", (64, 64, 128), BF16, None)


@pytest.mark.parametrize("combo", ["fprop", "wgrad_e5m2"])
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_bias_rounded_once(device, rng, combo, out_dtype):
    """Default routing (CPU kernel / measured GPU choice) with a bias of the other dtype."""
    _case(device, rng, combo, (72, 136, 200), out_dtype, F32 if out_dtype == BF16 else BF16)


@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_fused_and_outer_bias_agree(rng, monkeypatch, out_dtype):
    """The bias in the GEMM's epilogue and the bias added to an F32 product round the same value
    once: bit-identical on the CPU kernel (which has both paths)."""
    from lowbit.ops._ffi import gemm as ffi

    a = jnp.asarray(rng.standard_normal((40, 300)), BF16)
    b = jnp.asarray(rng.standard_normal((56, 300)), BF16)
    bias = jnp.asarray(rng.standard_normal(56) * 8.0, BF16)

    def f(a, b, bias):
        qa, qb = lowbit.quantize(a, B1, E4M3), lowbit.quantize(b, B2, E4M3)
        return lowbit.gemm(qa, qb, bias, out_dtype=out_dtype)

    outs = []
    for fused in (True, False):
        monkeypatch.setattr(ffi, "block_bias_fused", lambda *args, fused=fused: fused)
        outs.append(to_cpu(run_on(jax.devices("cpu")[0], f, a, b, bias)))
    np.testing.assert_array_equal(outs[0], outs[1])
