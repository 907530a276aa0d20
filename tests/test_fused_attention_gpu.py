"""lowbit.ops.fused_attention on the GPU (cuDNN through lowbit's handler) against float64: GQA,
padding, bias gradient, sinks, dropout statistics and dropout inside lax.scan with default XLA
flags, remat, FP8. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.ops._ffi import attention as ffi
from lowbit.ops.fused_attention import Fp8AttentionScales, fused_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cudnn(gpu_device):
    ok, reason = ffi.cudnn_status()
    if not ok:
        pytest.fail(f"cuDNN attention not usable on this GPU machine: {reason}")
    with jax.default_device(gpu_device):
        yield


def _inputs(b=2, sq=128, sk=128, h=4, g=2, d=64, seed=0, dtype=jnp.bfloat16):
    r = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(r.standard_normal(s), dtype) for s in ((b, sq, h, d), (b, sk, g, d), (b, sk, g, d))
    )


def _f64_attention(q, k, v, bias=None, causal=False, lq=None, lk=None, sink=None, scale=None):
    with jax.enable_x64():
        q, k, v = (jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (q, k, v))
        b, sq, h, d = q.shape
        sk, g = k.shape[1], k.shape[2]
        scale = 1 / np.sqrt(d) if scale is None else scale
        kk, vv = jnp.repeat(k, h // g, 2), jnp.repeat(v, h // g, 2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale
        if bias is not None:
            s = s + jnp.asarray(np.asarray(bias, np.float32), jnp.float64)
        keep = jnp.ones((b, 1, sq, sk), bool)
        if causal:
            keep &= jnp.tril(jnp.ones((sq, sk), bool))
        if lq is not None:
            keep &= (jnp.arange(sq)[None, None, :, None] < jnp.asarray(lq)[:, None, None, None]) & (
                jnp.arange(sk)[None, None, None, :] < jnp.asarray(lk)[:, None, None, None]
            )
        s = jnp.where(keep, s, -jnp.inf)
        cols = [s]
        if sink is not None:
            cols.append(jnp.broadcast_to(jnp.asarray(sink, jnp.float64)[None, :, None, None], (b, h, sq, 1)))
        full = jnp.concatenate(cols, -1)
        m = jnp.max(full, -1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(full - m)
        p = (e / jnp.maximum(jnp.sum(e, -1, keepdims=True), 1e-300))[..., :sk]
        return np.asarray(jnp.einsum("bhqk,bkhd->bqhd", p, vv))


def _close(got, want, tol):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    err = np.max(np.abs(got - want))
    assert err <= tol * max(1.0, np.max(np.abs(want))), f"max error {err}"


@pytest.mark.parametrize("causal", [False, True])
def test_forward_gqa_padding(causal):
    q, k, v = _inputs(sq=96, sk=160)
    lq, lk = jnp.array([96, 37], jnp.int32), jnp.array([160, 51], jnp.int32)
    got = fused_attention(q, k, v, causal=causal, seqlens_q=lq, seqlens_kv=lk, implementation="cudnn")
    _close(got, _f64_attention(q, k, v, causal=causal, lq=lq, lk=lk), 2e-2)
    assert np.all(np.asarray(got[1, 37:], np.float32) == 0)


def test_gradients_with_bias_against_reference_path():
    q, k, v = _inputs()
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((1, 4, 128, 128)), jnp.bfloat16)
    ct = jnp.asarray(np.random.default_rng(6).standard_normal((2, 128, 4, 64)), jnp.bfloat16)

    def grads(impl):
        f = lambda *a: jnp.sum(fused_attention(*a, causal=True, implementation=impl).astype(jnp.float32) * ct)  # noqa: E731
        return jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, bias)

    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads("cudnn"), grads("reference")):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) <= 3e-2 * max(1.0, np.max(np.abs(w))), name


def test_sink_forward_and_gradient():
    q, k, v = _inputs()
    sink = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    got = fused_attention(q, k, v, sink=sink, implementation="cudnn")
    _close(got, _f64_attention(q, k, v, sink=np.asarray(sink)), 2e-2)
    f = lambda impl: jax.grad(
        lambda s: jnp.sum(fused_attention(q, k, v, sink=s, implementation=impl).astype(jnp.float32))
    )(sink)  # noqa: E731
    np.testing.assert_allclose(np.asarray(f("cudnn")), np.asarray(f("reference")), rtol=5e-2, atol=5e-2)


def test_dropout_statistics_and_reproducibility():
    # v = identity-like rows: out[q] = sum_k keep*p/(1-r) * v[k]; with p uniform (q = 0) the kept
    # fraction of each row is visible in out's row sum.
    b, s, h, d, rate = 1, 256, 4, 64, 0.2
    q = jnp.zeros((b, s, h, d), jnp.bfloat16)
    k = jnp.zeros((b, s, h, d), jnp.bfloat16)
    v = jnp.ones((b, s, h, d), jnp.bfloat16)
    key = jax.random.PRNGKey(7)
    out = fused_attention(q, k, v, dropout_rate=rate, rng=key, implementation="cudnn")
    again = fused_attention(q, k, v, dropout_rate=rate, rng=key, implementation="cudnn")
    other = fused_attention(q, k, v, dropout_rate=rate, rng=jax.random.PRNGKey(8), implementation="cudnn")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    assert not np.array_equal(np.asarray(out), np.asarray(other))
    kept = np.asarray(out[..., 0], np.float64) * (1 - rate)  # fraction kept per row
    n = b * s * h
    # Each row averages s Bernoulli(1-rate) draws: its mean over rows is within 5 sigma of 1-rate.
    assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / (n * s))
    assert abs(kept.std() - np.sqrt(rate * (1 - rate) / s)) < 0.25 * np.sqrt(rate * (1 - rate) / s)


def test_dropout_inside_scan_with_remat_default_flags():
    q, k, v = _inputs(b=1, sq=64, sk=64, h=2, g=2)

    def layer(carry, key):
        f = jax.checkpoint(
            lambda x: fused_attention(x, k, v, dropout_rate=0.1, rng=key, implementation="cudnn")
        )
        return f(carry), None

    def loss(q):
        out, _ = jax.lax.scan(layer, q, jax.random.split(jax.random.PRNGKey(0), 3))
        return jnp.sum(out.astype(jnp.float32))

    val, grad = jax.jit(jax.value_and_grad(loss))(q)
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(grad, np.float32)))
    val2, _ = jax.jit(jax.value_and_grad(loss))(q)
    assert float(val) == float(val2)


def test_fp8_forward_and_backward_within_bounds():
    q, k, v = _inputs(b=2, sq=128, sk=128, h=4, g=4, d=128)
    amax = [float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (q, k, v)]
    sc = Fp8AttentionScales(
        *(jnp.float32(448 / a) for a in amax),
        jnp.float32(448.0),  # s in [0, 1]
        jnp.float32(448 / 4.0),  # o: |o| <= max |v|
        jnp.float32(57344 / 4.0),
        jnp.float32(57344 / 4.0),
        jnp.float32(57344 / 64.0),
        jnp.float32(57344 / 64.0),
        jnp.float32(57344 / 64.0),
    )
    got = fused_attention(q, k, v, causal=True, fp8=sc, implementation="cudnn")
    want = _f64_attention(q, k, v, causal=True)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert err.max() < 0.15 * np.abs(want).max() and err.mean() < 0.02, (err.max(), err.mean())
    dq = jax.grad(
        lambda x: jnp.sum(
            fused_attention(x, k, v, causal=True, fp8=sc, implementation="cudnn").astype(jnp.float32)
        )
    )(q)
    dq_ref = jax.grad(
        lambda x: jnp.sum(fused_attention(x, k, v, causal=True, implementation="cudnn").astype(jnp.float32))
    )(q)
    dq, dq_ref = np.asarray(dq, np.float64), np.asarray(dq_ref, np.float64)
    assert np.linalg.norm(dq - dq_ref) < 0.2 * np.linalg.norm(dq_ref)
