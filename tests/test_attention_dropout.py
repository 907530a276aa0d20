"""Attention dropout on lowbit.ops.attention's path (issue 26): the mask is a function of the rng
key (the same key gives the same output, on every path; inside nn.scan each layer draws its own),
the dropped probabilities' statistics against float64 (keep rate, mean P, variance
P^2 r / (1 - r)), gradients under remat equal to those without, and a registered implementation
becoming the default path for the calls its predicate takes."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from attention_ref import attend64, to64
from helpers import randn, rel

from lowbit.flax.attention import DotProductAttention
from lowbit.ops.attention import attention, dispatch, register_implementation

B, S, H, D, RATE = 2, 8, 2, 8, 0.25


def test_dropped_probabilities_statistics_float64():
    """v = identity: the output rows are the dropped probabilities themselves."""
    q, k = randn((1, S, H, D), 1), randn((1, S, H, D), 2)
    v = jnp.broadcast_to(jnp.eye(S, D)[None, :, None, :], (1, S, H, D))
    with jax.enable_x64(True):
        p = np.asarray(attend64(*to64(q, k, v), 1 / math.sqrt(D)))  # the undropped P, float64
    run = jax.jit(
        jax.vmap(lambda key: attention(q, k, v, scale=1 / math.sqrt(D), dropout_rate=RATE, rng=key))
    )
    n = 4000
    got = np.asarray(run(jax.random.split(jax.random.PRNGKey(0), n)), np.float64)
    kept = got != 0
    assert abs(kept.mean() - (1 - RATE)) < 4 * math.sqrt(RATE * (1 - RATE) / kept.size)
    mean, var = got.mean(0), got.var(0)
    want_var = p**2 * RATE / (1 - RATE)
    assert np.max(np.abs(mean - p) / np.sqrt(want_var / n)) < 5  # within 5 standard errors
    assert rel(var, want_var) < 0.1
    # one draw equals the float64 reference with the mask read off it
    with jax.enable_x64(True):
        one = np.asarray(got[0])
        ref = np.where(kept[0], p / (1 - RATE), 0.0)
    assert rel(one, ref) < 1e-5


def test_mask_from_key_and_remat():
    q, k, v = randn((B, S, H, D), 1), randn((B, S, H, D), 2), randn((B, S, H, D), 3)
    m = DotProductAttention(
        D, H, attention_dropout=RATE, softmax_type="off_by_one", transpose_batch_sequence=False
    )

    def loss(q, k, v, key):
        return jnp.sum(m.apply({}, q, k, v, rngs={"dropout": key}) ** 2)

    key = jax.random.PRNGKey(3)
    a = m.apply({}, q, k, v, rngs={"dropout": key})
    np.testing.assert_array_equal(a, m.apply({}, q, k, v, rngs={"dropout": key}))
    assert rel(a, m.apply({}, q, k, v, rngs={"dropout": jax.random.PRNGKey(4)})) > 1e-2
    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, key)
    g_remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v, key)
    for x, y in zip(g, g_remat):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_dropout_inside_nn_scan():
    """nn.scan over layers: each layer its own mask, the result reproducible from the key."""

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = DotProductAttention(
                D, H, attention_dropout=RATE, softmax_type="off_by_one", transpose_batch_sequence=False
            )(x, x, x)
            return y, y

    Stack = nn.scan(
        Layer, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=3
    )
    x = randn((B, S, H, D), 1)
    p = Stack().init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x, None)
    run = jax.jit(lambda key: Stack().apply(p, x, None, rngs={"dropout": key})[1])
    ys = run(jax.random.PRNGKey(5))
    np.testing.assert_array_equal(ys, run(jax.random.PRNGKey(5)))
    assert rel(ys[0], ys[1]) > 1e-2 and np.all(np.isfinite(ys))


def test_registered_implementation_becomes_the_default(monkeypatch):
    """A registered implementation (as lowbit's cuDNN op will be) runs every call its predicate
    takes, dropout inside lax.scan included; implementation="xla" still forces the jnp path."""
    calls = []

    def fake(q, k, v, spec, arrays):
        calls.append(spec)
        return dispatch._REGISTRY["xla"].fn(q, k, v, spec, arrays)

    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    register_implementation("fake_cudnn", fake, lambda spec: spec.dropout_rate > 0, priority=10)
    q = randn((B, S, H, D), 1)
    m = DotProductAttention(D, H, attention_dropout=RATE, transpose_batch_sequence=False)
    out = jax.jit(
        lambda key: jax.lax.scan(lambda c, _: (c, m.apply({}, q, q, q, rngs={"dropout": key})), 0, None, 2)[1]
    )(jax.random.PRNGKey(0))
    assert calls and calls[0].dropout_rate == RATE and calls[0].mask_type == "causal"
    assert np.all(np.isfinite(out))
    calls.clear()
    m.apply({}, q, q, q, deterministic=True)  # no dropout: the predicate declines
    assert not calls
    DotProductAttention(
        D, H, attention_dropout=RATE, transpose_batch_sequence=False, implementation="xla"
    ).apply({}, q, q, q, rngs={"dropout": jax.random.PRNGKey(0)})
    assert not calls
