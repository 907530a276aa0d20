"""lowbit.layernorm (LayerNorm / RMSNorm): forward and gradients against a float64 NumPy
reference written here; fused FP8 outputs bit-equal to lowbit.quantize of the unfused output
(csrc/include/lowbit/norm.h); argument errors. Each ``device`` test runs on the CPU and (marked
``gpu``) on the first CUDA device, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on, to_cpu
from helpers import bits

import lowbit
from lowbit.ops.norm import layernorm_bwd, layernorm_fwd

SM = lowbit.ScalingMode
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------
def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def ref_forward(x, gamma, beta, norm_type, zc, eps=EPS):
    x, g = f64(x), f64(gamma) + (1.0 if zc else 0.0)
    if norm_type == "layernorm":
        mu = x.mean(-1, keepdims=True)
        rs = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    else:
        mu = np.zeros(x.shape[:-1] + (1,))
        rs = 1.0 / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    y = (x - mu) * rs * g
    if beta is not None:
        y = y + f64(beta)
    return y, mu[..., 0], rs[..., 0]


def ref_backward(dy, x, gamma, norm_type, zc, eps=EPS):
    """Analytic VJP of the normalization in float64: (dx, dgamma, dbeta)."""
    x, dy = f64(x), f64(dy)
    g = f64(gamma) + (1.0 if zc else 0.0)
    _, mu, rs = ref_forward(x, gamma, None, norm_type, zc, eps)
    mu, rs = mu[..., None], rs[..., None]
    xhat = (x - mu) * rs
    dyg = dy * g
    c1 = (dyg * xhat).mean(-1, keepdims=True)
    c2 = dyg.mean(-1, keepdims=True) if norm_type == "layernorm" else 0.0
    dx = rs * (dyg - xhat * c1 - c2)
    lead = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(lead), dy.sum(lead)


def tol(dtype):
    return {np.dtype(F32): 2e-5, np.dtype(BF16): 2.0**-7, np.dtype(F16): 2.0**-10}[np.dtype(dtype)]


def assert_close(got, want, rtol, floor=1e-2, what=""):
    """|got - want| <= rtol * (|want| + floor * max|want|), elementwise."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bound = rtol * (np.abs(want) + floor * np.abs(want).max())
    bad = np.abs(got - want) > bound
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} off; first at {i}: got {got[i]}, want {want[i]} "
            f"(bound {bound[i]:.3g})"
        )


def assert_same_scaled(got, want):
    """Bitwise equality of every array of two ScaledTensors, and of their static fields."""
    for f in ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax"):
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f"{f}: presence differs"
        if g is not None:
            g, w = np.asarray(g), np.asarray(w)
            assert g.shape == w.shape and g.dtype == w.dtype, f"{f}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
            diff = bits(g) != bits(w)
            assert not diff.any(), f"{f}: {diff.sum()} of {diff.size} differ"
    for f in ("scaling_mode", "q_dtype", "dq_dtype", "shape", "flatten_axis"):
        assert getattr(got, f) == getattr(want, f), f


def make(rng, shape, dtype, loc=0.3, scale=2.0):
    return jnp.asarray(rng.normal(loc, scale, shape).astype(np.float32)).astype(dtype)


def params(rng, C, zc, dtype=F32):
    gamma = rng.normal(0.0 if zc else 1.0, 0.3, (C,)).astype(np.float32)
    beta = rng.normal(0.0, 0.3, (C,)).astype(np.float32)
    return jnp.asarray(gamma).astype(dtype), jnp.asarray(beta).astype(dtype)


# ---------------------------------------------------------------------------------------------
# forward / backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 200)])
def test_forward(device, rng, dtype, norm_type, zc, shape):
    x = make(rng, shape, dtype)
    gamma, beta = params(rng, shape[-1], zc)
    beta = beta if norm_type == "layernorm" else None

    def fn(x, gamma, beta):
        return layernorm_fwd(x, gamma, beta, norm_type=norm_type, zero_centered_gamma=zc, epsilon=EPS)

    out, _, mean, rsigma = to_cpu(run_on(device, fn, x, gamma, beta))
    y, mu, rs = ref_forward(x, gamma, beta, norm_type, zc)
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    assert_close(out, y, tol(dtype), what="y")
    assert_close(rsigma, rs, 1e-5, what="rsigma")
    if norm_type == "layernorm":
        assert_close(mean, mu, 1e-5, floor=1e-1, what="mean")
    else:
        assert mean is None


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zc_gamma"])
def test_gradients(device, rng, dtype, norm_type, zc):
    shape = (4, 6, 96)
    x = make(rng, shape, dtype)
    dy = make(rng, shape, dtype, 0.0, 1.0)
    gamma, beta = params(rng, shape[-1], zc)
    beta = beta if norm_type == "layernorm" else None

    def fn(x, gamma, beta, dy):
        y, vjp = jax.vjp(
            lambda x, g, b: lowbit.layernorm(
                x, g, b, norm_type=norm_type, zero_centered_gamma=zc, epsilon=EPS
            ),
            x,
            gamma,
            beta,
        )
        return vjp(dy)

    dx, dg, db = to_cpu(run_on(device, fn, x, gamma, beta, dy))
    rdx, rdg, rdb = ref_backward(dy, x, gamma, norm_type, zc)
    assert dx.dtype == np.dtype(dtype) and dg.dtype == np.float32
    assert_close(dx, rdx, 2 * tol(dtype), floor=5e-2, what="dx")
    assert_close(dg, rdg, max(tol(dtype), 1e-4), floor=5e-2, what="dgamma")
    if norm_type == "layernorm":
        assert_close(db, rdb, max(tol(dtype), 1e-4), floor=5e-2, what="dbeta")
    else:
        assert db is None


