"""lowbit.moe.permutation against a NumPy dispatch: the rows each (token, expert) pair lands in
(stable, token order inside an expert), alignment padding, capacity drops, the combine's
weighted sum, the round trip, and the gradients of both directions against the float64
transposes of the same linear maps; sort_chunks; bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.moe import permutation as perm

T, K, E, D = 24, 2, 6, 8


def _routing(seed, t=T, k=K, e=E):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


def dispatch64(experts, e, align=0, capacity=None, round_rows=False):
    """NumPy plan: (dest (T, k), rows, group sizes) by the documented rules."""
    t, k = experts.shape
    a = max(align, 1)
    counts = np.bincount(experts.reshape(-1), minlength=e)
    kept = counts if capacity is None else np.minimum(counts, capacity)
    sizes = -(-kept // a) * a
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = t * k + e * (a - 1)
    if round_rows:
        rows = -(-rows // a) * a
    if capacity is not None:
        rows = min(rows, e * (-(-capacity // a) * a))
    dest = np.full((t, k), rows)
    seen = np.zeros(e, int)
    for q in range(t * k):  # pairs in (token, slot) order
        ti, j = divmod(q, k)
        ex = experts[ti, j]
        if seen[ex] < kept[ex]:
            dest[ti, j] = offsets[ex] + seen[ex]
        seen[ex] += 1
    return dest, rows, sizes


def _matrix(dest, rows):
    """The permute map as a (rows, T) 0/1 matrix."""
    A = np.zeros((rows, dest.shape[0]))
    for (t, _), r in np.ndenumerate(dest):
        if r < rows:
            A[r, t] = 1
    return A


@pytest.mark.parametrize(
    "align, capacity, round_rows",
    [(0, None, False), (4, None, False), (0, 5, False), (8, 3, False), (16, None, True)],
)
def test_plan_permute_unpermute_match_numpy(align, capacity, round_rows):
    ex = _routing(0)
    dest, rows, sizes = dispatch64(ex, E, align, capacity, round_rows)
    plan = perm.plan_dispatch(jnp.asarray(ex), E, align_size=align, capacity=capacity, round_rows=round_rows)
    assert plan.src.shape == (rows,)
    if round_rows:
        assert rows % align == 0 and rows > T * K + E * (align - 1)  # 48 + 90 = 138 -> 144
    np.testing.assert_array_equal(np.asarray(plan.dest), dest)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes), sizes)
    np.testing.assert_array_equal(
        np.asarray(plan.tokens_per_expert), np.bincount(ex.reshape(-1), minlength=E)
    )
    if align:
        assert np.all(np.asarray(plan.group_sizes) % align == 0)

    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (T, D)), np.float32)
    w = np.asarray(jax.random.uniform(jax.random.PRNGKey(2), (T, K)), np.float32)
    A = _matrix(dest, rows)
    xs = perm.permute(jnp.asarray(x), plan)
    np.testing.assert_array_equal(np.asarray(xs), A @ x)  # padding and dropped rows are zero
    probs = perm.permute_probs(jnp.asarray(w), plan)
    want_p = np.zeros(rows)
    for (t, j), r in np.ndenumerate(dest):
        if r < rows:
            want_p[r] = w[t, j]
    np.testing.assert_array_equal(np.asarray(probs), want_p)

    y = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (rows, D)), np.float32)
    yp = np.vstack([y.astype(np.float64), np.zeros((1, D))])
    want = np.einsum("tk,tkd->td", w.astype(np.float64), yp[dest])
    got = perm.unpermute(jnp.asarray(y), plan, jnp.asarray(w), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)

    # Gradients: the transposes of the same linear maps, in float64.
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (rows, D)), np.float32)
    dx = jax.vjp(lambda a: perm.permute(a, plan), jnp.asarray(x))[1](jnp.asarray(g))[0]
    np.testing.assert_allclose(np.asarray(dx), A.T @ g.astype(np.float64), rtol=1e-6, atol=1e-6)
    c = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (T, D)), np.float32)
    _, vjp = jax.vjp(
        lambda a, b: perm.unpermute(a, plan, b, out_dtype=jnp.float32), jnp.asarray(y), jnp.asarray(w)
    )
    dy, dw = vjp(jnp.asarray(c))
    want_dy = np.zeros((rows + 1, D))
    for (t, j), r in np.ndenumerate(dest):
        want_dy[r] += w[t, j] * c[t]
    np.testing.assert_allclose(np.asarray(dy), want_dy[:rows], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("tkd,td->tk", yp[dest], c), rtol=1e-5, atol=1e-6)


def test_round_trip_is_the_weighted_identity():
    ex = _routing(3)
    plan = perm.plan_dispatch(jnp.asarray(ex), E, align_size=16)
    x = jax.random.normal(jax.random.PRNGKey(0), (T, D))
    w = jax.random.uniform(jax.random.PRNGKey(1), (T, K))
    back = perm.unpermute(perm.permute(x, plan), plan, w)
    np.testing.assert_allclose(
        np.asarray(back), np.asarray(x) * np.asarray(w).sum(1, keepdims=True), rtol=1e-6
    )
    plain = perm.unpermute(perm.permute(x, plan), plan)  # no weights: the plain sum
    np.testing.assert_allclose(np.asarray(plain), K * np.asarray(x), rtol=1e-6)


def test_dispatch_runs_under_jit_without_host_sync():
    ex = jnp.asarray(_routing(4))
    x = jax.random.normal(jax.random.PRNGKey(0), (T, D))

    @jax.jit
    def f(ex, x):
        plan = perm.plan_dispatch(ex, E, align_size=8)
        return perm.permute(x, plan), plan.group_sizes

    xs, sizes = f(ex, x)
    assert xs.shape == (T * K + E * 7, D) and int(jnp.sum(sizes)) <= xs.shape[0]


def test_sort_chunks_matches_numpy_and_its_gradient_is_the_inverse():
    sizes = np.array([3, 0, 2, 4], np.int32)
    order = np.array([2, 0, 3, 1], np.int32)
    n = 11  # two rows past the chunks stay put
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    want_rows = np.concatenate(
        [np.arange(starts[i], starts[i] + sizes[i]) for i in order] + [np.arange(9, n)]
    )
    out, row_map = perm.sort_chunks(jnp.asarray(x), jnp.asarray(sizes), jnp.asarray(order))
    np.testing.assert_array_equal(np.asarray(row_map), want_rows)
    np.testing.assert_array_equal(np.asarray(out), x[want_rows])
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (n, 2)), np.float32)
    dx = jax.vjp(lambda a: perm.sort_chunks(a, jnp.asarray(sizes), jnp.asarray(order))[0], jnp.asarray(x))[1](
        jnp.asarray(g)
    )[0]
    want = np.zeros_like(g)
    want[want_rows] = g
    np.testing.assert_array_equal(np.asarray(dx), want)


def test_bad_dispatch_arguments_name_the_argument():
    ex = jnp.asarray(_routing(0))
    with pytest.raises(ValueError, match="experts"):
        perm.plan_dispatch(ex.astype(jnp.float32), E)
    with pytest.raises(ValueError, match="align_size"):
        perm.plan_dispatch(ex, E, align_size=-1)
    with pytest.raises(ValueError, match="capacity"):
        perm.plan_dispatch(ex, E, capacity=0)
    with pytest.raises(ValueError, match="round_rows must be a bool"):
        perm.plan_dispatch(ex, E, align_size=16, round_rows="yes")
    plan = perm.plan_dispatch(ex, E)
    with pytest.raises(ValueError, match="permute: x"):
        perm.permute(jnp.zeros((T + 1, D)), plan)
    with pytest.raises(ValueError, match="unpermute: y"):
        perm.unpermute(jnp.zeros((T, D)), plan)
    with pytest.raises(ValueError, match="weights"):
        perm.unpermute(jnp.zeros((T * K, D)), plan, jnp.ones((T, K + 1)))
