"""lowbit.moe.moe_block against a dense per-token float64 NumPy MoE (gate, softmax / sigmoid
routing, SwiGLU experts with biases, the weighted combine, the aux loss) and its hand-written
float64 backward; the capacity drops; the FP8 recipes within FP8 bounds; expert parallelism on
4 host devices equal to one device; bad arguments name themselves.

Operands enter the GEMMs as bfloat16 (the reference rounds them the same way), so the BF16
block is held to a relative 2e-2; FP8 to 8e-2 (E4M3's 2^-4 relative step, averaged)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.moe import moe_block

T, H, F, E, K = 48, 32, 48, 8, 2
COEFF = 0.01


def bf(a):
    return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _silu(a):
    return a / (1 + np.exp(-a))


def _dsilu(a):
    s = 1 / (1 + np.exp(-a))
    return s * (1 + a * (1 - s))


def inputs(seed, bias=False):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = np.asarray(jax.random.normal(k[0], (T, H)), np.float32)
    gate = np.asarray(jax.random.normal(k[1], (H, E)), np.float32) * 0.5
    wi = (np.asarray(jax.random.normal(k[2], (E, H, 2 * F))) / np.sqrt(H)).astype(np.float32)
    wo = (np.asarray(jax.random.normal(k[3], (E, F, H))) / np.sqrt(F)).astype(np.float32)
    bi = np.asarray(jax.random.normal(k[4], (E, 2 * F)), np.float32) * 0.1 if bias else None
    bo = np.asarray(jax.random.normal(k[5], (E, H)), np.float32) * 0.1 if bias else None
    return x, gate, wi, wo, bi, bo


def reference(x, gate, wi, wo, bi, bo, dy, fn="softmax", capacity=None):
    """float64 forward (y, aux loss) and backward of <y, dy> + aux loss, token by token."""
    x64, g64 = np.asarray(x, np.float64), np.asarray(gate, np.float64)
    z = x64 @ g64
    if fn == "softmax":
        top = np.argsort(-z, axis=1, kind="stable")[:, :K]
        zt = np.take_along_axis(z, top, 1)
        w = np.exp(zt - zt.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        p_all = np.exp(z - z.max(1, keepdims=True))
        p_all /= p_all.sum(1, keepdims=True)
    else:  # sigmoid, normalised over the chosen k
        s = 1 / (1 + np.exp(-z))
        top = np.argsort(-s, axis=1, kind="stable")[:, :K]
        st = np.take_along_axis(s, top, 1)
        w = st / st.sum(1, keepdims=True)
        p_all = s / s.sum(1, keepdims=True)
    xb, wib, wob = bf(x), bf(wi), bf(wo)
    y = np.zeros((T, H))
    g = {k: np.zeros_like(np.asarray(v, np.float64)) for k, v in dict(x=x, gate=gate, wi=wi, wo=wo).items()}
    if bi is not None:
        g["bi"], g["bo"] = np.zeros(bi.shape), np.zeros(bo.shape)
    dw = np.zeros((T, K))
    seen = np.zeros(E, int)
    for t in range(T):
        for j in range(K):
            e = top[t, j]
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                continue  # dropped: adds zero
            u = xb[t] @ wib[e] + (0 if bi is None else bi[e])
            a, b = u[:F], u[F:]
            h = bf(_silu(bf(a)) * bf(b))  # the GEMM's bf16 output, the activation rounded once
            o = h @ wob[e] + (0 if bo is None else bo[e])
            y[t] += w[t, j] * o
            dw[t, j] = o @ dy[t]
            do = w[t, j] * dy[t]
            g["wo"][e] += np.outer(h, do)
            dh = wob[e] @ do
            du = np.concatenate([dh * bf(b) * _dsilu(bf(a)), dh * _silu(bf(a))])
            g["wi"][e] += np.outer(xb[t], du)
            g["x"][t] += wib[e] @ du
            if bi is not None:
                g["bi"][e] += du
                g["bo"][e] += do
    # Through the routing weights to the logits (the choice fixed).
    dz = np.zeros((T, E))
    if fn == "softmax":
        dzt = w * (dw - np.sum(w * dw, 1, keepdims=True))
    else:
        st = np.take_along_axis(1 / (1 + np.exp(-z)), top, 1)
        tot = st.sum(1, keepdims=True)
        dzt = (dw / tot - np.sum(dw * st, 1, keepdims=True) / tot**2) * st * (1 - st)
    np.put_along_axis(dz, top, dzt, 1)
    # The aux loss: E coeff / (k T^2) sum_e (sum_t p_all[t, e]) counts[e].
    counts = np.bincount(top.reshape(-1), minlength=E)
    aux = E * COEFF / (K * T * T) * np.sum(p_all.sum(0) * counts)
    dp = np.broadcast_to(E * COEFF / (K * T * T) * counts, (T, E))
    if fn == "softmax":
        dz += p_all * (dp - np.sum(p_all * dp, 1, keepdims=True))
    else:
        s = 1 / (1 + np.exp(-z))
        tot = s.sum(1, keepdims=True)
        dz += (dp / tot - np.sum(dp * s, 1, keepdims=True) / tot**2) * s * (1 - s)
    g["gate"] = x64.T @ dz
    g["x"] = g["x"] + dz @ g64.T
    return y, aux, g


def _grad_step(**kw):
    def loss(x, gate, wi, wo, bi, bo, dy):
        y, aux, _ = moe_block(x, gate, wi, wo, bi, bo, num_experts_per_tok=K, aux_loss_coeff=COEFF, **kw)
        return jnp.sum(y.astype(jnp.float32) * dy) + aux, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


@pytest.mark.parametrize("fn, bias", [("softmax", False), ("sigmoid", True)])
def test_block_matches_float64_reference(fn, bias):
    x, gate, wi, wo, bi, bo = inputs(0, bias)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    (_, (y, aux)), grads = _grad_step(score_function=fn)(x, gate, wi, wo, bi, bo, dy)
    ref_y, ref_aux, ref_g = reference(x, gate, wi, wo, bi, bo, dy, fn)
    assert rel(y, ref_y) < 2e-2
    np.testing.assert_allclose(float(aux), ref_aux, rtol=1e-5)
    names = ("x", "gate", "wi", "wo") + (("bi", "bo") if bias else ())
    for name, got in zip(names, grads):
        assert rel(got, ref_g[name]) < 3e-2, (name, rel(got, ref_g[name]))


def test_capacity_factor_drops_the_later_pairs():
    x, gate, wi, wo, _, _ = inputs(1)
    factor = 0.5  # capacity ceil(0.5 * 48 * 2 / 8) = 6 pairs per expert
    y, _, routed = moe_block(x, gate, wi, wo, num_experts_per_tok=K, capacity_factor=factor)
    ref_y, _, _ = reference(x, gate, wi, wo, None, None, np.zeros((T, H)), capacity=6)
    full, _, _ = reference(x, gate, wi, wo, None, None, np.zeros((T, H)))
    assert rel(y, ref_y) < 2e-2 and rel(ref_y, full) > 0.1  # the drops are real and as documented
    assert int(routed) == T * K


@pytest.mark.parametrize(
    "recipe",
    [lowbit.Float8CurrentScaling(), pytest.param(lowbit.Float8BlockScaling(), marks=pytest.mark.slow)],
    ids=["current", "block"],
)
def test_fp8_block_within_fp8_bounds(recipe):
    x, gate, wi, wo, _, _ = inputs(2)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    (_, (y, _)), grads = _grad_step(recipe=recipe)(x, gate, wi, wo, None, None, dy)
    ref_y, _, ref_g = reference(x, gate, wi, wo, None, None, dy)
    assert rel(y, ref_y) < 8e-2
    for name, got in zip(("x", "gate", "wi", "wo"), grads):
        assert rel(got, ref_g[name]) < 1.2e-1, (name, rel(got, ref_g[name]))


@pytest.mark.parametrize("recipe", [lowbit.Float8CurrentScaling(), lowbit.DelayedScaling(amax_history_len=4)])
def test_fp8_primary_weights_equal_the_casting_block(recipe):
    """quantized_weights made outside the step: the same output and gradients (and state) as
    the block that casts wi / wo itself."""
    from lowbit.moe import quantize_experts

    x, gate, wi, wo, _, _ = inputs(6)
    delayed = isinstance(recipe, lowbit.DelayedScaling)
    state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2 if delayed else None

    def loss(x, wi, wo, state, qws):
        y, _, _ = moe_block(
            x, gate, wi, wo, num_experts_per_tok=K, recipe=recipe, state=state, quantized_weights=qws
        )
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    s1, s2 = (None, None) if state is None else state
    qws = (quantize_experts(wi, recipe, s1), quantize_experts(wo, recipe, s2))
    a, b = step(x, wi, wo, state, None), step(x, wi, wo, state, qws)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_delayed_scaling_state_per_expert():
    x, gate, wi, wo, _, _ = inputs(3)
    recipe = lowbit.DelayedScaling(amax_history_len=4)
    state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2

    def loss(wi, state):
        y, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=K, recipe=recipe, state=state)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    _, (_, new_state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(wi, state)
    amax = np.asarray(new_state[0]["kernel_amax_history"])
    assert amax.shape == (4, E)
    np.testing.assert_allclose(amax[0], np.abs(wi).max(axis=(1, 2)), rtol=1e-6)  # one amax per expert


def test_three_d_input_and_early_weights_equal_the_plain_block():
    x, gate, wi, wo, _, _ = inputs(4)
    y, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=K)
    y3, _, _ = moe_block(x.reshape(4, 12, H), gate, wi, wo, num_experts_per_tok=K)
    np.testing.assert_array_equal(np.asarray(y3).reshape(T, H), np.asarray(y))
    ye, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=K, apply_topk_weights_early=True)
    assert rel(ye, y) < 2e-2


def test_bad_block_arguments_name_the_argument():
    x, gate, wi, wo, _, _ = inputs(0)
    cases = [
        (lambda: moe_block(x, gate[1:], wi, wo, num_experts_per_tok=K), ["gate_kernel"]),
        (lambda: moe_block(x, gate, wi[1:], wo, num_experts_per_tok=K), ["wi"]),
        (lambda: moe_block(x, gate, wi, wo[:, 1:], num_experts_per_tok=K), ["w2"]),
        (lambda: moe_block(x, gate, wi, wo, num_experts_per_tok=E + 1), ["topk", str(E)]),
        (lambda: moe_block(x, gate, wi, wo, np.zeros((E, 3)), num_experts_per_tok=K), ["b1"]),
        (
            lambda: moe_block(x, gate, wi, wo, num_experts_per_tok=K, capacity_factor=-1.0),
            ["capacity_factor"],
        ),
        (
            lambda: moe_block(x, gate, wi, wo, num_experts_per_tok=K, num_groups=3, group_topk=1),
            ["num_groups"],
        ),
    ]
    for thunk, words in cases:
        with pytest.raises(ValueError) as info:
            thunk()
        assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)


# ---------------------------------------------------------------------------------------------
# Expert parallelism on 4 host devices (subprocess)
# ---------------------------------------------------------------------------------------------
def test_expert_parallel_block_equals_one_device():
    from helpers import multi_device_env

    argv = [sys.executable, os.path.abspath(__file__), "ep"]
    r = subprocess.run(argv, env=multi_device_env(4), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK ep" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


def _ep_worker():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == 4
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    x, gate, wi, wo, bi, bo = inputs(5, bias=True)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    kw = dict(score_function="sigmoid")
    (_, (y1, a1)), g1 = _grad_step(**kw)(x, gate, wi, wo, bi, bo, dy)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    ep = P("ep")
    args = (put(x, ep), put(gate, P()), put(wi, ep), put(wo, ep), put(bi, ep), put(bo, ep), put(dy, ep))
    (_, (y4, a4)), g4 = _grad_step(mesh=mesh, expert_axis="ep", dispatch="capacity", **kw)(*args)
    assert rel(y4, y1) < 1e-2, rel(y4, y1)
    np.testing.assert_allclose(float(a4), float(a1), rtol=1e-5)
    for name, a, b in zip(("x", "gate", "wi", "wo", "bi", "bo"), g4, g1):
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    # FP8 primary weights split over the experts like wi / wo: the one-device result.
    from lowbit.moe import quantize_experts

    recipe = lowbit.Float8CurrentScaling()
    qws = (quantize_experts(wi, recipe), quantize_experts(wo, recipe))

    def run(x, wi, wo, qws, **kw):
        return moe_block(x, gate, wi, wo, num_experts_per_tok=K, recipe=recipe, quantized_weights=qws, **kw)[
            0
        ]

    one = jax.jit(run)(x, wi, wo, qws)
    qsh = tuple(
        jax.device_put(
            q,
            jax.tree_util.tree_map(
                lambda s: NamedSharding(mesh, s), q.spec("ep"), is_leaf=lambda s: isinstance(s, P)
            ),
        )
        for q in qws
    )
    four = jax.jit(lambda *a: run(*a, mesh=mesh, expert_axis="ep", dispatch="capacity"))(
        args[0], args[2], args[3], qsh
    )
    assert rel(four, one) < 1e-2, rel(four, one)
    # The Flax block under a MeshResource with ep_resource, jax.set_mesh (an abstract mesh in jit).
    import flax.linen as nn

    from lowbit.sharding import MeshResource, global_shard_guard

    blk = lowbit.flax.MoEBlock(
        num_experts=E, num_experts_per_tok=K, intermediate_size=F, aux_loss_coeff=COEFF
    )
    xb = jnp.asarray(x).reshape(4, T // 4, H)
    v = nn.unbox(blk.init(jax.random.PRNGKey(1), xb))
    y1, a1, _ = jax.jit(blk.apply)(v, xb)
    set_mesh = getattr(jax, "set_mesh", None) or (lambda m: m)
    with global_shard_guard(MeshResource(ep_resource="ep")), set_mesh(mesh):
        f = jax.jit(blk.apply)
        y4, a4, _ = f(v, xb)
        assert "all-to-all" in f.lower(v, xb).compile().as_text()
    assert rel(y4, y1) < 1e-2 and abs(float(a4) - float(a1)) <= 1e-5 * abs(float(a1))
    print("OK ep")


def test_bench_xla_baseline_is_the_same_block():
    """bench moe's all-XLA block (ragged_dot) computes what moe_block computes (BF16)."""
    from lowbit.bench.moe import _xla_block

    x, gate, wi, wo, _, _ = inputs(7)
    want, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=K)
    got = _xla_block(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(wi), jnp.asarray(wo), K)
    assert rel(got, want) < 1e-2