def test_gamma_dtype_follows_param(rng):
    """bf16 gamma/beta with f32 x: gradients come back in the parameters' dtype."""
    x = make(rng, (8, 32), F32)
    gamma, beta = params(rng, 32, False, BF16)
    dx, dg, db = jax.grad(lambda x, g, b: lowbit.layernorm(x, g, b).sum(), argnums=(0, 1, 2))(x, gamma, beta)
    assert dx.dtype == np.float32 and dg.dtype == BF16 and db.dtype == BF16
    _, rdg, rdb = ref_backward(jnp.ones_like(x), x, gamma, "layernorm", False)
    assert_close(to_cpu(dg), rdg, 2.0**-7, floor=5e-2)
    assert_close(to_cpu(db), rdb, 2.0**-7, floor=5e-2)


def test_layernorm_without_beta(rng):
    x = make(rng, (6, 48), F32)
    gamma, _ = params(rng, 48, False)
    y = lowbit.layernorm(x, gamma)
    assert_close(to_cpu(y), ref_forward(x, gamma, None, "layernorm", False)[0], 2e-5)
    dg = jax.grad(lambda g: lowbit.layernorm(x, g).sum())(gamma)
    assert dg.shape == (48,)


def test_backward_building_block_matches_vjp(rng):
    x = make(rng, (5, 80), F32)
    dy = make(rng, (5, 80), F32)
    gamma, beta = params(rng, 80, True)
    _, _, mean, rsigma = layernorm_fwd(x, gamma, beta, zero_centered_gamma=True)
    dx, dg, db = layernorm_bwd(dy, x, mean, rsigma, gamma, zero_centered_gamma=True)
    _, vjp = jax.vjp(lambda x, g, b: lowbit.layernorm(x, g, b, zero_centered_gamma=True), x, gamma, beta)
    for a, b in zip((dx, dg, db), vjp(dy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# fused quantization: bit-equal to lowbit.quantize of the unfused output
# ---------------------------------------------------------------------------------------------
FUSED = [
    (SM.DELAYED_TENSOR_SCALING, E4M3, "both"),
    (SM.DELAYED_TENSOR_SCALING, E5M2, "rowwise"),
    (SM.CURRENT_TENSOR_SCALING, E4M3, "both"),
    (SM.CURRENT_TENSOR_SCALING, E5M2, "colwise"),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("mode,q,layout", FUSED, ids=lambda v: getattr(v, "name", None) or str(v))
def test_fused_quantize_bit_equal(device, rng, dtype, norm_type, mode, q, layout):
    shape = (3, 16, 64)
    x = make(rng, shape, dtype)
    gamma, beta = params(rng, 64, False)
    beta = beta if norm_type == "layernorm" else None
    scale = jnp.asarray([7.0], jnp.float32) if mode == SM.DELAYED_TENSOR_SCALING else None

    def fused(x, gamma, beta, scale):
        return lowbit.layernorm(x, gamma, beta, norm_type=norm_type, quantize=(mode, q, scale, layout))

    def unfused(x, gamma, beta, scale):
        y = lowbit.layernorm(x, gamma, beta, norm_type=norm_type)
        return lowbit.quantize(y, mode, q, scale=scale, layout=layout)

    got = to_cpu(run_on(device, fused, x, gamma, beta, scale))
    want = to_cpu(run_on(device, unfused, x, gamma, beta, scale))
    assert_same_scaled(got, want)


@pytest.mark.parametrize(
    "mode,q",
    [(SM.MXFP8_1D_SCALING, E4M3), (SM.NVFP4_1D_SCALING, jnp.float4_e2m1fn), (SM.NO_SCALING, None)],
    ids=["mxfp8", "nvfp4", "none"],
)
def test_block_modes_match_quantize(rng, mode, q):
    x = make(rng, (32, 64), BF16)
    gamma, beta = params(rng, 64, False)
    got = lowbit.layernorm(x, gamma, beta, quantize=(mode, q, None, "both"))
    want = lowbit.quantize(lowbit.layernorm(x, gamma, beta), mode, q, layout="both")
    for f in ("data", "colwise_data", "scale_inv", "colwise_scale_inv", "global_scale_inv"):
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(bits(g), bits(w))


def test_return_norm_output(rng):
    x = make(rng, (4, 128), BF16)
    gamma, beta = params(rng, 128, False)
    spec = (SM.CURRENT_TENSOR_SCALING, E4M3, None)
    qt, y, mean, rsigma = layernorm_fwd(x, gamma, beta, quantize=spec, return_norm_output=True)
    np.testing.assert_array_equal(bits(y), bits(lowbit.layernorm(x, gamma, beta)))
    assert_same_scaled(qt, lowbit.quantize(y, SM.CURRENT_TENSOR_SCALING, E4M3, layout="both"))


def test_quantized_gradient_is_straight_through(rng):
    """d/dx of a loss on dequantize(layernorm(x, quantize=...)) ~ the unquantized gradient."""
    x = make(rng, (16, 64), F32)
    gamma, beta = params(rng, 64, False)
    w = make(rng, (16, 64), F32, 0.0, 1.0)
    spec = (SM.CURRENT_TENSOR_SCALING, E4M3, None, "rowwise")
    gq = jax.grad(lambda x: (lowbit.dequantize(lowbit.layernorm(x, gamma, beta, quantize=spec)) * w).sum())(x)
    g = jax.grad(lambda x: (lowbit.layernorm(x, gamma, beta) * w).sum())(x)
    err = np.linalg.norm(np.asarray(gq) - np.asarray(g)) / np.linalg.norm(np.asarray(g))
    assert err < 0.1, err


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_errors(rng):
    x = make(rng, (4, 32), F32)
    gamma, beta = params(rng, 32, False)
    with pytest.raises(ValueError, match="gamma"):
        lowbit.layernorm(x, gamma[:16], beta)
    with pytest.raises(ValueError, match="beta"):
        lowbit.layernorm(x, gamma, beta[:8])
    with pytest.raises(ValueError, match="beta"):
        lowbit.layernorm(x, gamma, beta, norm_type="rmsnorm")
    with pytest.raises(TypeError, match="x"):
        lowbit.layernorm(jnp.ones((4, 32), jnp.int32), gamma, beta)
    with pytest.raises(TypeError, match="gamma"):
        lowbit.layernorm(x, jnp.ones((32,), jnp.int32), beta)
    with pytest.raises(ValueError, match="norm_type"):
        lowbit.layernorm(x, gamma, beta, norm_type="batchnorm")
    with pytest.raises(ValueError, match="epsilon"):
        lowbit.layernorm(x, gamma, beta, epsilon=-1.0)
    with pytest.raises(ValueError, match="scale"):
        lowbit.layernorm(x, gamma, beta, quantize=(SM.DELAYED_TENSOR_SCALING, E4M3, None))
    with pytest.raises(TypeError, match="quantize"):
        lowbit.layernorm(x, gamma, beta, quantize="fp8")
    with pytest.raises(TypeError, match="q_dtype"):
        lowbit.layernorm(x, gamma, beta, quantize=(SM.CURRENT_TENSOR_SCALING, jnp.int8, None))
    with pytest.raises(ValueError, match="layout"):
        lowbit.layernorm(x, gamma, beta, quantize=(SM.CURRENT_TENSOR_SCALING, E4M3, None, "diagonal"))


# ---------------------------------------------------------------------------------------------
# GPU: larger shapes that take the vectorized kernels; GPU vs CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(256, 4096), (100, 1024), (48, 6000)])
def test_gpu_large(gpu_device, rng, dtype, shape):
    x = make(rng, shape, dtype)
    gamma, beta = params(rng, shape[-1], False)
    dy = make(rng, shape, dtype, 0.0, 1.0)
    spec = (SM.CURRENT_TENSOR_SCALING, E4M3, None, "both")

    def fn(x, gamma, beta, dy):
        y, vjp = jax.vjp(lambda x, g, b: lowbit.layernorm(x, g, b, epsilon=EPS), x, gamma, beta)
        qt = lowbit.layernorm(x, gamma, beta, epsilon=EPS, quantize=spec)
        return y, vjp(dy), qt, lowbit.quantize(y, spec[0], spec[1], layout="both")

    y, (dx, dg, db), qt, ref_qt = to_cpu(run_on(gpu_device, fn, x, gamma, beta, dy))
    assert_close(y, ref_forward(x, gamma, beta, "layernorm", False)[0], tol(dtype), what="y")
    rdx, rdg, rdb = ref_backward(dy, x, gamma, "layernorm", False)
    assert_close(dx, rdx, 2 * tol(dtype), floor=5e-2, what="dx")
    assert_close(dg, rdg, max(tol(dtype), 1e-4), floor=5e-2, what="dgamma")
    assert_close(db, rdb, max(tol(dtype), 1e-4), floor=5e-2, what="dbeta")
    assert_same_scaled(qt, ref_qt)
