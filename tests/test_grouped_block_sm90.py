"""The grouped GEMM's block-scaled ragged-M calls (forward, dgrad; 1x128 x 128x128) on each
backend: LOWBIT_GROUPED_BLOCK_GEMM=sm90own (lowbit's own sm_90a kernel, grouped_gemm_sm90.cu),
cutlass, and auto (measured at the first call per shape), against the float64 products of the
operands as quantized (decoded with their block scales by tests/oracle.py).

The variable is read by the CUDA grouped GEMM only: the CPU backend never sees it, so its
bad-value error is checked on the GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_block import check_vs_decoded_operands
from test_grouped_gemm import ranges, recipe_fwd_bwd

import lowbit

BF16 = jnp.bfloat16

# (M, K, N, sizes). K a multiple of 128 and N of 16 (no padding by lowbit.grouped_gemm): the
# forward's N (144, 400) is not a multiple of 128, the dgrad's K (its n: 144, 400) neither.
# Groups of 0, 1, 127, 128 and 129 rows, groups ending mid-tile, trailing rows in no group.
_G64 = np.random.default_rng(64).multinomial(3000, np.full(64, 1 / 64)).astype(np.int32)
_G64[[3, 17, 40]] = 0
CASES = {
    "G1": (272, 256, 144, [200]),
    "G8_edges": (800, 256, 144, [0, 1, 127, 128, 129, 0, 200, 50]),
    "G64": (3072, 384, 400, list(_G64)),  # 3000 rows in groups, 72 in none
}
RECIPES = {
    "e4m3": lowbit.Float8BlockScaling(use_f32_scales=True),
    "hybrid": lowbit.Float8BlockScaling(fp8_format=lowbit.Format.HYBRID, use_f32_scales=True),
}


def _need_sm90(gpu_device):
    if not str(getattr(gpu_device, "compute_capability", "9.0")).startswith("9."):
        pytest.skip("sm90own needs compute capability 9.x")


def _run(device, rng, recipe_name, case):
    recipe = RECIPES[recipe_name]
    M, K, N, sizes = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    lhs, rhs, dout, y, dl, dr = recipe_fwd_bwd(device, rng, recipe, M, K, N, sizes)
    # The operands as the recipe quantizes them (gradients E5M2 under HYBRID).
    hybrid = recipe.fp8_format == lowbit.Format.HYBRID
    check_vs_decoded_operands(
        lhs, rhs, dout, sizes, y, dl, dr, jnp.float8_e5m2 if hybrid else jnp.float8_e4m3fn
    )
    # Rows in no group: exactly zero (the output starts as whatever XLA's buffer held).
    covered = sum(s for _, s in ranges(sizes, M))
    assert not np.any(np.asarray(y, np.float32)[covered:])
    assert not np.any(np.asarray(dl, np.float32)[covered:])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sm90own", "auto", "cutlass"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_backend_vs_decoded_operands(gpu_device, rng, monkeypatch, backend, recipe_name, case):
    if backend != "cutlass":
        _need_sm90(gpu_device)
    monkeypatch.setenv("LOWBIT_GROUPED_BLOCK_GEMM", backend)
    _run(gpu_device, rng, recipe_name, case)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["n128/group8", "n128_mc/group8", "n128/group16", "n128_mc/group16"])
def test_gpu_sm90own_variants(gpu_device, rng, monkeypatch, variant):
    _need_sm90(gpu_device)
    monkeypatch.setenv("LOWBIT_GROUPED_BLOCK_GEMM", "sm90own:" + variant)
    _run(gpu_device, rng, "e4m3", "G8_edges")


@pytest.mark.gpu
def test_gpu_bad_value_is_an_error(gpu_device, rng, monkeypatch):
    monkeypatch.setenv("LOWBIT_GROUPED_BLOCK_GEMM", "fastest")
    with pytest.raises(Exception, match="LOWBIT_GROUPED_BLOCK_GEMM must be auto, cutlass, sm90own"):
        _run(gpu_device, rng, "e4m3", "G1")
