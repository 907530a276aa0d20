"""Float8BlockScaling: TransformerEngine's fields, defaults and restrictions."""

from __future__ import annotations

import pytest

import lowbit
from lowbit import recipe as R

SM = lowbit.ScalingMode


def test_defaults_and_modes():
    r = R.Float8BlockScaling()
    assert r.fp8_format is R.Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for f in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        assert getattr(r, f).use_split_accumulator
    assert r.fp8_quant_fwd_inp == R.QParams(power_2_scale=not r.use_f32_scales, amax_epsilon=0.0)
    assert r.scaling_mode("x") == SM.BLOCK_1D_SCALING
    assert r.scaling_mode("kernel") == SM.BLOCK_2D_SCALING
    assert r.scaling_mode("grad") == SM.BLOCK_1D_SCALING
    assert r.float8_block_scaling() and not r.mxfp8() and not r.float8_per_tensor_scaling()
    hash(r)
    assert R.Float8BlockScaling(fp8_format=R.Format.HYBRID).q_dtype("grad") == R.Format.E5M2.bwd_dtype
    assert r in lowbit.capabilities.get_supported_quantization_recipes()


def test_use_f32_scales_env(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    r = R.Float8BlockScaling()
    assert r.use_f32_scales and not r.fp8_quant_bwd_grad.power_2_scale
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    assert R.Float8BlockScaling().fp8_quant_fwd_weight.power_2_scale
    assert not R.Float8BlockScaling(use_f32_scales=True).fp8_quant_fwd_inp.power_2_scale


def test_explicit_qparams():
    q = R.QParams(power_2_scale=False, amax_epsilon=1e-6)
    r = R.Float8BlockScaling(fp8_quant_bwd_grad=q)
    assert r.qparams("grad") == q and r.qparams("x").power_2_scale


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(fp8_format=R.Format.E5M2), ValueError, "E5M2"),
        (dict(x_block_scaling_dim=3), ValueError, "x_block_scaling_dim"),
        (dict(x_block_scaling_dim=2), ValueError, "2D x 2D"),
        (dict(w_block_scaling_dim=2, grad_block_scaling_dim=2), ValueError, "2D x 2D"),
        (dict(fp8_gemm_fprop=R.MMParams(False)), ValueError, "use_split_accumulator"),
        (dict(fp8_dpa=True), NotImplementedError, "attention"),
        (dict(fp8_quant_fwd_inp=R.QParams(amax_epsilon=-1.0)), ValueError, "amax_epsilon"),
        (dict(fp8_quant_fwd_inp=R.QParams(stochastic_rounding=True)), ValueError, "NVFP4"),
        (dict(backward_override="dequantized"), NotImplementedError, "backward_override"),
    ],
)
def test_restrictions(kw, exc, match):
    with pytest.raises(exc, match=match):
        R.Float8BlockScaling(**kw)


def test_1d_weights_allowed():
    r = R.Float8BlockScaling(w_block_scaling_dim=1)
    assert r.scaling_mode("kernel") == SM.BLOCK_1D_SCALING
    r = R.Float8BlockScaling(w_block_scaling_dim=1, x_block_scaling_dim=2)
    assert r.scaling_mode("x") == SM.BLOCK_2D_SCALING
