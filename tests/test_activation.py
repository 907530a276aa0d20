"""lowbit.activation and its building blocks (act_lu, dact_dbias): forward and gradients against a
float64 NumPy reference written here, for every activation plain and gated; fused FP8 outputs
(and the fused dbias) equal to lowbit.quantize / quantize_dbias of the unfused result; errors.
Each ``device`` test runs on the CPU and (marked ``gpu``) on the first CUDA device, under jit."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on, to_cpu
from helpers import bits
from test_norm import assert_close, assert_same_scaled, f64, make

import lowbit
from lowbit.ops.activation import act_lu, dact_dbias

SM = lowbit.ScalingMode
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

_erf = np.vectorize(math.erf)
_C = math.sqrt(2.0 / math.pi)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


# name -> (f, f') in float64
REF = {
    "linear": (lambda x: x, lambda x: np.ones_like(x)),
    "gelu": (
        lambda x: 0.5 * x * (1 + np.tanh(_C * (x + 0.044715 * x**3))),
        lambda x: (
            0.5 * (1 + np.tanh(_C * (x + 0.044715 * x**3)))
            + 0.5 * x * (1 - np.tanh(_C * (x + 0.044715 * x**3)) ** 2) * _C * (1 + 3 * 0.044715 * x**2)
        ),
    ),
    "gelu_exact": (
        lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
        lambda x: 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x**2) / math.sqrt(2 * math.pi),
    ),
    "relu": (lambda x: np.maximum(x, 0), lambda x: (x > 0).astype(np.float64)),
    "silu": (lambda x: x * _sig(x), lambda x: _sig(x) * (1 + x * (1 - _sig(x)))),
    "quick_gelu": (
        lambda x: x * _sig(1.702 * x),
        lambda x: _sig(1.702 * x) * (1 + 1.702 * x * (1 - _sig(1.702 * x))),
    ),
    "squared_relu": (lambda x: np.maximum(x, 0) ** 2, lambda x: 2 * np.maximum(x, 0)),
}
ACTS = list(REF)


def ref_forward(x, name, gated):
    x = f64(x)
    f, _ = REF[name]
    if not gated:
        return f(x)
    a, b = np.split(x, 2, axis=-1)
    return f(a) * b


def ref_backward(dy, x, name, gated):
    x, dy = f64(x), f64(dy)
    f, df = REF[name]
    if not gated:
        return dy * df(x)
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([dy * b * df(a), dy * f(a)], axis=-1)


def acts_of(name, gated):
    return (name, "linear") if gated else (name,)


def tol(dtype):
    # f32: the platform's exp/tanh/erf differ from float64 by a few ulps.
    return {np.dtype(F32): 1e-5, np.dtype(BF16): 2.0**-7, np.dtype(F16): 2.0**-10}[np.dtype(dtype)]


# Inputs away from relu's kink, where float rounding could move x across 0 for f'.
def make_x(rng, shape, dtype):
    x = rng.normal(0.0, 2.0, shape).astype(np.float32)
    x = np.where(np.abs(x) < 1e-3, 0.5, x)
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("name", ACTS)
def test_forward_and_grad(device, rng, name, gated, dtype):
    shape = (3, 10, 64)
    x = make_x(rng, shape, dtype)
    out_shape = shape[:-1] + (32 if gated else 64,)
    dy = make(rng, out_shape, dtype, 0.0, 1.0)

    def fn(x, dy):
        y, vjp = jax.vjp(lambda x: lowbit.activation(x, acts_of(name, gated)), x)
        return y, vjp(dy)[0]

    y, dx = to_cpu(run_on(device, fn, x, dy))
    assert y.dtype == np.dtype(dtype) and y.shape == out_shape and dx.shape == shape
    # floor: the tanh form of gelu cancels in its tails (1 + tanh ~ 0), so float32 keeps only an
    # absolute accuracy of a few ulps of the output's scale there.
    assert_close(y, ref_forward(x, name, gated), tol(dtype), floor=1e-2, what="y")
    assert_close(dx, ref_backward(dy, x, name, gated), 2 * tol(dtype), floor=5e-2, what="dx")


@pytest.mark.parametrize(
    "alias,pair",
    [
        ("geglu", ("gelu", "linear")),
        ("swiglu", ("silu", "linear")),
        ("reglu", ("relu", "linear")),
        ("qgeglu", ("quick_gelu", "linear")),
        ("sreglu", ("squared_relu", "linear")),
    ],
)
def test_gated_aliases(rng, alias, pair):
    x = make_x(rng, (4, 64), F32)
    np.testing.assert_array_equal(
        np.asarray(lowbit.activation(x, alias)), np.asarray(lowbit.activation(x, pair))
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_dact_dbias(device, rng, dtype, gated):
    x = make_x(rng, (5, 7, 96), dtype)
    dy = make(rng, (5, 7, 48 if gated else 96), dtype, 0.0, 1.0)
    acts = acts_of("silu", gated)
    dx, db = to_cpu(run_on(device, lambda dy, x: dact_dbias(dy, x, acts, with_dbias=True), dy, x))
    assert_close(dx, ref_backward(dy, x, "silu", gated), 2 * tol(dtype), floor=1e-2, what="dx")
    assert db.dtype == np.dtype(dtype) and db.shape == (96,)
    # dbias is the column sum of the (rounded) dx.
    assert_close(db, f64(dx).reshape(-1, 96).sum(0), 2 * tol(dtype), floor=5e-2, what="dbias")


# ---------------------------------------------------------------------------------------------
# fused quantization
# ---------------------------------------------------------------------------------------------
FUSED = [
    (SM.DELAYED_TENSOR_SCALING, E4M3, "both"),
    (SM.CURRENT_TENSOR_SCALING, E4M3, "both"),
    (SM.CURRENT_TENSOR_SCALING, E5M2, "rowwise"),
    (SM.DELAYED_TENSOR_SCALING, E5M2, "colwise"),
]


def spec_args(mode, q, layout):
    scale = jnp.asarray([3.0], jnp.float32) if mode == SM.DELAYED_TENSOR_SCALING else None
    return scale, layout


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(
    "acts", [("gelu",), ("silu", "linear"), ("squared_relu",)], ids=lambda a: "+".join(a)
)
@pytest.mark.parametrize("mode,q,layout", FUSED, ids=lambda v: getattr(v, "name", None) or str(v))
def test_fused_forward_bit_equal(device, rng, dtype, acts, mode, q, layout):
    x = make_x(rng, (4, 12, 64), dtype)
    scale, layout = spec_args(mode, q, layout)

    def fused(x, scale):
        return lowbit.activation(x, acts, quantize=(mode, q, scale, layout))

    def unfused(x, scale):
        return lowbit.quantize(lowbit.activation(x, acts), mode, q, scale=scale, layout=layout)

    assert_same_scaled(to_cpu(run_on(device, fused, x, scale)), to_cpu(run_on(device, unfused, x, scale)))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("acts", [("gelu",), ("gelu", "linear")], ids=lambda a: "+".join(a))
@pytest.mark.parametrize("mode,q,layout", FUSED[:3], ids=lambda v: getattr(v, "name", None) or str(v))
def test_fused_backward_bit_equal(device, rng, dtype, acts, mode, q, layout):
    gated = len(acts) == 2
    x = make_x(rng, (6, 10, 64), dtype)
    dy = make(rng, (6, 10, 32 if gated else 64), dtype, 0.0, 1.0)
    scale, layout = spec_args(mode, q, layout)

    def fused(dy, x, scale):
        return dact_dbias(dy, x, acts, quantize=(mode, q, scale, layout), with_dbias=True)

    def unfused(dy, x, scale):
        dx, _ = dact_dbias(dy, x, acts)
        qt, db = lowbit.quantize_dbias(dx, mode, q, scale=scale, layout=layout)
        return qt, db, dx

    qt, db = to_cpu(run_on(device, fused, dy, x, scale))
    rqt, rdb, dx = to_cpu(run_on(device, unfused, dy, x, scale))
    assert_same_scaled(qt, rqt)
    # The two dbias sums may add in different orders on the GPU; both are float32 sums of dx.
    assert_close(db, f64(dx).reshape(-1, 64).sum(0), 2 * tol(dtype), floor=5e-2, what="dbias")
    assert_close(db, f64(rdb), 2 * tol(dtype), floor=5e-2, what="dbias vs quantize_dbias")


def test_block_mode_falls_back_to_quantize(rng):
    x = make_x(rng, (32, 128), BF16)
    spec = (SM.MXFP8_1D_SCALING, E4M3, None, "both")
    got = act_lu(x, ("silu", "linear"), quantize=spec)
    want = lowbit.quantize(act_lu(x, ("silu", "linear")), SM.MXFP8_1D_SCALING, E4M3, layout="both")
    np.testing.assert_array_equal(bits(got.data), bits(want.data))
    np.testing.assert_array_equal(bits(got.colwise_scale_inv), bits(want.colwise_scale_inv))


def test_return_hp(rng):
    x = make_x(rng, (16, 64), BF16)
    qt, y = act_lu(x, ("gelu",), quantize=(SM.CURRENT_TENSOR_SCALING, E4M3, None), return_hp=True)
    np.testing.assert_array_equal(bits(y), bits(act_lu(x, ("gelu",))))
    assert_same_scaled(qt, lowbit.quantize(y, SM.CURRENT_TENSOR_SCALING, E4M3, layout="both"))


def test_quantized_gradient_is_straight_through(rng):
    x = make_x(rng, (16, 64), F32)
    w = make(rng, (16, 64), F32, 0.0, 1.0)
    spec = (SM.CURRENT_TENSOR_SCALING, E4M3, None, "rowwise")
    gq = jax.grad(lambda x: (lowbit.dequantize(lowbit.activation(x, ("gelu",), quantize=spec)) * w).sum())(x)
    g = jax.grad(lambda x: (lowbit.activation(x, ("gelu",)) * w).sum())(x)
    err = np.linalg.norm(np.asarray(gq) - np.asarray(g)) / np.linalg.norm(np.asarray(g))
    assert err < 0.1, err


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_errors(rng):
    x = make_x(rng, (4, 32), F32)
    with pytest.raises(ValueError, match="activations"):
        lowbit.activation(x, ("tanhh",))
    with pytest.raises(ValueError, match="activations"):
        lowbit.activation(x, ("gelu", "relu"))
    with pytest.raises(TypeError, match="activations"):
        lowbit.activation(x, (1, 2))
    with pytest.raises(ValueError, match="even"):
        lowbit.activation(make_x(rng, (4, 33), F32), ("silu", "linear"))
    with pytest.raises(TypeError, match="x"):
        lowbit.activation(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(TypeError, match="dy"):
        dact_dbias(jnp.ones((4, 32), F32), x, ("gelu", "linear"))
    with pytest.raises(ValueError, match="scale"):
        lowbit.activation(x, quantize=(SM.CURRENT_TENSOR_SCALING, E4M3, jnp.ones((1,), jnp.float32)))


# ---------------------------------------------------------------------------------------------
# GPU: tile kernels on larger shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=lambda a: "+".join(a))
def test_gpu_large(gpu_device, rng, acts):
    gated = len(acts) == 2
    x = make_x(rng, (256, 2048), BF16)
    dy = make(rng, (256, 1024 if gated else 2048), BF16, 0.0, 1.0)
    spec = (SM.CURRENT_TENSOR_SCALING, E5M2, None, "both")

    def fn(dy, x):
        y = act_lu(x, acts)
        qt = act_lu(x, acts, quantize=(SM.DELAYED_TENSOR_SCALING, E4M3, jnp.ones((1,), jnp.float32) * 2.0))
        ref = lowbit.quantize(
            y, SM.DELAYED_TENSOR_SCALING, E4M3, scale=jnp.ones((1,), jnp.float32) * 2.0, layout="both"
        )
        dq, db = dact_dbias(dy, x, acts, quantize=spec, with_dbias=True)
        dx, _ = dact_dbias(dy, x, acts)
        return y, qt, ref, dq, db, dx, lowbit.quantize(dx, spec[0], spec[1], layout="both")

    y, qt, ref, dq, db, dx, dref = to_cpu(run_on(gpu_device, fn, dy, x))
    assert_close(y, ref_forward(x, acts[0], gated), 2.0**-7, floor=1e-3, what="y")
    assert_close(dx, ref_backward(dy, x, acts[0], gated), 2.0**-6, floor=1e-2, what="dx")
    assert_same_scaled(qt, ref)
    assert_same_scaled(dq, dref)
    assert_close(db, f64(dx).sum(0), 2.0**-6, floor=5e-2, what="dbias")
