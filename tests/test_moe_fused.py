"""lowbit.moe's fused kernels (impl="fused") against float64 NumPy references and against the
XLA path: the router (every score function, pre-softmax, expert bias, grouped top-k, scaling)
and its gradient, the dispatch plan (bit-equal, with alignment and capacity), the permutation
and its gradient (bit-equal), the weighted combine and its gradients, the FP8 dispatch
(permute_quantize, bit-equal to grouped_quantize of the permuted rows), the MoE block under
lowbit.moe.kernels("fused"), and bad arguments. Each runs on the CPU and (gpu marker) the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on, to_cpu

import lowbit
from lowbit.moe import kernels, permute, permute_quantize, plan_dispatch, topk_routing, unpermute
from lowbit.ops.fused.permutation import buffer_rows
from lowbit.quantization.scaling_modes import ScalingMode

T, E, K, D = 48, 16, 4, 32


def _logits(seed, t=T, e=E):
    return jax.random.normal(jax.random.PRNGKey(seed), (t, e), jnp.float32) * 2.0


def _sp(z):
    return np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))


def router64(z, k, fn="softmax", pre=False, groups=None, gtopk=None, scaling=1.0, bias=None):
    """NumPy float64 router by the documented rules: (weights, experts)."""
    z = np.asarray(z, np.float64)
    t, e = z.shape
    W, I = np.zeros((t, k)), np.zeros((t, k), int)
    for i in range(t):
        zi = z[i]
        if fn == "softmax":
            s = np.exp(zi - zi.max()) / np.exp(zi - zi.max()).sum()
            c = s if pre else zi
        else:
            s = 1 / (1 + np.exp(-zi)) if fn == "sigmoid" else np.sqrt(_sp(zi))
            c = s + (0 if bias is None else np.asarray(bias, np.float64))
        allowed = np.ones(e, bool)
        if groups:
            per = e // groups
            gs = [np.sort(c[g * per : (g + 1) * per])[::-1][: k // gtopk].sum() for g in range(groups)]
            keep = np.argsort(-np.array(gs), kind="stable")[:gtopk]
            allowed = np.isin(np.arange(e) // per, keep)
        order = sorted(np.flatnonzero(allowed), key=lambda j: (-c[j], j))[:k]
        I[i] = order
        if fn == "softmax" and not pre:
            w = np.exp(zi[order] - zi[order].max())
            w = w / w.sum()
        else:
            w = s[order]
            if fn != "softmax" and k > 1:
                w = w / (w.sum() + 1e-20)
        W[i] = w * scaling
    return W, I


ROUTERS = [
    dict(),
    dict(use_pre_softmax=True),
    dict(score_function="sigmoid"),
    dict(score_function="sqrtsoftplus", scaling_factor=2.5),
    dict(score_function="sigmoid", num_groups=4, group_topk=2),
    dict(score_function="sqrtsoftplus", num_groups=8, group_topk=4, expert_bias="bias"),
]


def _kw(cfg):
    kw = dict(cfg)
    if kw.get("expert_bias") == "bias":
        kw["expert_bias"] = jnp.linspace(-0.3, 0.3, E, dtype=jnp.float32)
    return kw


@pytest.mark.parametrize(
    "cfg", ROUTERS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "softmax"
)
def test_router_fused_matches_float64(device, cfg):
    kw = _kw(cfg)
    z = _logits(1)
    w, ex = to_cpu(run_on(device, lambda z: topk_routing(z, K, impl="fused", **kw), z))
    ref_w, ref_i = router64(
        z, K, kw.get("score_function", "softmax"), kw.get("use_pre_softmax", False), kw.get("num_groups"),
        kw.get("group_topk"), kw.get("scaling_factor", 1.0), kw.get("expert_bias"),
    )  # fmt: skip
    np.testing.assert_array_equal(ex, ref_i)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)
    xw, xi = to_cpu(run_on(device, lambda z: topk_routing(z, K, impl="xla", **kw), z))
    np.testing.assert_array_equal(ex, xi)
    np.testing.assert_allclose(w, xw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "cfg", ROUTERS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "softmax"
)
def test_router_fused_gradient(device, cfg):
    """The logits' gradient through the weights: against the XLA path's autodiff, and against a
    float64 central difference of the float64 reference (the choice held fixed)."""
    kw = _kw(cfg)
    z = _logits(2, t=8)
    ct = jax.random.normal(jax.random.PRNGKey(3), (8, K), jnp.float32)

    def loss(impl):
        return lambda z: jnp.sum(topk_routing(z, K, impl=impl, **kw)[0] * ct)

    g_f = to_cpu(run_on(device, jax.grad(loss("fused")), z))
    g_x = to_cpu(run_on(device, jax.grad(loss("xla")), z))
    np.testing.assert_allclose(g_f, g_x, rtol=1e-5, atol=1e-6)
    args = (K, kw.get("score_function", "softmax"), kw.get("use_pre_softmax", False), kw.get("num_groups"),
            kw.get("group_topk"), kw.get("scaling_factor", 1.0), kw.get("expert_bias"))  # fmt: skip
    z64 = np.asarray(z, np.float64)
    idx = router64(z64, *args)[1]
    h, ref = 1e-6, np.zeros_like(z64)
    for i in range(z64.shape[0]):
        for j in range(E):
            zp, zm = z64.copy(), z64.copy()
            zp[i, j] += h
            zm[i, j] -= h
            wp, ip = router64(zp[i : i + 1], *args)
            wm, im = router64(zm[i : i + 1], *args)
            if (ip == idx[i]).all() and (im == idx[i]).all():
                ref[i, j] = np.sum((wp - wm)[0] * np.asarray(ct, np.float64)[i]) / (2 * h)
    np.testing.assert_allclose(g_f, ref, rtol=1e-4, atol=1e-5)


def _routing(seed, t=T, k=K, e=E):
    return jax.lax.top_k(_logits(seed, t, e), k)[1].astype(jnp.int32)


@pytest.mark.parametrize(
    "align,capacity,round_rows",
    [(0, None, False), (8, None, False), (0, 9, False), (16, 7, False), (16, None, True)],
)
def test_plan_fused_bit_equal(device, align, capacity, round_rows):
    ex = _routing(4)
    kw = dict(align_size=align, capacity=capacity, round_rows=round_rows)
    f = to_cpu(run_on(device, lambda e: plan_dispatch(e, E, impl="fused", **kw), ex))
    x = to_cpu(run_on(device, lambda e: plan_dispatch(e, E, impl="xla", **kw), ex))
    for name in ("dest", "src", "group_sizes", "offsets", "tokens_per_expert"):
        np.testing.assert_array_equal(getattr(f, name), getattr(x, name), err_msg=name)


def test_plan_fused_many_chunks(device):
    """More pairs than one CUDA chunk (1024): the chunk prefix sums keep the token order."""
    ex = _routing(5, t=700, k=3, e=40)
    f = to_cpu(run_on(device, lambda e: plan_dispatch(e, 40, align_size=16, impl="fused"), ex))
    x = to_cpu(run_on(device, lambda e: plan_dispatch(e, 40, align_size=16, impl="xla"), ex))
    np.testing.assert_array_equal(f.dest, x.dest)
    np.testing.assert_array_equal(f.src, x.src)


# d = 32: the GPU's 16-byte vector row kernels; d = 36: their scalar fallback.
@pytest.mark.parametrize("d", [D, D + 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_permute_fused_bit_equal_with_gradient(device, dtype, d):
    ex = _routing(6)
    x = jax.random.normal(jax.random.PRNGKey(7), (T, d), dtype)
    g = jax.random.normal(jax.random.PRNGKey(8), (T * K + E * 7, d), dtype)

    def f(impl):
        def run(x, ex, g):
            plan = plan_dispatch(ex, E, align_size=8)
            y, vjp = jax.vjp(lambda x: permute(x, plan, impl=impl), x)
            return y, vjp(g)[0]

        return to_cpu(run_on(device, run, x, ex, g))

    (yf, dxf), (yx, dxx) = f("fused"), f("xla")
    np.testing.assert_array_equal(yf, yx)
    np.testing.assert_array_equal(dxf, dxx)


@pytest.mark.parametrize("d", [D, D + 4])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_combine_fused_matches_float64(device, out_dtype, d):
    ex = _routing(9)
    rows = buffer_rows(T * K, E, 4, 11)
    y = jax.random.normal(jax.random.PRNGKey(10), (rows, d), jnp.bfloat16)
    w = jax.random.uniform(jax.random.PRNGKey(11), (T, K), jnp.float32)
    g = jax.random.normal(jax.random.PRNGKey(12), (T, d), out_dtype)

    def run(y, w, g, ex):
        plan = plan_dispatch(ex, E, align_size=4, capacity=11)
        out, vjp = jax.vjp(lambda y, w: unpermute(y, plan, w, out_dtype, impl="fused"), y, w)
        return out, *vjp(g), plan.dest

    out, dy, dw, dest = to_cpu(run_on(device, run, y, w, g, ex))
    y64, w64, g64 = (np.asarray(a, np.float64) for a in (y, w, g))
    y0 = np.concatenate([y64, np.zeros((1, d))])
    ref = np.einsum("tkd,tk->td", y0[dest], w64)
    tol = dict(rtol=1e-2, atol=1e-2) if out_dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, **tol)
    dy_ref = np.zeros_like(y0)
    for t in range(T):
        for j in range(K):
            dy_ref[dest[t, j]] += w64[t, j] * g64[t]
    np.testing.assert_allclose(np.asarray(dy, np.float64), dy_ref[:-1], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dw, np.einsum("tkd,td->tk", y0[dest], g64), rtol=1e-5, atol=1e-4)

    # against the XLA path: dy bit-equal (one product, one rounding)
    def xla_vjp(y, w, g, ex):
        plan = plan_dispatch(ex, E, align_size=4, capacity=11)
        return jax.vjp(lambda y, w: unpermute(y, plan, w, out_dtype, impl="xla"), y, w)[1](g)

    xla = to_cpu(run_on(device, xla_vjp, y, w, g, ex))
    np.testing.assert_array_equal(dy, xla[0])


@pytest.mark.parametrize("mode", ["delayed", "current"])
@pytest.mark.parametrize("q", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_permute_quantize_equals_grouped_quantize(device, mode, q):
    ex = _routing(13)
    x = jax.random.normal(jax.random.PRNGKey(14), (T, 64), jnp.bfloat16) * 3
    sm = ScalingMode.DELAYED_TENSOR_SCALING if mode == "delayed" else ScalingMode.CURRENT_TENSOR_SCALING
    scale = jnp.linspace(10.0, 60.0, E, dtype=jnp.float32) if mode == "delayed" else None

    def run(x, ex, scale):
        plan = plan_dispatch(ex, E, align_size=16)
        a = permute_quantize(x, plan, ex, sm, q, scale=scale, layout="both")
        b = lowbit.grouped_quantize(permute(x, plan), plan.group_sizes, sm, q, scale=scale, layout="both")
        return a, b

    a, b = to_cpu(run_on(device, run, x, ex, scale))
    for name in ("data", "colwise_data", "scale_inv", "colwise_scale_inv", "amax"):
        np.testing.assert_array_equal(
            np.asarray(getattr(a, name)).view(np.uint8) if "data" in name else getattr(a, name),
            np.asarray(getattr(b, name)).view(np.uint8) if "data" in name else getattr(b, name),
            err_msg=name,
        )


def test_permute_fp8_current_ignores_delayed_scales(device):
    """Current scaling derives each expert's scale from its amax even when a delayed-scale array
    reaches the kernel (the CUDA kernel used any scales it was given, whatever the mode)."""
    from lowbit.ops._ffi import moe as moe_ffi

    ex = _routing(16)
    x = jax.random.normal(jax.random.PRNGKey(17), (T, 64), jnp.bfloat16) * 3
    delayed = jnp.linspace(10.0, 60.0, E, dtype=jnp.float32)

    def run(x, ex, delayed):
        plan = plan_dispatch(ex, E, align_size=16)
        kw = dict(num_experts=E, mode=int(ScalingMode.CURRENT_TENSOR_SCALING), q_dtype=jnp.float8_e4m3fn,
                  rowwise=True, colwise=True)  # fmt: skip
        return (moe_ffi.permute_fp8(x, plan.src, ex, delayed, **kw),
                moe_ffi.permute_fp8(x, plan.src, ex, None, **kw))  # fmt: skip

    given, plain = to_cpu(run_on(device, run, x, ex, delayed))
    for name, a, b in zip(("data", "colwise", "scale_inv", "amax"), given, plain):
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name
        )
    assert not np.allclose(1.0 / np.asarray(given[2]), np.asarray(delayed))


def _choice64(z, fn="softmax", pre=False, bias=None):
    """The float64 choice values the router ranks (documented rules; see router64)."""
    z = np.asarray(z, np.float64)
    if fn == "softmax":
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True) if pre else z
    s = 1 / (1 + np.exp(-z)) if fn == "sigmoid" else np.sqrt(_sp(z))
    return s + (0 if bias is None else np.asarray(bias, np.float64))


def _topk_margin(c, k, groups=None, gtopk=None):
    """Per token: the smallest gap among the k + 1 best choice values (the order and the k-th /
    (k+1)-th boundary) and, grouped, among the group scores around the group_topk boundary."""
    t, e = c.shape
    if groups:
        per = e // groups
        grp = -np.sort(-c.reshape(t, groups, per), axis=2)[:, :, : k // gtopk].sum(axis=2)
        gs = -np.sort(-grp, axis=1)
        gmargin = np.diff(-gs[:, : gtopk + 1], axis=1).min(axis=1) if gtopk < groups else np.inf
        keep = np.argsort(-grp, axis=1, kind="stable")[:, :gtopk]
        allowed = np.zeros((t, groups), bool)
        np.put_along_axis(allowed, keep, True, axis=1)
        c = np.where(np.repeat(allowed, per, axis=1), c, -np.inf)
    else:
        gmargin = np.inf
    top = -np.sort(-c, axis=1)[:, : k + 1]
    gaps = np.diff(-top, axis=1)
    gaps[~np.isfinite(gaps)] = np.inf  # fewer than k + 1 allowed experts: no boundary
    return np.minimum(gaps.min(axis=1), gmargin)


@pytest.mark.parametrize(
    "cfg", ROUTERS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "softmax"
)
def test_router_fused_same_experts_past_float32_margin(device, cfg):
    """Whenever a token's top-k choice is decided by more than float32 rounding (every gap among
    its k + 1 best choice values, and grouped, among the group scores, above 1e-5 x the value),
    the fused router picks the XLA path's experts in the XLA path's order. Near-ties may differ
    (exp / log differ in the last ulp); they must be rare here for the test to mean anything."""
    kw = _kw(cfg)
    z = _logits(21, t=4096)
    ex_f = to_cpu(run_on(device, lambda z: topk_routing(z, K, impl="fused", **kw)[1], z))
    ex_x = to_cpu(run_on(device, lambda z: topk_routing(z, K, impl="xla", **kw)[1], z))
    c = _choice64(
        z, kw.get("score_function", "softmax"), kw.get("use_pre_softmax", False), kw.get("expert_bias")
    )
    margin = _topk_margin(c, K, kw.get("num_groups"), kw.get("group_topk"))
    decided = margin > 1e-5 * np.maximum(1.0, np.abs(c).max(axis=1))
    assert decided.mean() > 0.97, f"only {decided.mean():.3f} of the tokens are tie-free"
    np.testing.assert_array_equal(np.asarray(ex_f)[decided], np.asarray(ex_x)[decided])


def _row_rel_err(a, b):
    """Largest per-row (leading axis) relative error norm."""
    a = np.asarray(a, np.float64).reshape(len(a), -1)
    b = np.asarray(b, np.float64).reshape(len(b), -1)
    return (np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)).max()


def test_block_under_fused_kernels(device):
    """The MoE block traced under lowbit.moe.kernels("fused") gives the XLA path's output and
    gradients. The inputs are tie-free (every gap among each token's 3 best logits > 1e-2, far
    past float32 rounding), so both paths route alike; the tokens, fc1's output and dy are
    bfloat16 in both, so a last-ulp difference upstream (router weights, the combine's sum) can
    flip one bfloat16 rounding and move a gradient row by ~2^-8 of its norm: rows are compared
    by norm at 2e-2, which a misrouted token or a wrong row (an O(1) change of its row) fails."""
    T_, H, F, E_ = 32, 32, 16, 8
    ks = jax.random.split(jax.random.PRNGKey(15), 4)
    x = jax.random.normal(ks[0], (T_, H), jnp.float32)
    gate = jax.random.normal(ks[1], (H, E_), jnp.float32) * 0.3
    wi = jax.random.normal(ks[2], (E_, H, 2 * F), jnp.float32) * 0.2
    wo = jax.random.normal(ks[3], (E_, F, H), jnp.float32) * 0.2
    z64 = np.asarray(x, np.float64) @ np.asarray(gate, np.float64)
    assert _topk_margin(z64, 2).min() > 1e-2

    def loss(x, gate, wi, wo):
        y, aux, _ = lowbit.moe.moe_block(x, gate, wi, wo, num_experts_per_tok=2, aux_loss_coeff=0.01)
        return jnp.sum(y * y) + aux

    def grads(impl):
        with kernels(impl):
            return to_cpu(run_on(device, jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, gate, wi, wo))

    (lf, gf), (lx, gx) = grads("fused"), grads("xla")
    np.testing.assert_allclose(lf, lx, rtol=1e-5)
    for name, a, b in zip(("x", "gate", "wi", "wo"), gf, gx):
        assert _row_rel_err(a, b) < 2e-2, name


def test_bad_impl_named(on_cpu):
    with pytest.raises(ValueError, match="impl"):
        topk_routing(_logits(0), 2, impl="cuda")
    with pytest.raises(ValueError, match="impl"):
        with kernels("triton"):
            pass
    ex = _routing(0)
    plan = plan_dispatch(ex, E)
    with pytest.raises(ValueError, match="scaling_mode"):
        permute_quantize(jnp.zeros((T, D), jnp.bfloat16), plan, ex, ScalingMode.MXFP8_1D_SCALING)
    with pytest.raises(ValueError, match="scale"):
        permute_quantize(jnp.zeros((T, D), jnp.bfloat16), plan, ex, ScalingMode.DELAYED_TENSOR_SCALING)
    with pytest.raises(ValueError, match="experts"):
        permute_quantize(jnp.zeros((T, D), jnp.bfloat16), plan, ex[:, :1], ScalingMode.CURRENT_TENSOR_SCALING)