# ---------------------------------------------------------------------------------------------
# GPU (skipped without one)
# ---------------------------------------------------------------------------------------------
def _cuda():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.parametrize(
    "recipe",
    [
        None,
        lowbit.Float8CurrentScaling(),
        lowbit.DelayedScaling(amax_history_len=4),
        lowbit.Float8BlockScaling(),
    ],
    ids=["bf16", "current", "delayed", "block"],
)
def test_block_on_gpu_matches_float64(recipe):
    """The GPU kernels (grouped GEMMs, casts) in the block, every recipe, against the float64
    reference; FP8 primary weights bit-equal to the casting block on the GPU too."""
    gpus = _cuda()
    if not gpus:
        pytest.skip("no CUDA device")
    from lowbit.moe import quantize_experts

    x, gate, wi, wo, bi, bo = inputs(8, bias=True)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    delayed = isinstance(recipe, lowbit.DelayedScaling)
    state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2 if delayed else None

    def loss(x, gate, wi, wo, bi, bo, qws):
        y, aux, _ = moe_block(
            x, gate, wi, wo, bi, bo, num_experts_per_tok=K, aux_loss_coeff=COEFF, recipe=recipe, state=state,
            quantized_weights=qws,
        )  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * dy) + aux, y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
    with jax.default_device(gpus[0]):
        (_, y), grads = step(x, gate, wi, wo, bi, bo, None)
        ref_y, _, ref_g = reference(x, gate, wi, wo, bi, bo, dy)
        tol = 2e-2 if recipe is None else 8e-2
        assert rel(y, ref_y) < tol
        for name, got in zip(("x", "gate", "wi", "wo", "bi", "bo"), grads):
            # The gate's gradient is a difference of the pairs' outputs (the softmax Jacobian):
            # their FP8 errors do not cancel with it.
            bound = (3 if name == "gate" else 1.5) * tol
            assert rel(got, ref_g[name]) < bound, (name, rel(got, ref_g[name]))
        if recipe is not None:
            s1, s2 = (None, None) if state is None else state
            qws = (quantize_experts(wi, recipe, s1), quantize_experts(wo, recipe, s2))
            (_, y2), g2 = step(x, gate, wi, wo, bi, bo, qws)
            # Bit-equal on the CPU (tests/test_moe_prequantized.py); on the H100 the primary-weight
            # path differed from the casting one by rounding (session 9, not yet explained), so
            # here it is held to a tenth of the float64 bound.
            for u, v in zip(jax.tree_util.tree_leaves((y, grads)), jax.tree_util.tree_leaves((y2, g2))):
                assert rel(np.asarray(v), np.asarray(u)) < 0.1 * tol


