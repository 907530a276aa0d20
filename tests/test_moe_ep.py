"""lowbit.ops.fused.moe.moe_mlp: one device against a float64 NumPy MoE (routing, both GEMMs,
the weighted combine, and every gradient), expert parallelism on 4 host devices against one
device (capacity dispatch; ragged dispatch with ragged_all_to_all emulated on XLA:CPU), the
documented drops under a capacity_factor, argument errors, and (``gpu``) the real ragged
dispatch on >= 2 GPUs.

Device checks run in subprocesses (this file as a script with a case name) with 4 forced host
devices, as tests/test_multi_device.py does. Expert-parallel results are held to
``lowbit.bench.multi_device.bound_ratio`` <= 1 against one device (a relative 2^-7 plus 2^-7 of
the largest value: bf16 rounding)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops.fused import ep_choice, ep_dispatch, moe
from lowbit.ops.fused.permutation import buffer_rows

N_DEV = 4
T, D, FF, E, K = 64, 32, 64, 8, 2


# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------
def bf(a):
    return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)


def _gelu(a):
    return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))


def _dgelu(a):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (a + 0.044715 * a**3))
    return 0.5 * (1 + t) + 0.5 * a * (1 - t**2) * c * (1 + 3 * 0.044715 * a**2)


def routing64(x, router, k):
    """float64 softmax top-k from the same logits: (probs, top (T, k), weights (T, k)); also
    asserts no near tie at the k-th place (a tie could pick another expert in float32)."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    srt = -np.sort(-p, axis=-1)
    if k < p.shape[1]:
        assert np.all(srt[:, k - 1] - srt[:, k] > 1e-5 * srt[:, 0]), "near tie in routing: change the seed"
    w = np.take_along_axis(p, top, -1)
    return p, top, w / w.sum(-1, keepdims=True)


def reference(x, router, w1, w2, k, dy, kept=None):
    """The MoE in float64: routing from x's logits, experts on bf16-rounded x, w1, w2 (fc1's
    output and the activation rounded to bf16, as the library's GEMM outputs are); ``kept``
    (T, k) bool masks dropped pairs. Returns (y, {x, router, w1, w2} gradients of <y, dy>)."""
    x, router, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, router, w1, w2, dy))
    p, top, w = routing64(x, router, k)
    kept = np.ones(top.shape, bool) if kept is None else kept
    xb, w1b, w2b = bf(x), bf(w1), bf(w2)
    y = np.zeros_like(x)
    g = {"x": np.zeros_like(x), "w1": np.zeros_like(w1), "w2": np.zeros_like(w2)}
    dw = np.zeros_like(w)  # d<y, dy> / d weights
    for e in range(w1.shape[0]):
        t, j = np.nonzero((top == e) & kept)
        a = bf(xb[t] @ w1b[e])
        h = bf(_gelu(a))
        o = h @ w2b[e]
        y[t] += w[t, j][:, None] * o
        dw[t, j] = np.sum(o * dy[t], axis=1)
        do = w[t, j][:, None] * dy[t]
        g["w2"][e] = h.T @ do
        da = (do @ w2b[e].T) * _dgelu(a)
        g["w1"][e] = xb[t].T @ da
        np.add.at(g["x"], t, da @ w1b[e].T)
    # Renormalised top-k of a softmax, back to the logits.
    s = np.take_along_axis(p, top, -1).sum(-1, keepdims=True)
    wsel = np.take_along_axis(p, top, -1)
    dp = np.zeros_like(p)
    np.put_along_axis(dp, top, dw / s - np.sum(dw * wsel, -1, keepdims=True) / s**2, -1)
    dlogits = p * (dp - np.sum(dp * p, -1, keepdims=True))
    g["router"] = x.T @ dlogits
    g["x"] += dlogits @ router.T
    return y, g


