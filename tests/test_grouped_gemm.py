"""lowbit.grouped_gemm: forward and both gradients against a float64 reference of ragged_dot's
semantics (BF16 and FP8 recipes), group-size edge cases, group sizes computed inside jit,
DelayedScaling's per-group state, make_ragged_dot_cls, and argument errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu
from helpers import rel

import lowbit
from lowbit.flax.ragged_dot import make_ragged_dot_cls

BF16, F32 = jnp.bfloat16, jnp.float32
SM = lowbit.ScalingMode


# ---- float64 reference (clamped groups; rows in no group are zero) ----------------------------
def ranges(sizes, extent):
    off, out = 0, []
    for s in np.asarray(sizes):
        s = int(min(max(int(s), 0), extent - off))
        out.append((off, s))
        off += s
    return out


def ref_forward(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for g, (o, s) in enumerate(ranges(sizes, lhs.shape[0])):
        out[o : o + s] = lhs[o : o + s] @ rhs[g]
    return out


def ref_grads(lhs, rhs, sizes, dout):
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    for g, (o, s) in enumerate(ranges(sizes, lhs.shape[0])):
        dlhs[o : o + s] = dout[o : o + s] @ rhs[g].T
        drhs[g] = lhs[o : o + s].T @ dout[o : o + s]
    return dlhs, drhs


def bf16_values(rng, shape, scale=1.0):
    """float32 arrays that are exactly bfloat16 values (so the float64 reference sees the same)."""
    return np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, BF16).astype(F32))


# (M, K, N, sizes): the edge cases of the issue. K/N of 37/45 are not multiples of 8 or 16.
CASES = {
    "uneven_with_empty": (64, 32, 48, [20, 0, 30, 14]),
    "one_group_all_rows": (64, 32, 40, [0, 0, 64, 0]),
    "G1": (48, 24, 32, [48]),
    "G128": (256, 16, 24, None),  # random sizes with empty groups, sum = M
    "sum_below_M": (64, 32, 32, [10, 20, 5]),
    "sum_above_M": (64, 32, 32, [30, 30, 30]),
    "negative_size": (40, 16, 16, [15, -3, 25]),
    "K_N_not_multiples": (50, 37, 45, [17, 0, 33]),
}


def case_sizes(name, rng):
    M, K, N, sizes = CASES[name]
    if sizes is None:
        w = rng.gamma(1.0, size=128) * (rng.random(128) > 0.3)
        sizes = np.floor(w / w.sum() * M).astype(np.int64)
        sizes[np.argmax(w)] += M - sizes.sum()
    return M, K, N, np.asarray(sizes, np.int32)


def vjp_outputs(f, lhs, rhs, sizes, dout):
    y, vjp = jax.vjp(lambda a, b: f(a, b, sizes), lhs, rhs)
    return (y,) + vjp(dout)


def recipe_fwd_bwd(device, rng, recipe, M, K, N, sizes):
    """lowbit.grouped_gemm under ``recipe`` on bfloat16-exact operands (lhs (M, K), rhs (G, K, N),
    dout (M, N)) on ``device``: ``(lhs, rhs, dout, y, dlhs, drhs)``, the operands as float32."""
    G = len(sizes)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.1)
    dout = bf16_values(rng, (M, N))
    f = lambda a, b, s, d: vjp_outputs(
        lambda a, b, s: lowbit.grouped_gemm(a, b, s, recipe=recipe), a, b, s, d
    )
    args = [jnp.asarray(a, BF16) for a in (lhs, rhs)] + [jnp.asarray(sizes), jnp.asarray(dout, BF16)]
    return (lhs, rhs, dout) + tuple(to_cpu(run_on(device, f, *args)))


# ---- BF16 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_forward_and_grads(device, rng, name):
    M, K, N, sizes = case_sizes(name, rng)
    G = len(sizes)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N))
    dout = bf16_values(rng, (M, N))
    args = [jnp.asarray(a, BF16) for a in (lhs, rhs)] + [jnp.asarray(sizes), jnp.asarray(dout, BF16)]
    y, dl, dr = to_cpu(run_on(device, lambda a, b, s, d: vjp_outputs(lowbit.grouped_gemm, a, b, s, d), *args))
    assert y.shape == (M, N) and y.dtype == np.dtype(BF16)
    assert dl.dtype == np.dtype(BF16) and dr.shape == (G, K, N)
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    # One bfloat16 rounding of a float32 sum: ~2^-9 relative.
    assert rel(y, ref) < 6e-3
    assert rel(dl, rdl) < 6e-3
    assert rel(dr, rdr) < 6e-3
    # Rows in no group and the weight gradient of empty groups are exactly zero.
    covered = sum(s for _, s in ranges(sizes, M))
    assert not np.any(np.asarray(y, np.float32)[covered:])
    assert not np.any(np.asarray(dl, np.float32)[covered:])
    for g, (_, s) in enumerate(ranges(sizes, M)):
        if s == 0:
            assert not np.any(np.asarray(dr[g], np.float32))


def test_float32_inputs_and_preferred_type(device, rng):
    M, K, N, sizes = case_sizes("uneven_with_empty", rng)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (len(sizes), K, N))
    y = to_cpu(
        run_on(
            device,
            lambda a, b, s: lowbit.grouped_gemm(a, b, s, preferred_element_type=F32),
            jnp.asarray(lhs),
            jnp.asarray(rhs),
            jnp.asarray(sizes),
        )
    )
    assert y.dtype == np.float32
    assert rel(y, ref_forward(lhs, rhs, sizes)) < 6e-3
    # float32 operands give float32 results and float32 gradients (computed from bf16 operands).
    g = to_cpu(
        run_on(
            device,
            lambda a, b, s: jax.grad(lambda a, b: jnp.sum(lowbit.grouped_gemm(a, b, s) ** 2), argnums=(0, 1))(
                a, b
            ),
            jnp.asarray(lhs),
            jnp.asarray(rhs),
            jnp.asarray(sizes),
        )
    )
    assert g[0].dtype == np.float32 and g[1].dtype == np.float32


# ---- FP8 ----------------------------------------------------------------------------------------
FP8_RECIPES = {
    "current": lowbit.Float8CurrentScaling(),
    "current_e4m3": lowbit.Float8CurrentScaling(fp8_format=lowbit.Format.E4M3),
    "delayed": lowbit.DelayedScaling(amax_history_len=4),
}


def state_for(recipe, G):
    if isinstance(recipe, lowbit.DelayedScaling):
        return lowbit.init_grouped_delayed_state(recipe, G)
    return None


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
@pytest.mark.parametrize(
    "name", ["uneven_with_empty", "G128", "sum_below_M", "sum_above_M", "K_N_not_multiples"]
)
def test_fp8_forward_and_grads_vs_float64(device, rng, recipe_name, name):
    recipe = FP8_RECIPES[recipe_name]
    M, K, N, sizes = case_sizes(name, rng)
    G = len(sizes)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.1)
    dout = bf16_values(rng, (M, N))
    state = state_for(recipe, G)
    if state is not None:  # a warmed-up state: scales from this step's amaxes
        state = dict(state)
        for role, x in (("x", lhs), ("kernel", rhs.reshape(G * K, N)), ("grad", dout)):
            fmax = float(jnp.finfo(recipe.q_dtype(role)).max)
            sz = sizes if role != "kernel" else np.full(G, K, np.int32)
            amax = np.array(
                [np.abs(x[o : o + s]).max() if s else 0.0 for o, s in ranges(sz, x.shape[0])], np.float32
            )
            state[f"{role}_scale"] = jnp.asarray(np.where(amax > 0, fmax / np.maximum(amax, 1e-30), 1.0), F32)

    def f(a, b, s, d, st):
        y, vjp = jax.vjp(lambda a, b: lowbit.grouped_gemm(a, b, s, recipe=recipe, state=st), a, b)
        return (y,) + vjp(d)

    args = [jnp.asarray(a, BF16) for a in (lhs, rhs)] + [jnp.asarray(sizes), jnp.asarray(dout, BF16), state]
    y, dl, dr = to_cpu(run_on(device, f, *args))
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    e5m2_grads = recipe.fp8_format == lowbit.Format.HYBRID
    assert rel(y, ref) < 0.06
    assert rel(dl, rdl) < (0.12 if e5m2_grads else 0.06)
    assert rel(dr, rdr) < (0.12 if e5m2_grads else 0.06)
    covered = sum(s for _, s in ranges(sizes, M))
    assert not np.any(np.asarray(y, np.float32)[covered:])
    for g, (_, s) in enumerate(ranges(sizes, M)):
        if s == 0:
            assert not np.any(np.asarray(dr[g], np.float32))


@pytest.mark.parametrize("name", ["uneven_with_empty", "G128", "one_group_all_rows"])
def test_fp8_gemm_vs_decoded_operands(device, rng, name):
    """The GEMM itself, tightly: against float64 on the operands grouped_quantize produced."""
    recipe = lowbit.Float8CurrentScaling()
    M, K, N, sizes = case_sizes(name, rng)
    K, N = 32, 48  # multiples of 16: no padding, so the quantized operands are the GEMM's
    G = len(sizes)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.1)

    def f(a, b, s):
        qx = lowbit.grouped_quantize(a, s, SM.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn)
        qw = lowbit.grouped_quantize(
            b.reshape(G * K, N), jnp.full((G,), K, jnp.int32), SM.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn
        )
        return lowbit.grouped_gemm(a, b, s, recipe=recipe), qx.data, qx.scale_inv, qw.data, qw.scale_inv

    y, xd, xs, wd, ws = to_cpu(
        run_on(device, f, jnp.asarray(lhs, BF16), jnp.asarray(rhs, BF16), jnp.asarray(sizes))
    )
    xq = np.zeros((M, K))
    for g, (o, s) in enumerate(ranges(sizes, M)):
        xq[o : o + s] = xd[o : o + s].astype(np.float64) * xs[g]
    wq = wd.astype(np.float64).reshape(G, K, N) * ws[:, None, None].astype(np.float64)
    # bfloat16 output rounding; the GPU forward accumulates FP8 products with fast accumulation.
    assert rel(y, ref_forward(xq, wq, sizes)) < (2e-2 if is_gpu(device) else 6e-3)


def test_delayed_state_update(device, rng):
    recipe = lowbit.DelayedScaling(amax_history_len=3)
    M, K, N, sizes = case_sizes("uneven_with_empty", rng)
    G = len(sizes)
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N))
    dout = bf16_values(rng, (M, N))
    state = lowbit.init_grouped_delayed_state(recipe, G)

    def f(a, b, s, d, st):
        _, vjp = jax.vjp(lambda a, b, st: lowbit.grouped_gemm(a, b, s, recipe=recipe, state=st), a, b, st)
        return vjp(d)[2]

    new = to_cpu(
        run_on(
            device,
            f,
            jnp.asarray(lhs, BF16),
            jnp.asarray(rhs, BF16),
            jnp.asarray(sizes),
            jnp.asarray(dout, BF16),
            state,
        )
    )
    for role, x, sz in (
        ("x", lhs, sizes),
        ("kernel", rhs.reshape(G * K, N), np.full(G, K)),
        ("grad", dout, sizes),
    ):
        amax = np.array(
            [np.abs(x[o : o + s]).max() if s else 0.0 for o, s in ranges(sz, x.shape[0])], np.float32
        )
        h = new[f"{role}_amax_history"]
        assert h.shape == (3, G)
        np.testing.assert_array_equal(h[0], amax)
        np.testing.assert_array_equal(h[1:], 0)
        fmax = float(jnp.finfo(recipe.q_dtype(role)).max)
        want = np.where(amax > 0, np.float32(fmax) / np.where(amax > 0, amax, 1), 1.0).astype(np.float32)
        np.testing.assert_allclose(new[f"{role}_scale"], want, rtol=1e-6)


# ---- jit: group sizes computed inside the jitted function (no host sync possible) --------------
@pytest.mark.parametrize("recipe", [None, lowbit.Float8CurrentScaling()], ids=["bf16", "fp8"])
def test_group_sizes_computed_inside_jit(device, rng, recipe):
    M, K, N, G = 96, 32, 48, 6
    x = bf16_values(rng, (M, K))
    router = rng.standard_normal((K, G)).astype(np.float32)
    w = bf16_values(rng, (G, K, N), 0.2)

    def step(x, router, w):
        expert = jnp.argmax(x.astype(F32) @ router, axis=-1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=G).astype(jnp.int32)
        xs = x[order]

        def loss(xs, w):
            return jnp.sum(lowbit.grouped_gemm(xs, w, sizes, recipe=recipe).astype(F32) ** 2)

        val, (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1))(xs, w)
        return val, gx, gw, sizes, xs

    val, gx, gw, sizes, xs = to_cpu(
        run_on(device, step, jnp.asarray(x, BF16), jnp.asarray(router), jnp.asarray(w, BF16))
    )
    xs = xs.astype(np.float64)
    y = ref_forward(xs, w, sizes)
    rdl, rdr = ref_grads(xs, w, sizes, 2 * y)
    tol = 6e-3 if recipe is None else 0.12
    assert abs(float(val) - float(np.sum(y**2))) / float(np.sum(y**2)) < (1e-2 if recipe is None else 0.1)
    assert rel(gx, rdl) < tol and rel(gw, rdr) < tol


def test_matches_ragged_dot(device, rng):
    M, K, N, sizes = case_sizes("uneven_with_empty", rng)
    lhs, rhs = (
        jnp.asarray(bf16_values(rng, (M, K)), BF16),
        jnp.asarray(bf16_values(rng, (len(sizes), K, N)), BF16),
    )
    f = lambda a, b, s: (
        lowbit.grouped_gemm(a, b, s, preferred_element_type=F32),
        jax.lax.ragged_dot(a, b, s, preferred_element_type=F32),
    )
    ours, theirs = to_cpu(run_on(device, f, lhs, rhs, jnp.asarray(sizes)))
    assert rel(ours, np.asarray(theirs, np.float64)) < 6e-3


# ---- Flax -------------------------------------------------------------------------------------
class _Experts(nn.Module):
    G: int
    N: int
    ragged_dot_cls: type

    @nn.compact
    def __call__(self, x, sizes):
        w = self.param("w", nn.initializers.normal(0.1), (self.G, x.shape[-1], self.N), F32)
        return self.ragged_dot_cls(name="ragged_dot")(x, w.astype(x.dtype), sizes)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(None, marks=pytest.mark.slow),
        pytest.param(lowbit.Float8CurrentScaling(), marks=pytest.mark.slow),
        lowbit.DelayedScaling(amax_history_len=2),
    ],
    ids=["bf16", "current", "delayed"],
)
def test_make_ragged_dot_cls(device, rng, recipe):
    G, M, K, N = 4, 64, 32, 48
    sizes = jnp.asarray([10, 0, 40, 14], jnp.int32)
    x = jnp.asarray(bf16_values(rng, (M, K)), BF16)
    model = _Experts(G, N, make_ragged_dot_cls(recipe))

    def train(x, sizes):
        variables = model.init(jax.random.PRNGKey(0), x, sizes)
        loss = lambda v: jnp.sum(model.apply(v, x, sizes).astype(F32) ** 2)
        return variables, jax.grad(loss)(variables), model.apply(variables, x, sizes)

    variables, grads, y = to_cpu(run_on(device, train, x, sizes))
    w = variables["params"]["w"]
    ref = ref_forward(np.asarray(x, np.float64), np.asarray(jnp.asarray(w, BF16).astype(F32)), sizes)
    assert rel(y, ref) < (6e-3 if recipe is None else 0.06)
    state = variables.get("_overwrite_with_gradient")
    if isinstance(recipe, lowbit.DelayedScaling):
        assert state is not None
        assert state["ragged_dot"]["x_amax_history"].shape == (2, G)
        new = grads["_overwrite_with_gradient"]["ragged_dot"]
        assert np.all(new["x_amax_history"][0] >= 0) and new["x_amax_history"][0][1] == 0  # empty group
        assert np.all(new["grad_amax_history"][0][[0, 2, 3]] > 0)
    else:
        assert state is None


# ---- errors ---------------------------------------------------------------------------------------
def test_errors():
    x = jnp.zeros((8, 16), BF16)
    w = jnp.zeros((2, 16, 8), BF16)
    gs = jnp.asarray([4, 4], jnp.int32)
    gg = lowbit.grouped_gemm
    with pytest.raises(ValueError, match="lhs must be 2-D"):
        gg(jnp.zeros((2, 8, 16), BF16), w, gs)
    with pytest.raises(ValueError, match="rhs must be 3-D"):
        gg(x, jnp.zeros((16, 8), BF16), gs)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        gg(x, jnp.zeros((2, 12, 8), BF16), gs)
    with pytest.raises(ValueError, match="group_sizes must have shape"):
        gg(x, w, jnp.asarray([8], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes must be an integer"):
        gg(x, w, jnp.asarray([4.0, 4.0]))
    with pytest.raises(TypeError, match="lhs must be bfloat16 or float32"):
        gg(jnp.zeros((8, 16), jnp.int8), w, gs)
    with pytest.raises(TypeError, match="rhs must be bfloat16 or float32"):
        gg(x, jnp.zeros((2, 16, 8), jnp.float16), gs)
    with pytest.raises(TypeError, match="preferred_element_type"):
        gg(x, w, gs, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="not supported by the grouped GEMM"):
        gg(x, w, gs, recipe=lowbit.MXFP8BlockScaling())
    with pytest.raises(ValueError, match="fp8_format=Format.E5M2"):
        gg(x, w, gs, recipe=lowbit.Float8CurrentScaling(fp8_format=lowbit.Format.E5M2))
    with pytest.raises(ValueError, match="DelayedScaling needs state"):
        gg(x, w, gs, recipe=lowbit.DelayedScaling())
    bad = lowbit.init_grouped_delayed_state(lowbit.DelayedScaling(amax_history_len=4), 3)
    with pytest.raises(ValueError, match="must be float32 of shape"):
        gg(x, w, gs, recipe=lowbit.DelayedScaling(amax_history_len=4), state=bad)
    with pytest.raises(ValueError, match="state is only used with DelayedScaling"):
        gg(x, w, gs, state=bad)


# ---- GPU: the MoE-sized shapes the benchmark runs, scaled down -----------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, lowbit.Float8CurrentScaling()], ids=["bf16", "fp8"])
def test_gpu_medium_uneven(gpu_device, rng, recipe):
    G, M, K, N = 16, 4096, 512, 768
    w = rng.gamma(1.0, size=G)
    sizes = np.floor(w / w.sum() * (M - 100)).astype(np.int32)  # 100+ trailing padding rows
    sizes[3] = 0
    lhs, rhs = bf16_values(rng, (M, K)), bf16_values(rng, (G, K, N), 0.05)
    dout = bf16_values(rng, (M, N))
    f = lambda a, b, s, d: vjp_outputs(
        lambda a, b, s: lowbit.grouped_gemm(a, b, s, recipe=recipe), a, b, s, d
    )
    y, dl, dr = to_cpu(
        run_on(
            gpu_device,
            f,
            jnp.asarray(lhs, BF16),
            jnp.asarray(rhs, BF16),
            jnp.asarray(sizes),
            jnp.asarray(dout, BF16),
        )
    )
    ref = ref_forward(lhs, rhs, sizes)
    rdl, rdr = ref_grads(lhs, rhs, sizes, dout)
    tol = (6e-3, 6e-3) if recipe is None else (0.06, 0.12)
    assert rel(y, ref) < tol[0] and rel(dl, rdl) < tol[1] and rel(dr, rdr) < tol[1]
    assert not np.any(np.asarray(y, np.float32)[int(sizes.sum()) :])
    assert not np.any(np.asarray(dr[3], np.float32))
