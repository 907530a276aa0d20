"""lowbit.te's MoE names against float64 NumPy references: the fused router (TE's test logits,
both routing-map formats), token_dispatch / token_combine (rows, probs, padding, row_id_map
layout, gradients), the pure-JAX dispatch and combine, sort_chunks_by_index, the ragged
all-to-all parameters, grouped_dense (with bias, BF16 and FP8), make_grouped_dense_cls,
get_moe_recv_capacity_per_rank, moe() and the Flax _MoEBlock."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
import lowbit.te as te
from lowbit.moe import moe_block

T, E, K, H = 16, 8, 2, 12


def _routing_map(seed, t=T, e=E, k=K):
    rng = np.random.default_rng(seed)
    m = np.zeros((t, e), bool)
    for i in range(t):
        m[i, rng.choice(e, k, replace=False)] = True
    return m


def te_logits(t, e, fn):
    """TE's test logits (tests/jax/test_fused_router.py's make_logits)."""
    if fn == "sigmoid":
        off = np.arange(-t // 2, t // 2) * 1e-4
        return (np.arange(-e // 2, e // 2)[None, :] * 1e-2 + off[:, None]).astype(np.float32)
    return (np.arange(-t * e // 2, t * e // 2) * 1e-4).reshape(t, e).astype(np.float32)


@pytest.mark.parametrize(
    "fn, pre, bias", [("softmax", False, False), ("softmax", True, False), ("sigmoid", False, True)]
)
def test_fused_topk_on_te_test_logits(fn, pre, bias):
    t, e, k = 128, 32, 4
    z = te_logits(t, e, fn)
    eb = np.flip(np.arange(e) * 0.1).astype(np.float32) if bias else None
    z64 = z.astype(np.float64)
    if fn == "softmax":
        s = np.exp(z64 - z64.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
        top = np.argsort(-(s if pre else z64), 1, kind="stable")[:, :k]
        zt = np.take_along_axis(z64, top, 1)
        w = np.take_along_axis(s, top, 1) if pre else np.exp(zt) / np.exp(zt).sum(1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-z64))
        top = np.argsort(-(s + eb), 1, kind="stable")[:, :k]
        w = np.take_along_axis(s, top, 1)
        w = w / w.sum(1, keepdims=True)
    want = np.zeros((t, e))
    np.put_along_axis(want, top, w, 1)
    probs, rmap = te.router.fused_topk_with_score_function(
        jnp.asarray(z),
        k,
        use_pre_softmax=pre,
        score_function=fn,
        expert_bias=None if eb is None else jnp.asarray(eb),
    )
    np.testing.assert_allclose(np.asarray(probs), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(rmap), want != 0)
    _, packed = te.router.fused_topk_with_score_function(
        jnp.asarray(z), k, score_function=te.router.ScoreFunction[fn.upper()], routing_map_format="bitmap_u8"
    )
    assert packed.dtype == jnp.uint8 and packed.shape == (t, e // 8)
    bits = np.unpackbits(np.asarray(packed), axis=1, bitorder="little").astype(bool)
    _, plain = te.router.fused_topk_with_score_function(jnp.asarray(z), k, score_function=fn)
    np.testing.assert_array_equal(bits, np.asarray(plain))


def test_fused_moe_aux_loss_and_argument_errors():
    p = np.asarray(jax.random.uniform(jax.random.PRNGKey(0), (T, E)), np.float32)
    c = np.arange(E, dtype=np.int32)
    got = te.router.fused_moe_aux_loss(jnp.asarray(p), jnp.asarray(c), K, 0.5)
    np.testing.assert_allclose(
        float(got), E * 0.5 / (K * T * T) * np.sum(p.astype(np.float64).sum(0) * c), rtol=1e-6
    )
    with pytest.raises(TypeError, match="scaling_factor"):
        te.router.fused_topk_with_score_function(jnp.zeros((T, E)), K, scaling_factor=jnp.float32(2))
    with pytest.raises(ValueError, match="routing_map_format"):
        te.router.fused_topk_with_score_function(jnp.zeros((T, E)), K, routing_map_format="bits")


def _dispatch64(x, m, probs, num_out, align):
    counts = m.sum(0)
    sizes = counts if align is None else -(-counts // align) * align
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = num_out if align is None else (num_out + E * (align - 1)) // align * align
    out, pp = np.zeros((rows, x.shape[1])), np.zeros(rows)
    seen = np.zeros(E, int)
    dest = -np.ones((T, E), int)
    for t in range(T):
        for e in range(E):
            if m[t, e]:
                r = starts[e] + seen[e]
                seen[e] += 1
                dest[t, e] = r
                if r < rows:
                    out[r], pp[r] = x[t], probs[t, e]
    return out, pp, dest, sizes


@pytest.mark.parametrize("align", [None, 4])
def test_token_dispatch_and_combine_match_numpy(align):
    m = _routing_map(0)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (T, H)), np.float32)
    probs = np.where(m, np.asarray(jax.random.uniform(jax.random.PRNGKey(2), (T, E)), np.float32), 0)
    out, pp, rid, pad, tpe = te.permutation.token_dispatch(
        jnp.asarray(x), jnp.asarray(m), T * K, probs=jnp.asarray(probs), align_size=align
    )
    want, want_p, dest, sizes = _dispatch64(x, m, probs, T * K, align)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(pp), want_p)
    np.testing.assert_array_equal(np.asarray(tpe), sizes)
    # TE's row_id_map: rows (unpadded) of the routed experts, their ids, then the count.
    rid = np.asarray(rid)
    assert rid.shape == (T, 2 * E + 1)
    for t in range(T):
        ex = np.nonzero(m[t])[0]
        n = len(ex)
        assert rid[t, -1] == n and list(rid[t, E : E + n]) == list(ex)
        unpadded = dest[t, ex] - (0 if pad is None else np.asarray(pad)[ex])
        assert list(rid[t, :n]) == list(unpadded)
    # combine: the weighted sum of each token's rows; its gradient the transposed map.
    y = np.asarray(jax.random.normal(jax.random.PRNGKey(3), out.shape), np.float32)
    comb = lambda a, p: te.permutation.token_combine(a, jnp.asarray(rid), p, pad)  # noqa: E731
    got = comb(jnp.asarray(y), jnp.asarray(probs))
    ref = np.zeros((T, H))
    for (t, e), r in np.ndenumerate(dest):
        if r >= 0:
            ref[t] += probs[t, e] * y[r]
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (T, H)), np.float32)
    dy = jax.vjp(lambda a: comb(a, jnp.asarray(probs)), jnp.asarray(y))[1](jnp.asarray(g))[0]
    want_dy = np.zeros(y.shape)
    for (t, e), r in np.ndenumerate(dest):
        if r >= 0:
            want_dy[r] += probs[t, e] * g[t]
    np.testing.assert_allclose(np.asarray(dy), want_dy, rtol=1e-5, atol=1e-6)
    dx = jax.vjp(
        lambda a: te.permutation.token_dispatch(a, jnp.asarray(m), T * K, align_size=align)[0], jnp.asarray(x)
    )
    dx = dx[1](jnp.asarray(y))[0]
    want_dx = np.zeros((T, H))
    for (t, e), r in np.ndenumerate(dest):
        if r >= 0:
            want_dx[t] += y[r]
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("align", [0, 8])
def test_pure_jax_dispatch_combine_round_trip(align):
    ex = np.stack([np.nonzero(r)[0] for r in _routing_map(5)]).astype(np.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, T // 2, H))
    w = jax.random.uniform(jax.random.PRNGKey(1), (T, K))
    xs, state, gs = te.permutation.pure_jax_token_dispatch(x, jnp.asarray(ex), E, K, align_size=align)
    assert xs.shape == (T * K + E * max(align - 1, 0), H) and state.num_real_tokens == T * K
    np.testing.assert_array_equal(np.asarray(gs) >= np.bincount(ex.reshape(-1), minlength=E), True)
    # Rows of expert e hold exactly the tokens routed to it, in token order.
    starts = np.concatenate([[0], np.cumsum(np.asarray(gs))[:-1]])
    for e in range(E):
        toks = np.nonzero((ex == e).any(1))[0]
        np.testing.assert_array_equal(
            np.asarray(xs)[starts[e] : starts[e] + len(toks)], np.asarray(x).reshape(T, H)[toks]
        )
    back = te.permutation.pure_jax_token_combine(xs, state, w, K, 2, T // 2)
    np.testing.assert_allclose(
        np.asarray(back).reshape(T, H),
        np.asarray(x).reshape(T, H) * np.asarray(w).sum(1, keepdims=True),
        rtol=1e-6,
    )


def test_ragged_all_to_all_params_and_local_permute():
    n, El = 4, 2
    counts = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (n, n * El), 0, 5), np.int32)
    m = counts.reshape(n, n, El).sum(2)  # [src, dst]
    for s in range(n):
        io, ss, oo, rs = te.permutation.compute_ragged_all_to_all_params(jnp.asarray(counts), s, n)
        np.testing.assert_array_equal(ss, m[s])
        np.testing.assert_array_equal(io, np.concatenate([[0], np.cumsum(m[s])[:-1]]))
        np.testing.assert_array_equal(rs, m[:, s])
        np.testing.assert_array_equal(oo, [m[:s, d].sum() for d in range(n)])
        io, ss, oo, rs = te.permutation.compute_reverse_ragged_all_to_all_params(jnp.asarray(counts), s, n)
        np.testing.assert_array_equal(ss, m[:, s])
        np.testing.assert_array_equal(rs, m[s])
        np.testing.assert_array_equal(oo, [m[d, :s].sum() for d in range(n)])
    s = 1
    cols = counts[:, s * El : (s + 1) * El]  # [source, local expert]
    rows = int(cols.sum())
    x = np.arange(rows + 3, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    out, gs, state = te.permutation.local_permute_after_a2a(jnp.asarray(x), jnp.asarray(counts), s, n)
    np.testing.assert_array_equal(gs, cols.sum(0))
    starts = np.concatenate([[0], np.cumsum(cols.reshape(-1))[:-1]]).reshape(n, El)
    want = np.concatenate(
        [np.arange(starts[src, e], starts[src, e] + cols[src, e]) for e in range(El) for src in range(n)]
    )
    np.testing.assert_array_equal(np.asarray(out)[:rows, 0], want)
    np.testing.assert_array_equal(te.permutation.local_unpermute_before_a2a(out, state), x)


@pytest.mark.parametrize("recipe", [None, lowbit.Float8CurrentScaling()], ids=["bf16", "current"])
def test_grouped_dense_matches_float64(recipe):
    from lowbit.te.quantize import noop_quantizer_set

    G, M, Kd, N = 4, 40, 32, 24
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (M, Kd)), np.float32)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (G, Kd, N)), np.float32)
    b = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (G, N)), np.float32)
    gs = np.array([10, 0, 20, 6], np.int32)  # 4 rows in no group: zero
    qs = noop_quantizer_set if recipe is None else te.quantize.quantizer_set_for_recipe(recipe)
    y = te.dense.grouped_dense(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs), bias=jnp.asarray(b), quantizer_set=qs
    )
    ref, r0 = np.zeros((M, N)), 0
    for g, n in enumerate(gs):
        ref[r0 : r0 + n] = x[r0 : r0 + n].astype(np.float64) @ w[g] + b[g]
        r0 += n
    tol = 2e-2 if recipe is None else 8e-2
    assert np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref) < tol
    mod = te.flax.make_grouped_dense_cls(recipe)
    v = mod.init(jax.random.PRNGKey(0), jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs))
    y2 = mod.apply(v, jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs))
    assert (
        np.linalg.norm(np.asarray(y2) - (ref - np.repeat(np.vstack([b, 0 * b[:1]]), [*gs, 4], 0)))
        / np.linalg.norm(ref)
        < tol
    )


def test_recv_capacity_per_rank():
    cap = te.moe.get_moe_recv_capacity_per_rank
    # worst case: 4 ranks x 1024 tokens, top-2 of 8 local experts: 8192 assignments + 8 x 127 padding -> 9216
    assert cap(num_experts=32, num_experts_per_tok=2, max_tokens_per_rank=1024, ep_size=4) == 9216
    # balanced: 1024 * 2 / 8 = 256 per expert, aligned 256, x8 = 2048; x1.5 = 3072
    assert (
        cap(
            num_experts=32,
            num_experts_per_tok=2,
            max_tokens_per_rank=1024,
            ep_size=4,
            recv_capacity_factor=1.5,
        )
        == 3072
    )
    with pytest.raises(ValueError, match="ep_size"):
        cap(num_experts=30, num_experts_per_tok=2, max_tokens_per_rank=8, ep_size=4)


def test_te_moe_and_flax_block_equal_lowbit_moe_block():
    B, S, F = 2, 8, 16
    x = jax.random.normal(jax.random.PRNGKey(0), (B, S, H))
    block = te.flax._MoEBlock(num_experts=E, num_experts_per_tok=K, intermediate_size=F, aux_loss_coeff=0.01)
    v = nn.unbox(block.init(jax.random.PRNGKey(1), x))
    p = v["params"]
    assert p["wi"].shape == (E, H, 2 * F) and p["wo"].shape == (E, F, H) and p["gate_kernel"].shape == (H, E)
    y, aux, routed = block.apply(v, x)
    want, want_aux, _ = moe_block(
        x, p["gate_kernel"], p["wi"], p["wo"], num_experts_per_tok=K, aux_loss_coeff=0.01
    )
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=1e-6)
    assert int(routed) == B * S * K
    y2, aux2, _ = te.moe.moe(
        x,
        p["gate_kernel"],
        p["wi"],
        p["wo"],
        num_experts=E,
        num_experts_per_tok=K,
        aux_loss_coeff=0.01,
        ep_axis="ep",
    )
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(want))
    _, none_aux, _ = te.moe.moe(
        x, p["gate_kernel"], p["wi"], p["wo"], num_experts=E, num_experts_per_tok=K, ep_axis="ep"
    )
    assert none_aux is None
    # DelayedScaling: one amax history per expert for each GEMM, in _overwrite_with_gradient.
    recipe = lowbit.DelayedScaling(amax_history_len=4)
    blk = lowbit.flax.MoEBlock(
        num_experts=E, num_experts_per_tok=K, intermediate_size=F, quantization_recipe=recipe
    )
    vd = nn.unbox(blk.init(jax.random.PRNGKey(1), x))
    st = vd["_overwrite_with_gradient"]
    assert st["fc1_state"]["kernel_amax_history"].shape == (4, E) and "fc2_state" in st
    with pytest.raises(ValueError, match="num_experts"):
        te.moe.moe(
            x, p["gate_kernel"], p["wi"], p["wo"], num_experts=E + 1, num_experts_per_tok=K, ep_axis="ep"
        )


def test_bad_permutation_arguments_name_the_argument():
    m, x = jnp.asarray(_routing_map(0)), jnp.zeros((T, H))
    P = te.permutation
    cases = [
        (lambda: P.token_dispatch(x[1:], m, T * K), ["inp", str(T - 1), "routing_map"]),
        (lambda: P.token_dispatch(x, m, 0), ["num_out_tokens"]),
        (lambda: P.token_dispatch(x, m, T * K, align_size=0), ["align_size"]),
        (lambda: P.token_dispatch(x[None, None], m, T * K), ["inp", "2-d or 3-d"]),
        (
            lambda: P.pure_jax_token_dispatch(x, jnp.zeros((T, K), jnp.int32), E, K + 1),
            ["num_experts_per_tok"],
        ),
        (
            lambda: P.compute_ragged_all_to_all_params(jnp.zeros((3, E), jnp.int32), 0, 4),
            ["num_expert_shards"],
        ),
    ]
    for thunk, words in cases:
        with pytest.raises(ValueError) as info:
            thunk()
        assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_te_moe_with_grouped_quantizer_sets_equals_moe_block(name):
    """TE's way to quantize moe(): QuantizerFactory.create_set(n_groups=E) (one DelayedScaling
    history per expert), the same step as lowbit's moe_block with that recipe; the sets'
    gradient is the block's updated state. Within FP8 bounds of the float32 block."""
    F = 16
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(ks[0], (2, 8, H))
    gate = jax.random.normal(ks[1], (H, E)) * 0.3
    wi = jax.random.normal(ks[2], (E, H, 2 * F)) * 0.3
    wo = jax.random.normal(ks[3], (E, F, H)) * 0.3
    r = lowbit.DelayedScaling(amax_history_len=4) if name == "delayed" else lowbit.Float8CurrentScaling()
    qs = te.quantize.QuantizerFactory.create_set(n_quantizer_sets=2, fp8_recipe=r, n_groups=E)
    state = (lowbit.init_grouped_delayed_state(r, E),) * 2 if name == "delayed" else None

    def te_loss(x, qs):
        y = te.moe.moe(
            x, gate, wi, wo, num_experts=E, num_experts_per_tok=K, quantizer_sets=qs, ep_axis="ep"
        )[0]
        return jnp.sum(y**2), y

    def lowbit_loss(x, state):
        y = moe_block(x, gate, wi, wo, num_experts_per_tok=K, recipe=r, state=state)[0]
        return jnp.sum(y**2), y

    (_, y), (dx, dqs) = jax.value_and_grad(te_loss, argnums=(0, 1), has_aux=True)(x, qs)
    (_, want), (dx_want, dstate) = jax.value_and_grad(lowbit_loss, argnums=(0, 1), has_aux=True)(x, state)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_want))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(moe_block(x, gate, wi, wo, num_experts_per_tok=K)[0], np.float64)
    assert np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref) < 0.1
    if name == "delayed":
        got = te.quantize.recipe_of(dqs[0])[1]
        assert got["kernel_amax_history"].shape == (4, E) and got["x_scale"].shape == (E,)
        for k, v in dstate[0].items():
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
    with pytest.raises(ValueError, match="n_groups"):
        te.quantize.QuantizerFactory.create_set(fp8_recipe=r, n_groups=0)