def rel(got, ref) -> float:
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def inputs(seed=0, t=T, d=D, ff=FF, e=E):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    router = (rng.standard_normal((d, e)) / np.sqrt(d)).astype(np.float32)
    w1 = (rng.standard_normal((e, d, ff)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((e, ff, d)) / np.sqrt(ff)).astype(np.float32)
    dy = rng.standard_normal((t, d)).astype(np.float32)
    return x, router, w1, w2, dy


def grad_step(k=K, recipe=None, **kw):
    """jit(value_and_grad) of <moe_mlp(...), dy> over (x, router, w1, w2[, state])."""

    def loss(x, r, w1, w2, dy, state=None):
        y = moe.moe_mlp(x, r, w1, w2, top_k=k, recipe=recipe, state=state, **kw)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    def step(x, r, w1, w2, dy, state=None):
        argnums = (0, 1, 2, 3) if state is None else (0, 1, 2, 3, 5)
        (_, y), g = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(x, r, w1, w2, dy, state)
        return y, g

    return jax.jit(step)


RECIPES = {"bf16": None, "current": lowbit.Float8CurrentScaling(), "block": lowbit.Float8BlockScaling()}
# Per-token output and whole-gradient bounds against float64: bf16 rounding; E4M3 quantization
# (3 mantissa bits: up to 2^-4 per element, the largest of 64 tokens near 0.09).
BOUNDS = {"bf16": (1e-2, 1e-2), "current": (0.15, 0.15), "block": (0.15, 0.15)}


# ---------------------------------------------------------------------------------------------
# One device
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_one_device_matches_float64(name):
    x, r, w1, w2, dy = inputs(0)
    d_ = 128 if name == "block" else D  # block scaling: contraction dims in whole 128-blocks
    if name == "block":
        x, r, w1, w2, dy = inputs(0, d=d_, ff=128)
    y, g = grad_step(recipe=RECIPES[name])(x, r, w1, w2, dy)
    ref_y, ref_g = reference(x, r, w1, w2, K, dy)
    tok_bound, grad_bound = BOUNDS[name]
    per_token = np.linalg.norm(np.asarray(y, np.float64) - ref_y, axis=1) / np.linalg.norm(ref_y, axis=1)
    assert per_token.max() < tok_bound, (name, per_token.max())
    errs = {key: rel(got, ref_g[key]) for key, got in zip(("x", "router", "w1", "w2"), g)}
    print(name, per_token.max(), errs)
    assert max(errs.values()) < grad_bound, (name, errs)


def test_gated_activation_and_top1():
    """swiglu: w1 holds the two halves side by side; top_k=1 (weights are 1)."""
    x, r, w1, w2, dy = inputs(1)
    rng = np.random.default_rng(5)
    w1g = (rng.standard_normal((E, D, 2 * FF)) / np.sqrt(D)).astype(np.float32)
    y = jax.jit(lambda *a: moe.moe_mlp(*a, top_k=1, activation="swiglu"))(x, r, w1g, w2)
    _, top, _ = routing64(x, r, 1)
    xb = bf(x)
    for t in range(0, T, 7):
        e = top[t, 0]
        a = bf(xb[t] @ bf(w1g[e]))
        u, v = a[:FF], a[FF:]
        h = bf(u / (1 + np.exp(-u)) * v)
        want = h @ bf(w2[e])
        assert rel(y[t], want) < 1e-2, t


def test_delayed_scaling_state_is_updated_per_expert():
    x, r, w1, w2, dy = inputs(2)
    recipe = lowbit.DelayedScaling(amax_history_len=4)
    state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2
    y, g = grad_step(recipe=recipe)(x, r, w1, w2, dy, state)
    new1, new2 = g[4]
    _, top, _ = routing64(x, r, K)
    used = np.bincount(top.reshape(-1), minlength=E) > 0
    # fc1's x amax of each used expert is the largest |x| of its tokens (bf16-rounded).
    xb = np.abs(bf(x))
    for e in np.nonzero(used)[0]:
        want = xb[np.any(top == e, axis=1)].max()
        np.testing.assert_allclose(np.asarray(new1["x_amax_history"])[0, e], want, rtol=1e-6)
    assert np.all(np.asarray(new2["grad_amax_history"])[0, used] > 0)
    ref_y, _ = reference(x, r, w1, w2, K, dy)
    assert rel(y, ref_y) < 8e-2


# ---------------------------------------------------------------------------------------------
# Argument errors (one device; the mesh ones in the subprocess)
# ---------------------------------------------------------------------------------------------
def _bad_calls(mesh=None):
    x, r, w1, w2, _ = inputs(0)
    call = moe.moe_mlp
    cases = [
        ("top_k > experts", lambda: call(x, r, w1, w2, top_k=E + 1), ["top_k", str(E)]),
        ("top_k zero", lambda: call(x, r, w1, w2, top_k=0), ["top_k"]),
        ("x 3-D", lambda: call(x[None], r, w1, w2, top_k=K), ["x", "2-D"]),
        ("router rows", lambda: call(x, r[1:], w1, w2, top_k=K), ["router_kernel"]),
        ("w1 experts", lambda: call(x, r, w1[1:], w2, top_k=K), ["w1"]),
        ("w2 shape", lambda: call(x, r, w1, w2[:, 1:], top_k=K), ["w2"]),
        ("capacity_factor", lambda: call(x, r, w1, w2, top_k=K, capacity_factor=0.0), ["capacity_factor"]),
        ("state without delayed", lambda: call(x, r, w1, w2, top_k=K, state=({}, {})), ["state"]),
        (
            "delayed without state",
            lambda: call(x, r, w1, w2, top_k=K, recipe=lowbit.DelayedScaling()),
            ["state"],
        ),
        (
            "expert_axis without mesh",
            lambda: call(x, r, w1, w2, top_k=K, expert_axis="ep"),
            ["expert_axis", "mesh"],
        ),
    ]
    if mesh is not None:
        cases += [
            (
                "axis missing",
                lambda: call(x, r, w1, w2, top_k=K, mesh=mesh, expert_axis="tp"),
                ["expert_axis", "tp"],
            ),
            ("no axis", lambda: call(x, r, w1, w2, top_k=K, mesh=mesh), ["expert_axis"]),
            (
                "experts not divisible",
                lambda: call(x, r[:, :6], w1[:6], w2[:6], top_k=K, mesh=mesh, expert_axis="ep"),
                ["experts", "6", "ep", "4"],
            ),
            (
                "tokens not divisible",
                lambda: call(x[:62], r, w1, w2, top_k=K, mesh=mesh, expert_axis="ep"),
                ["tokens", "62", "ep"],
            ),
            (
                "dispatch",
                lambda: call(x, r, w1, w2, top_k=K, mesh=mesh, expert_axis="ep", dispatch="dense"),
                ["dispatch", "dense"],
            ),
            (
                "ep_chunks zero",
                lambda: call(x, r, w1, w2, top_k=K, mesh=mesh, expert_axis="ep", ep_chunks=0),
                ["ep_chunks", "0"],
            ),
            (
                "ep_chunks not dividing the tokens",
                lambda: call(x, r, w1, w2, top_k=K, mesh=mesh, expert_axis="ep", ep_chunks=3),
                ["ep_chunks", "3", str(T // N_DEV)],
            ),
            (
                "ep_chunks with DelayedScaling state",
                lambda: call(
                    x,
                    r,
                    w1,
                    w2,
                    top_k=K,
                    mesh=mesh,
                    expert_axis="ep",
                    ep_chunks=2,
                    recipe=lowbit.DelayedScaling(),
                    state=(lowbit.init_grouped_delayed_state(lowbit.DelayedScaling(), E),) * 2,
                ),  # fmt: skip
                ["ep_chunks", "DelayedScaling"],
            ),
            (
                "ragged on cpu",
                lambda: call(x, r, w1, w2, top_k=K, mesh=mesh, expert_axis="ep", dispatch="ragged"),
                ["ragged", "cpu", "capacity"],
            ),
        ]
    return cases


def _check_errors(cases):
    for name, thunk, words in cases:
        with pytest.raises(ValueError) as info:
            thunk()
        msg = str(info.value).lower()
        assert all(w.lower() in msg for w in words), (name, str(info.value))


def test_bad_arguments_name_the_argument():
    _check_errors(_bad_calls())
    x, r, w1, w2, _ = inputs(0)
    with pytest.raises(TypeError, match="moe_mlp: x"):
        moe.moe_mlp(x.astype(np.int32), r, w1, w2, top_k=K)


def test_ragged_dispatch_across_processes_names_the_xla_flag(monkeypatch):
    """One process per GPU (jax.distributed): XLA refuses the ragged all-to-all's NCCL fallback
    at run time unless XLA_FLAGS allows it (2 x H200, jax 0.11.2, `scripts/gpu_multi.sh mp-moe`).
    dispatch='ragged' then says so at trace time; with the flag set, or in one process, it is kept;
    the default dispatch never needs it."""
    monkeypatch.setattr(ep_choice, "platform_of", lambda mesh: "cuda")
    monkeypatch.setattr(ep_choice.jax, "process_count", lambda: 2)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    with pytest.raises(
        ValueError, match=r"across 2 processes needs XLA_FLAGS=--xla_gpu_allow_ragged_all_to_all"
    ):
        ep_choice.pick_dispatch("ragged", None)
    assert ep_choice.pick_dispatch("auto", None) == "capacity"
    monkeypatch.setenv("XLA_FLAGS", f"--{ep_choice.RAGGED_NCCL_FLAG}=true")
    assert ep_choice.pick_dispatch("ragged", None) == "ragged"
    monkeypatch.setattr(ep_choice.jax, "process_count", lambda: 1)
    monkeypatch.delenv("XLA_FLAGS")
    assert ep_choice.pick_dispatch("ragged", None) == "ragged"


# ---------------------------------------------------------------------------------------------
# Expert parallelism on 4 host devices (subprocess)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    (
        "capacity",
        "exact",
        "audit",
        pytest.param("ragged_emulated", marks=pytest.mark.slow),
        "drops",
        "errors",
        "chunks",
        "chunks_audit",
    ),
)
def test_expert_parallel_on_host_devices(case):
    from helpers import multi_device_env  # 4 forced host devices, src/ on the path

    argv = [sys.executable, os.path.abspath(__file__), case]
    r = subprocess.run(argv, env=multi_device_env(N_DEV), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


@pytest.mark.parametrize("d", (1, 5, 64))
def test_block_counts_round_trip(d):
    """The capacity dispatch's per-expert counts ride in the token blocks as bf16 base-256
    digits (one all-to-all instead of two): every count below 2^24 comes back exactly, in as
    many rows as d needs."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 2**24, size=(4, 3)).astype(np.int32)
    counts[0] = (0, 255, 2**24 - 1)
    rows = ep_dispatch.encode_counts(jnp.asarray(counts), d, jnp.bfloat16)
    assert rows.dtype == jnp.bfloat16 and rows.shape == (4, -(-9 // d), d)
    np.testing.assert_array_equal(np.asarray(ep_dispatch.decode_counts(rows, 3)), counts)


def test_receive_maps_pad_each_expert_to_16_rows():
    """Under FP8 the capacity dispatch's receiver lays each local expert's rows out from a
    multiple of 16 in whole 16-row units (as the one-device dispatch pads them): every received
    row lands once, in its expert's group, in (source, rank) order; padding rows come from no
    block and go back to none; without align the layout is the packed one."""
    recv = np.array([[3, 0, 17], [5, 1, 0], [0, 16, 2]], np.int32)  # (sources, local experts)
    n, El = recv.shape
    C = 20
    for align in (0, 16):
        take, give, size = (np.asarray(a) for a in ep_dispatch.receive_maps(jnp.asarray(recv), C, align))
        rows = buffer_rows(n * C, El, align, round_rows=True)
        tot = recv.sum(axis=0)
        want = tot if not align else -(-tot // 16) * 16
        np.testing.assert_array_equal(size, want)
        assert take.shape == (rows,) and give.shape == (n * C,) and rows >= size.sum()
        starts = np.concatenate([[0], np.cumsum(size)[:-1]])
        seen = []
        for s_ in range(n):
            r = 0
            for e in range(El):
                for k in range(recv[s_, e]):
                    at = give[s_ * C + r]
                    assert starts[e] <= at < starts[e] + tot[e] and take[at] == s_ * C + r
                    seen.append(at)
                    r += 1
            assert np.all(give[s_ * C + r : (s_ + 1) * C] == rows)  # unused block rows: none
        assert len(set(seen)) == tot.sum()
        assert np.count_nonzero(take != n * C) == tot.sum()  # the padding rows take no block row
        if align:
            assert np.all(starts % 16 == 0) and rows % 16 == 0


_TOY_HLO = """HloModule toy
%wrapped (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %all-to-all.9 = f32[4]{0} all-to-all(%p), replica_groups={{0,1}}
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %x = f32[4]{0} all-to-all(%a), replica_groups={{0,1}}
  %f = f32[4]{0} fusion(%x, %b), kind=kLoop, calls=%fused
  %y = f32[4]{0} call(%f), to_apply=%wrapped
  %z = f32[4]{0} all-to-all(%b), replica_groups={{0,1}}, metadata={op_name="%x"}
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%y, %z)
}
"""


def test_all_to_all_groups_follow_data_through_calls():
    """The chunk-independence audit: the all-to-all inside ``%wrapped`` counts as its caller
    ``%y``, which reads ``%x``'s result through a fusion (one group of 2); ``%z`` reads only a
    parameter (its metadata naming ``%x`` is no operand): a group of its own."""
    from lowbit.bench.multi_device import all_to_all_groups

    assert all_to_all_groups(_TOY_HLO) == [2, 1]
    assert all_to_all_groups(_TOY_HLO.replace("all-to-all(%b)", "all-to-all(%f)")) == [3]


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.gpu
def test_ragged_dispatch_on_gpus():
    """The real ragged_all_to_all (GPU only) against one device, BF16 and FP8; 'auto' (capacity);
    a smaller buffer; the documented drops; the capacity dispatch on the GPU too (BF16 also in
    two ep_chunks), and its compiled step's audit (four bf16 all-to-alls, no token scatter)."""
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 CUDA devices, found {len(gpus)}")
    n = 4 if len(gpus) >= 4 else 2
    mesh = jax.sharding.Mesh(np.array(gpus[:n]), ("ep",))
    with jax.default_device(gpus[0]):
        _compare_ep(mesh, "ragged", ("bf16", "current"), hlo_op="ragged-all-to-all")
        # half the worst-case buffer (no drop for these tokens); auto = the capacity dispatch.
        _compare_ep(mesh, "ragged", ("bf16",), hlo_op="ragged-all-to-all", capacity_factor=2.0)
        _compare_ep(mesh, "auto", ("bf16",), hlo_op="all-to-all")
        _check_drops(mesh, "ragged", 0.75)
        _compare_ep(mesh, "capacity", ("current",), hlo_op="all-to-all")
        _compare_ep(mesh, "capacity", ("bf16",), hlo_op="all-to-all", ep_chunks=2)
        _check_audit(mesh)
    print("OK ragged on", n, "GPUs")


# ---------------------------------------------------------------------------------------------
# The worker (runs in the subprocess) and what it shares with the GPU test
# ---------------------------------------------------------------------------------------------
def _place(mesh, x, r, w1, w2, dy):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, r, w1, w2, dy), specs)]


