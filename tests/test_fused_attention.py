"""lowbit.ops.fused_attention on the CPU (its reference path): the same result as
attention_reference, a float64 oracle for values and gradients (GQA, causal, padding, bias,
sinks), the FP8 simulation's bounds, and argument errors that name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.flax.attention_paths import attention_reference
from lowbit.ops.fused_attention import Fp8AttentionScales, fused_attention, padding_mask

B, SQ, SK, H, G, D = 2, 5, 7, 4, 2, 8


def _inputs(dtype=jnp.float32, sq=SQ, sk=SK, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, sq, H, D))
    k = r.standard_normal((B, sk, G, D))
    v = r.standard_normal((B, sk, G, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def oracle(q, k, v, bias=None, causal=False, lq=None, lk=None, scale=None, sink=None):
    """float64 attention, written independently of the op (per head loops over numpy)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, h, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi // (h // g)].T * scale
            if bias is not None:
                bb = np.asarray(bias, np.float64)
                s = s + bb[bi % bb.shape[0], hi % bb.shape[1]]
            keep = np.ones((sq, sk), bool)
            if causal:
                keep &= np.tril(np.ones((sq, sk), bool))
            if lq is not None:
                keep[lq[bi] :] = False
                keep[:, lk[bi] :] = False
            s = np.where(keep, s, -np.inf)
            m = s.max(-1, keepdims=True)
            if sink is not None:
                m = np.maximum(m, sink[hi])
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.where(keep, np.exp(s - m), 0.0)
            den = e.sum(-1, keepdims=True) + (np.exp(sink[hi] - m) if sink is not None else 0.0)
            p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
            out[bi, :, hi] = p @ v[bi, :, hi // (h // g)]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_matches_attention_reference_and_oracle(causal):
    q, k, v = _inputs()
    lq, lk = jnp.array([5, 3], jnp.int32), jnp.array([7, 4], jnp.int32)
    got = fused_attention(q, k, v, causal=causal, seqlens_q=lq, seqlens_kv=lk)
    masked = padding_mask(lq, lk, SQ, SK, causal)
    ref = attention_reference(q, k, v, masked, None, "post_scale_bias", 1 / np.sqrt(D), 0.0, None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_allclose(np.asarray(got), oracle(q, k, v, None, causal, lq, lk), atol=2e-6)


def test_dropout_equals_attention_reference():
    q, k, v = _inputs(sq=6, sk=6)
    key = jax.random.PRNGKey(3)
    got = fused_attention(q, k, v, causal=True, dropout_rate=0.25, rng=key)
    ref = attention_reference(
        q, k, v, None, None, "post_scale_bias", 1 / np.sqrt(D), 0.25, key, plain_causal=True
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_bias_and_gradients_against_float64():
    q, k, v = _inputs()
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, H, SQ, SK)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((B, SQ, H, D)), jnp.float32)

    def loss(fn, *a):
        return jnp.sum(fn(*a) * ct)

    grads = jax.grad(
        lambda *a: loss(lambda *x: fused_attention(*x, causal=True, scale=0.3), *a), argnums=(0, 1, 2, 3)
    )(q, k, v, bias)
    with jax.enable_x64():
        f64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, bias)]

        def ref(q, k, v, bias):
            h_per = H // G
            kk, vv = jnp.repeat(k, h_per, axis=2), jnp.repeat(v, h_per, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3 + bias
            s = jnp.where(jnp.tril(jnp.ones((SQ, SK), bool)), s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), vv)

        want = jax.grad(
            lambda *a: jnp.sum(ref(*a) * jnp.asarray(np.asarray(ct), jnp.float64)), argnums=(0, 1, 2, 3)
        )(*f64)
        np.testing.assert_allclose(
            np.asarray(fused_attention(q, k, v, bias, causal=True, scale=0.3)),
            np.asarray(ref(*f64)),
            atol=2e-6,
        )
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


def test_sink_against_float64():
    q, k, v = _inputs()
    sink = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    lq, lk = jnp.array([5, 2], jnp.int32), jnp.array([7, 3], jnp.int32)
    got = fused_attention(q, k, v, seqlens_q=lq, seqlens_kv=lk, sink=sink)
    np.testing.assert_allclose(
        np.asarray(got), oracle(q, k, v, lq=lq, lk=lk, sink=np.asarray(sink)), atol=2e-6
    )
    # The sink's gradient: d/d sink of sum(out) equals a float64 finite difference.
    f = lambda s: jnp.sum(fused_attention(q, k, v, sink=s))  # noqa: E731
    g = jax.grad(f)(sink)
    eps = 1e-3
    for i in range(H):
        e = np.zeros(H)
        e[i] = eps
        fd = (
            oracle(q, k, v, sink=np.asarray(sink) + e).sum()
            - oracle(q, k, v, sink=np.asarray(sink) - e).sum()
        ) / (2 * eps)
        np.testing.assert_allclose(float(g[i]), fd, rtol=1e-3, atol=1e-4)


def test_fp8_simulation_within_bounds():
    q, k, v = _inputs(jnp.bfloat16)
    sc = Fp8AttentionScales(*(jnp.float32(x) for x in (64, 64, 64, 448, 64, 1, 1, 1, 1, 1)))
    got = np.asarray(fused_attention(q, k, v, causal=True, fp8=sc), np.float64)
    want = oracle(q, k, v, causal=True)
    # E4M3 keeps 3 mantissa bits: relative error 2^-4 per operand, a few in the product.
    assert np.max(np.abs(got - want)) < 0.25 * np.max(np.abs(want))
    assert np.mean(np.abs(got - want)) < 0.05


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q=np.zeros((2, 5, 4))), "q must be \\(batch, seq, heads, head_dim\\)"),
        (dict(k=np.zeros((2, 7, 3, 8), np.float32)), "multiple of k's and v's heads"),
        (dict(k=np.zeros((2, 7, 2, 4), np.float32)), "head_dim"),
        (dict(bias=np.zeros((2, 3, 5, 7), np.float32)), "bias must be"),
        (dict(seqlens_q=np.array([1, 2])), "given together"),
        (dict(seqlens_q=np.array([1, 2, 3]), seqlens_kv=np.array([1, 2, 3])), "seqlens_q must be"),
        (dict(dropout_rate=0.1), "needs rng"),
        (dict(dropout_rate=1.0, rng=jax.random.PRNGKey(0)), "dropout_rate must be in"),
        (dict(sink=np.zeros((3,), np.float32)), "sink must be"),
        (dict(implementation="bogus"), "implementation must be"),
        (dict(fp8=(1.0,)), "fp8 must be an Fp8AttentionScales"),
    ],
)
def test_bad_input_names_argument(kwargs, match):
    q, k, v = _inputs()
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    if "k" in args and args["k"] is not k:
        args["v"] = args["k"]
    with pytest.raises((ValueError, TypeError), match=match):
        fused_attention(args["q"], args["k"], args["v"], **kwargs)


def test_cudnn_requested_without_gpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    q, k, v = _inputs(jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run here: no GPU backend"):
        fused_attention(q, k, v, implementation="cudnn")
