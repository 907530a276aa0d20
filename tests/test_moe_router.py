"""lowbit.moe.router against a float64 NumPy router (TE's fused-router semantics): the three score
functions, pre/post softmax, grouped top-k, expert bias, scaling; the aux scores and the aux
loss; every gradient against float64 central differences of the NumPy reference (the choice
held fixed); bad arguments name themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.moe import router

T, E = 12, 16


def _scores64(z, fn):
    if fn == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if fn == "sqrtsoftplus":
        return np.sqrt(np.log1p(np.exp(z)))
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _topk_idx(v, k):
    return np.argsort(-v, axis=-1, kind="stable")[:, :k]


def _select64(choice, k, groups, gtopk):
    if groups:
        g = choice.reshape(choice.shape[0], groups, -1)
        gs = -np.sort(-g, axis=-1)[..., : k // gtopk].sum(-1)
        best = _topk_idx(gs, gtopk)
        mask = np.zeros_like(gs, bool)
        np.put_along_axis(mask, best, True, axis=1)
        choice = np.where(np.repeat(mask, g.shape[2], axis=1), choice, -np.inf)
    return _topk_idx(choice, k)


def route64(z, k, fn="softmax", pre=False, groups=None, gtopk=None, scale=1.0, bias=None, idx=None):
    """float64 (dense probs (T, E), chosen indices); ``idx`` fixes the choice (for differences)."""
    z = np.asarray(z, np.float64)
    if fn == "softmax" and not pre:
        idx = _select64(z, k, groups, gtopk) if idx is None else idx
        w = _scores64(np.take_along_axis(z, idx, 1), "softmax")
    else:
        s = _scores64(z, fn)
        choice = s if bias is None else s + bias
        idx = _select64(choice, k, groups, gtopk) if idx is None else idx
        w = np.take_along_axis(s, idx, 1)
        if fn != "softmax" and k > 1:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
    dense = np.zeros_like(z)
    np.put_along_axis(dense, idx, w * scale, axis=1)
    return dense, idx


def _logits(seed):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (T, E)), np.float32) * 2


def _num_grad(f, z, eps=1e-6):
    g = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        d = np.zeros_like(z)
        d[i] = eps
        g[i] = (f(z + d) - f(z - d)) / (2 * eps)
    return g


CASES = [
    dict(fn="softmax", k=2),
    dict(fn="softmax", k=4, pre=True),
    dict(fn="sigmoid", k=4),
    dict(fn="sigmoid", k=1),
    dict(fn="sqrtsoftplus", k=4),
    dict(fn="sigmoid", k=4, bias=True),
    dict(fn="sqrtsoftplus", k=4, groups=4, gtopk=2, bias=True, scale=2.5),
    dict(fn="softmax", k=4, groups=4, gtopk=2),
    dict(fn="softmax", k=4, pre=True, groups=8, gtopk=4, scale=1.2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_topk_routing_matches_float64(case):
    z = _logits(1)
    bias = np.linspace(0.3, -0.3, E).astype(np.float32) if case.get("bias") else None
    kw = dict(fn=case["fn"], pre=case.get("pre", False), groups=case.get("groups"), gtopk=case.get("gtopk"))
    kw.update(scale=case.get("scale", 1.0), bias=bias)
    ref, idx = route64(z, case["k"], **kw)
    call = dict(
        score_function=kw["fn"], use_pre_softmax=kw["pre"], num_groups=kw["groups"], group_topk=kw["gtopk"],
        scaling_factor=kw["scale"], expert_bias=None if bias is None else jnp.asarray(bias),
    )  # fmt: skip
    w, e = router.topk_routing(jnp.asarray(z), case["k"], **call)
    probs, rmap = router.to_dense(w, e, E)
    np.testing.assert_array_equal(np.asarray(rmap), ref != 0)
    np.testing.assert_allclose(np.asarray(probs), ref, rtol=2e-6, atol=1e-7)
    assert e.dtype == jnp.int32 and w.dtype == jnp.float32

    # d<probs, R>/dlogits against central differences of the reference (choice fixed).
    R = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (T, E)), np.float64)
    grad = jax.grad(lambda q: jnp.sum(router.to_dense(*router.topk_routing(q, case["k"], **call), E)[0] * R))
    got = np.asarray(grad(jnp.asarray(z)), np.float64)
    want = _num_grad(lambda q: np.sum(route64(q, case["k"], **kw, idx=idx)[0] * R), z.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if bias is not None:  # the bias steers the choice only
        gb = jax.grad(
            lambda b: jnp.sum(router.topk_routing(jnp.asarray(z), case["k"], **{**call, "expert_bias": b})[0])
        )(jnp.asarray(bias))
        assert not np.any(np.asarray(gb))


@pytest.mark.parametrize("fn", router.SCORE_FUNCTIONS)
def test_aux_scores_and_loss_match_float64(fn):
    z, k, coeff = _logits(2), 3, 0.01

    def scores64(q):
        s = _scores64(q, fn)
        return s if fn == "softmax" else s / (s.sum(-1, keepdims=True) + 1e-20)

    s, rmap = router.aux_scores(jnp.asarray(z), k, fn)
    np.testing.assert_allclose(np.asarray(s), scores64(z.astype(np.float64)), rtol=2e-6, atol=1e-7)
    top = _topk_idx(scores64(z.astype(np.float64)), k)
    want_map = np.zeros((T, E), bool)
    np.put_along_axis(want_map, top, True, axis=1)
    np.testing.assert_array_equal(np.asarray(rmap), want_map)

    counts = want_map.sum(0)

    def loss64(q):
        return E * coeff / (k * T * T) * np.sum(scores64(q).sum(0) * counts)

    def loss(q):
        sc, _ = router.aux_scores(q, k, fn)
        return router.aux_loss(sc, jnp.asarray(counts, jnp.int32), k, coeff)

    np.testing.assert_allclose(float(loss(jnp.asarray(z))), loss64(z.astype(np.float64)), rtol=1e-5)
    got = np.asarray(jax.grad(loss)(jnp.asarray(z)), np.float64)
    np.testing.assert_allclose(got, _num_grad(loss64, z.astype(np.float64)), rtol=1e-4, atol=1e-9)


def test_aux_loss_formula_and_gradient():
    probs = np.asarray(jax.random.uniform(jax.random.PRNGKey(3), (T, E)), np.float32)
    counts = np.arange(E, dtype=np.int32)
    k, coeff = 2, 0.1
    got = router.aux_loss(jnp.asarray(probs), jnp.asarray(counts), k, coeff)
    want = E * coeff / (k * T * T) * np.sum(probs.astype(np.float64).sum(0) * counts)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    g = jax.grad(router.aux_loss)(jnp.asarray(probs), jnp.asarray(counts), k, coeff)
    np.testing.assert_allclose(
        np.asarray(g), np.broadcast_to(E * coeff / (k * T * T) * counts, (T, E)), rtol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(topk=0), ["topk"]),
        (dict(topk=E + 1), ["topk", str(E)]),
        (dict(topk=4, num_groups=4), ["group_topk"]),
        (dict(topk=4, num_groups=5, group_topk=2), ["num_groups", "5"]),
        (dict(topk=4, num_groups=4, group_topk=3), ["group_topk", "3"]),
        (dict(topk=2, expert_bias=jnp.zeros(E)), ["expert_bias", "softmax"]),
        (dict(topk=2, score_function="sigmoid", expert_bias=jnp.zeros(E + 1)), ["expert_bias", str(E)]),
        (dict(topk=2, score_function="relu"), ["score_function", "relu"]),
    ],
)
def test_bad_routing_arguments_name_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        router.topk_routing(jnp.zeros((T, E)), **kwargs)
    assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)


def test_bad_logits_and_aux_arguments():
    with pytest.raises(ValueError, match="logits"):
        router.topk_routing(jnp.zeros((T, E, 1)), 2)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        router.aux_loss(jnp.zeros((T, E)), jnp.zeros((E + 1,), jnp.int32), 2, 0.1)