def _compare_ep(mesh, dispatch, names, hlo_op=None, capacity_factor=None, seed=3, ep_chunks=1):
    """Expert-parallel outputs and gradients within bf16 rounding of one device's."""
    from lowbit.bench.multi_device import bound_ratio

    data = inputs(seed)
    for name in names:
        one = grad_step(recipe=RECIPES[name])(*data)
        ep = grad_step(
            recipe=RECIPES[name],
            mesh=mesh,
            expert_axis="ep",
            dispatch=dispatch,
            capacity_factor=capacity_factor,
            ep_chunks=ep_chunks,
        )
        args = _place(mesh, *data)
        got = ep(*args)
        worst, leaf = bound_ratio(one, got, where=True)
        assert worst <= 1.0, (dispatch, name, worst, leaf)
        if hlo_op is not None:
            hlo = ep.lower(*args).compile().as_text()
            assert f" {hlo_op}(" in hlo or f" {hlo_op}-start(" in hlo, (dispatch, name)
            assert " all-gather(" not in hlo and " all-gather-start(" not in hlo, (dispatch, name)


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """jax.lax.ragged_all_to_all as its docstring specifies, from dense all_to_alls (XLA:CPU
    has no ragged-all-to-all): every slice padded to the operand's rows."""
    n = jax.lax.axis_size(axis_name)
    N, M = input_offsets.shape[0], operand.shape[0]
    rows = jnp.arange(M)
    idx = jnp.minimum(input_offsets[:, None] + rows, M - 1)
    valid = rows[None, :] < send_sizes[:, None]
    buf = jnp.where(valid[..., None], operand[idx], 0).reshape(n, (N // n) * M, *operand.shape[1:])
    got = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True).reshape(N, M, *operand.shape[1:])
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = jnp.where(rows[None, :] < recv_sizes[:, None], where[:, None] + rows, output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(N * M, *operand.shape[1:]), mode="drop")


def _dropped(top, n, rows, dispatch, chunks=1):
    """kept (T, k) under the documented drop rule: 'capacity': per (source, destination), the
    source's pairs in (expert, token) order past ``rows`` (with ``chunks``: per (chunk, source,
    destination)); 'ragged': per destination, its rows in (expert, source, token) order (=
    (expert, token): sources hold consecutive tokens) past ``rows``."""
    Tg, k = top.shape
    flat = np.arange(Tg * k)  # pair (t, j) at t * k + j
    expert = top.reshape(-1)
    dest = expert // (E // n)
    tok = flat // k
    chunk = tok % (Tg // n) // (Tg // n // chunks)
    group = (dest * n + tok // (Tg // n)) * chunks + chunk if dispatch == "capacity" else dest
    order = np.lexsort((flat, expert))
    kept = np.ones(Tg * k, bool)
    for g in np.unique(group):
        kept[order[group[order] == g][rows:]] = False
    return kept.reshape(Tg, k)


def _check_drops(mesh, dispatch, factor, chunks=1):
    n = mesh.shape["ep"]
    x, r, w1, w2, dy = inputs(4)
    _, top, _ = routing64(x, r, K)
    rows = moe.buffer_rows(dispatch, T // n, K, E, n, factor, chunks)
    kept = _dropped(top, n, rows, dispatch, chunks)
    dropped = int((~kept).sum())
    assert dropped > 0, (dispatch, factor, rows)
    ref_y, ref_g = reference(x, r, w1, w2, K, dy, kept)
    full_y, _ = reference(x, r, w1, w2, K, dy)
    kw = {} if chunks == 1 else {"ep_chunks": chunks}
    y, g = grad_step(mesh=mesh, expert_axis="ep", dispatch=dispatch, capacity_factor=factor, **kw)(
        *_place(mesh, x, r, w1, w2, dy)
    )
    y = np.asarray(y, np.float64)
    scale = np.linalg.norm(full_y, axis=1)  # a token may lose all its pairs (then y is 0)
    err = np.linalg.norm(y - ref_y, axis=1) / scale
    assert err.max() < 1e-2, (dispatch, err.max())
    # The count: exactly the tokens with a dropped pair differ from the dropless result.
    off = np.linalg.norm(y - full_y, axis=1) / scale > 2e-2
    assert np.array_equal(off, ~kept.all(axis=1)), (dispatch, off.sum(), (~kept.all(axis=1)).sum())
    for key, got in zip(("x", "router", "w1", "w2"), g):
        assert rel(got, ref_g[key]) < 2e-2, (dispatch, key, rel(got, ref_g[key]))
    print(
        f"{dispatch} capacity_factor={factor} chunks={chunks}: {rows} rows,",
        f"{dropped} of {T * K} pairs dropped",
    )


def _check_exact(mesh):
    """Dropless EP4 computes the one-device function: y, dx, dw1, dw2 bit for bit (the same
    rows in the same order reach each expert's GEMMs; padding rows are zero), the router's
    gradient up to the order of the sum over devices; and both within the float64 bounds."""
    data = inputs(7)
    ref_y, ref_g = reference(*data[:4], K, data[4])
    for name in ("bf16", "current"):
        one = grad_step(recipe=RECIPES[name])(*data)
        y, g = grad_step(recipe=RECIPES[name], mesh=mesh, expert_axis="ep", dispatch="capacity")(
            *_place(mesh, *data)
        )
        np.testing.assert_array_equal(np.asarray(y), np.asarray(one[0]))
        for key, a, b in zip(("x", "router", "w1", "w2"), one[1], g):
            if key == "router":
                assert rel(b, np.asarray(a, np.float64)) < 1e-6, name
            else:
                np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{name} d{key}")
        tok_bound, grad_bound = BOUNDS[name]
        assert rel(y, ref_y) < tok_bound, name
        errs = {key: rel(got, ref_g[key]) for key, got in zip(("x", "router", "w1", "w2"), g)}
        assert max(errs.values()) < grad_bound, (name, errs)


def _check_audit(mesh):
    """The compiled EP4 fwd+bwd step moves tokens in exactly four bf16 all-to-alls (dispatch and
    combine, each way) of one device's capacity blocks, never gathers tokens or weights, never
    all-reduces an expert's gradient, and scatters no token rows."""
    import re

    from lowbit.bench.multi_device import audit_hlo, check_moe_step

    n, t = mesh.shape["ep"], 256
    data = inputs(8, t=t)
    for cf in (None, 1.25):
        step = grad_step(mesh=mesh, expert_axis="ep", dispatch="capacity", capacity_factor=cf)
        args = _place(mesh, *data)
        low = step.lower(*args)
        hlo = low.compile().as_text()
        rows = moe.buffer_rows("capacity", t // n, K, E, n, cf)
        assert check_moe_step(hlo, t // n, D, E, n, rows) == [], (
            cf,
            check_moe_step(hlo, t // n, D, E, n, rows),
        )
        counts = audit_hlo(hlo)["counts"]
        assert counts["all-to-all"] == 4 and counts["all-gather"] == counts["reduce-scatter"] == 0, counts
        # The payload's dtype before XLA:CPU widens bf16 collectives to f32.
        types = re.findall(r"stablehlo.all_to_all.*?-> (tensor<[^>]*>)", low.as_text())
        m = ep_dispatch.meta_rows(E // n, D)
        assert sorted(types) == sorted(
            [f"tensor<{n}x{rows + m}x{D}xbf16>"] * 2 + [f"tensor<{n * rows}x{D}xbf16>"] * 2
        ), types


def _check_chunks(mesh):
    """ep_chunks c: each device's tokens in c independent chunks. Without drops the step equals
    the unchunked one: y and dx bit for bit (each row meets the same arithmetic), the router's
    gradient to 1e-6, the experts' gradients (a sum over the chunks' GEMMs) within bf16
    rounding of the unchunked ones; all within the float64 bounds, FP8 current scaling (an
    amax per chunk) too. With drops: the documented rule, per chunk."""
    from lowbit.bench.multi_device import bound_ratio

    n = mesh.shape["ep"]
    data = inputs(7)
    _, top, _ = routing64(data[0], data[1], K)
    ref_y, ref_g = reference(*data[:4], K, data[4])
    args = _place(mesh, *data)
    for cf in (None, 3.0):
        base = grad_step(mesh=mesh, expert_axis="ep", dispatch="capacity", capacity_factor=cf)(*args)
        for c in (2, 4):
            rows = moe.buffer_rows("capacity", T // n, K, E, n, cf, c)
            assert _dropped(top, n, rows, "capacity", c).all(), (cf, c, rows)  # a no-drop case
            y, g = grad_step(
                mesh=mesh, expert_axis="ep", dispatch="capacity", capacity_factor=cf, ep_chunks=c
            )(*args)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(base[0]), err_msg=f"{cf} {c} y")
            np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(base[1][0]), err_msg=f"{cf} {c} dx")
            assert rel(g[1], np.asarray(base[1][1], np.float64)) < 1e-6, (cf, c)
            worst, leaf = bound_ratio(base, (y, g), where=True)
            assert worst <= 1.0, (cf, c, worst, leaf)
            errs = {key: rel(got, ref_g[key]) for key, got in zip(("x", "router", "w1", "w2"), g)}
            assert rel(y, ref_y) < BOUNDS["bf16"][0] and max(errs.values()) < BOUNDS["bf16"][1], (cf, c, errs)
    y, g = grad_step(
        recipe=RECIPES["current"], mesh=mesh, expert_axis="ep", dispatch="capacity", ep_chunks=2
    )(*args)
    errs = {key: rel(got, ref_g[key]) for key, got in zip(("x", "router", "w1", "w2"), g)}
    assert rel(y, ref_y) < BOUNDS["current"][0] and max(errs.values()) < BOUNDS["current"][1], errs
    _check_drops(mesh, "capacity", 0.6, chunks=2)


def _chained_capacity(cfg, x, weights, experts, *rest):
    """The chunked capacity path with chunk i + 1's tokens made to wait on chunk i's output
    (adding zero times one of its rows): what the audit must reject."""
    Tc, parts = x.shape[0] // cfg.chunks, []
    for i in range(cfg.chunks):
        sl = slice(i * Tc, (i + 1) * Tc)
        xi = x[sl] if not parts else x[sl] + 0 * parts[-1][:1]
        parts.append(moe._capacity_chunk(cfg, xi, weights[sl], experts[sl], *rest))
    return jnp.concatenate(parts)


def _check_chunks_audit(mesh):
    """The compiled chunked fwd+bwd step: four bf16 all-to-alls per chunk (dispatch with its
    count rows and combine, each way) of one chunk's blocks, nothing else gathered or
    scattered, and the chunks' all-to-alls in independent dependency groups of four (none
    waits on another chunk's values); the same audit rejects chunks chained to each other."""
    import re

    from lowbit.bench.multi_device import all_to_all_groups, audit_hlo, check_moe_step

    n, t = mesh.shape["ep"], 256
    args = _place(mesh, *inputs(8, t=t))
    m = ep_dispatch.meta_rows(E // n, D)
    for cf, c in ((None, 2), (1.25, 4)):
        step = grad_step(mesh=mesh, expert_axis="ep", dispatch="capacity", capacity_factor=cf, ep_chunks=c)
        low = step.lower(*args)
        hlo = low.compile().as_text()
        rows = moe.buffer_rows("capacity", t // n, K, E, n, cf, c)
        problems = check_moe_step(hlo, t // n, D, E, n, rows, c)
        assert problems == [], (cf, c, problems)
        counts = audit_hlo(hlo)["counts"]
        assert counts["all-to-all"] == 4 * c, counts
        assert counts["all-gather"] == counts["reduce-scatter"] == counts["collective-permute"] == 0, counts
        assert all_to_all_groups(hlo) == [4] * c
        types = re.findall(r"stablehlo.all_to_all.*?-> (tensor<[^>]*>)", low.as_text())
        assert sorted(types) == sorted(
            [f"tensor<{n}x{rows + m}x{D}xbf16>", f"tensor<{n * rows}x{D}xbf16>"] * 2 * c
        ), types
    moe._capacity = _chained_capacity
    step = grad_step(mesh=mesh, expert_axis="ep", dispatch="capacity", ep_chunks=2)
    hlo = step.lower(*args).compile().as_text()
    rows = moe.buffer_rows("capacity", t // n, K, E, n, None, 2)
    assert all_to_all_groups(hlo) == [8], all_to_all_groups(hlo)
    assert any("dependent" in p for p in check_moe_step(hlo, t // n, D, E, n, rows, 2))


def _worker(case: str) -> None:
    assert len(jax.devices()) == N_DEV, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    if case == "capacity":
        _compare_ep(mesh, "capacity", ("bf16", "current"), hlo_op="all-to-all")
        _compare_ep(mesh, "auto", ("bf16",))  # auto: capacity on CPU
        # DelayedScaling: the per-expert state sharded like the experts, updated as on one device.
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from lowbit.bench.multi_device import bound_ratio

        recipe = lowbit.DelayedScaling(amax_history_len=4)
        state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2
        data = inputs(6)
        one = grad_step(recipe=recipe)(*data, state)
        sh = jax.tree_util.tree_map(lambda a: NamedSharding(mesh, P(*([None] * (a.ndim - 1)), "ep")), state)
        got = grad_step(recipe=recipe, mesh=mesh, expert_axis="ep", dispatch="capacity")(
            *_place(mesh, *data), jax.device_put(state, sh)
        )
        assert bound_ratio(one, got) <= 1.0
    elif case == "exact":
        _check_exact(mesh)
    elif case == "audit":
        _check_audit(mesh)
    elif case == "ragged_emulated":
        jax.lax.ragged_all_to_all = _emulated_ragged_all_to_all
        ep_choice.RAGGED_PLATFORMS += ("cpu",)
        _compare_ep(mesh, "ragged", ("bf16", "current"))
        _compare_ep(mesh, "ragged", ("bf16",), capacity_factor=2.0)  # half the worst case, no drop
        _check_drops(mesh, "ragged", 0.75)
    elif case == "drops":
        _check_drops(mesh, "capacity", 0.6)
    elif case == "chunks":
        _check_chunks(mesh)
    elif case == "chunks_audit":
        _check_chunks_audit(mesh)
    elif case == "errors":
        _check_errors(_bad_calls(mesh))
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"OK {case}")


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_audit_accepts_the_router_gradient_flattened_with_scalars():
    """On GPUs XLA combined the router gradient (1024 x 8) and the loss into one f32[8193]
    all-reduce (4 x H200, session 10); that is not an expert gradient or a token batch. A
    larger all-reduce still fails the audit."""
    from lowbit.bench.multi_device import check_moe_step

    def allreduce_problems(n):
        line = (
            f"  %ar = (f32[{n}]{{0}}, f32[{n}]{{0}}) all-reduce-start(f32[{n}]{{0}} %p), replica_groups={{}}"
        )
        return [p for p in check_moe_step(line, 2048, 1024, 8, 4, 1127) if "all-reduce" in p]

    assert allreduce_problems(1024 * 8 + 1) == []
    assert allreduce_problems(1024 * 16) != []