@pytest.mark.gpu
def test_block_ragged_dispatch_on_gpus_equals_one_device():
    gpus = _cuda()
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 CUDA devices, found {len(gpus)}")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = 4 if len(gpus) >= 4 else 2
    mesh = jax.sharding.Mesh(np.array(gpus[:n]), ("ep",))
    x, gate, wi, wo, bi, bo = inputs(5, bias=True)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (T, H)), np.float32)
    with jax.default_device(gpus[0]):
        (_, (y1, a1)), g1 = _grad_step(score_function="sigmoid")(x, gate, wi, wo, bi, bo, dy)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    ep = P("ep")
    args = (put(x, ep), put(gate, P()), put(wi, ep), put(wo, ep), put(bi, ep), put(bo, ep), put(dy, ep))
    for dispatch in ("ragged", "capacity"):
        (_, (yn, an)), gn = _grad_step(
            mesh=mesh, expert_axis="ep", dispatch=dispatch, score_function="sigmoid"
        )(*args)
        assert rel(yn, y1) < 1e-2 and abs(float(an) - float(a1)) <= 1e-5 * abs(float(a1)), dispatch
        for name, a, b in zip(("x", "gate", "wi", "wo", "bi", "bo"), gn, g1):
            assert rel(a, b) < 1e-2, (dispatch, name, rel(a, b))


if __name__ == "__main__":
    if sys.argv[1] == "ep":
        _ep_worker()


def test_fp8_dispatch_groups_start_16_aligned():
    """Under an FP8 recipe the dispatch pads each expert's rows to a multiple of 16 (and the buffer
    to whole units): the FP8 wgrad then reads every group's transposed rows in place. Unaligned
    groups made the GEMM copy both operands into aligned slots each call (1.26 ms of the 19 ms
    G64 step on an H200). BF16 keeps the unpadded buffer."""
    import re

    x, gate, wi, wo, _, _ = inputs(7)

    def shapes(recipe, dtype):
        def loss(x, wi, wo):
            y, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=K, recipe=recipe)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, wi, wo).as_text()
        return set(re.findall(rf"tensor<(\d+)x{H}x{dtype}>", text))

    padded = str(-(-(T * K + E * 15) // 16) * 16)  # 224 rows: 96 pairs + 8 experts' padding
    fp8 = shapes(lowbit.Float8CurrentScaling(), "f8E4M3FN")
    assert padded in fp8 and str(T * K) not in fp8, fp8
    assert str(T * K) in shapes(None, "bf16")
