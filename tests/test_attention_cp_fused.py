"""Context parallelism on a fused kernel per block (ops/attention/context_parallel_fused.py, issue
26): on 4 forced CPU devices (a subprocess per case, this file as the script) the schedule with
the jnp block kernels against a float64 reference and against one device's attention, forward
and backward, for ring and all-gather, causal (unbalanced and DualChunkSwap) and GQA without a
mask; the schedule traced with the cuDNN kernels: whole-block kernel calls only (no scores, no
gathered keys in the ring), each step's ppermute before its attention, half blocks under load
balancing, and the dispatch picks it wherever the handler runs. ``gpu`` tests: the cuDNN block
kernels against the jnp ones (output, log-sum-exp, gradients), and CP over every GPU against one
GPU's fused attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import multi_device_env, rel, run_worker

CASES = (
    "ring_causal",
    "ring_balanced",
    "ring_gqa_no_mask",
    "all_gather_causal",
    "all_gather_balanced",
    "dispatch_vs_one_device",
    "ring_structure",
    "all_gather_structure",
    "picked_where_the_handler_runs",
    "errors",
)


@pytest.mark.parametrize("case", CASES)
def test_fused_context_parallel(case):
    run_worker(__file__, case)


@pytest.mark.slow
def test_bench_cp_stage_small(tmp_path):
    """`python -m lowbit.bench multi_device --stage cp --small --quick` on 4 host devices: every
    row timed, the CP gradients equal one device's (bf16 inputs), the JSON written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "lowbit.bench", "multi_device", "--stage", "cp", "--small", "--quick", "--out",
         str(tmp_path)],
        env=multi_device_env(1), capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert r.returncode == 0 and "## multi_device cp" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]
    with open(os.path.join(str(tmp_path), "multi_device-cp-small.json")) as f:
        rows = json.load(f)["rows"]
    cases = [(row["case"], row["seq"]) for row in rows]
    assert cases == [
        ("one device", 64),
        ("cp all_gather load balanced", 64),
        ("cp ring load balanced", 64),
        ("one device", 256),
        ("one device unfused", 256),
        ("cp ring load balanced", 256),
    ], cases
    assert all(isinstance(row["ms"], float) and row["ms"] > 0 for row in rows), rows
    assert all(row["rel_diff"] < 2e-2 for row in rows if row["case"].startswith("cp") and row["seq"] == 64)
    assert all(row["scaling"] > 0 for row in rows), rows


# ---------------------------------------------------------------------------------------------
# GPU (in process)
# ---------------------------------------------------------------------------------------------
def _qkv(b, s, h, g, d, dtype, seed=0):
    r = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(r.standard_normal(sh), dtype) for sh in ((b, s, h, d), (b, s, g, d), (b, s, g, d))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("causal,sq,skv,g", [(True, 256, 256, 4), (False, 256, 128, 4), (False, 128, 256, 2)])
def test_cudnn_block_kernels_match_the_jnp_ones(gpu_device, causal, sq, skv, g):
    """The contract the schedule relies on: cuDNN's stats are the natural log-sum-exp of the
    scaled logits, and its backward given the global output and log-sum-exp is the jnp one's."""
    from lowbit.ops.attention import context_parallel_fused as cpf

    q = _qkv(1, sq, 4, g, 128, jnp.bfloat16)[0]
    _, k, v = _qkv(1, skv, 4, g, 128, jnp.bfloat16, seed=2)
    q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
    o, lse = cpf._cudnn_fwd(q, k, v, causal, 0.125)
    ro, rl = cpf._ref_fwd(q32, k32, v32, causal, 0.125)
    assert rel(o, ro) < 1e-2 and float(jnp.max(jnp.abs(lse - rl))) < 2e-2
    do = _qkv(1, sq, 4, 4, 128, jnp.bfloat16, seed=1)[0]
    got = cpf._cudnn_bwd(q, k, v, o, do, lse, causal, 0.125)
    want = cpf._ref_bwd(q32, k32, v32, o.astype(jnp.float32), do.astype(jnp.float32), lse, causal, 0.125)
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2, rel(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("balanced", [False, True])
def test_cudnn_context_parallel_matches_one_gpu(gpu_device, strategy, balanced):
    from jax.sharding import Mesh

    from lowbit.ops.attention import ReorderStrategy, inverse_reorder_causal_load_balancing
    from lowbit.ops.attention import reorder_causal_load_balancing as reorder
    from lowbit.ops.attention.context_parallel_fused import fused_context_parallel
    from lowbit.ops.fused_attention import fused_attention

    n = len(jax.devices("cuda"))
    if n < 2:
        pytest.skip("context parallelism needs 2 GPUs or more")
    q, k, v = _qkv(1, 512 * n, 8, 4, 128, jnp.bfloat16)
    dy = _qkv(1, 512 * n, 8, 4, 128, jnp.bfloat16, seed=1)[0].astype(jnp.float32)
    dcs = ReorderStrategy.DualChunkSwap

    def one(q, k, v):
        out = fused_attention(q, k, v, causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) * dy), out

    def cp(q, k, v):
        if balanced:
            q, k, v = (reorder(t, dcs, n, 1) for t in (q, k, v))
        out = fused_context_parallel(q, k, v, axis="cp", strategy=strategy, load_balanced=balanced)
        out = inverse_reorder_causal_load_balancing(out, dcs, n, 1) if balanced else out
        return jnp.sum(out.astype(jnp.float32) * dy), out

    (_, o1), g1 = jax.jit(jax.value_and_grad(one, (0, 1, 2), has_aux=True))(q, k, v)
    with jax.set_mesh(Mesh(np.array(jax.devices("cuda")), ("cp",))):
        (_, o2), g2 = jax.jit(jax.value_and_grad(cp, (0, 1, 2), has_aux=True))(q, k, v)
    assert rel(o2, o1) < 1e-2, rel(o2, o1)
    for a, b in zip(g2, g1):
        assert rel(a, b) < 2e-2, rel(a, b)


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
B, S, H, D, N = 2, 16, 4, 8, 4


def _reference(q, k, v, causal, scale):
    """float64 softmax attention over the whole sequence (GQA by repeating the groups)."""
    h, g = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _loss(f, dy, balanced):
    from lowbit.ops.attention import ReorderStrategy, inverse_reorder_causal_load_balancing
    from lowbit.ops.attention import reorder_causal_load_balancing as reorder

    dcs = ReorderStrategy.DualChunkSwap

    def loss(q, k, v):
        if balanced:  # the tensors go in reordered; the output comes back reordered
            q, k, v = (reorder(t, dcs, N, 1) for t in (q, k, v))
        out = f(q, k, v)
        out = inverse_reorder_causal_load_balancing(out, dcs, N, 1) if balanced else out
        return jnp.sum(out * dy), out

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)


def _structure(mesh, strategy):
    from helpers import jaxpr_eqns

    from lowbit.ops.attention.context_parallel_fused import fused_context_parallel

    s, h, d = 512, 4, 8  # per device 128 tokens: a block's scores would be 16x its queries
    q = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)

    def f(q, k, v):
        out = fused_context_parallel(q, k, v, axis="cp", strategy=strategy, load_balanced=True)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, q, q)
    eqns = list(jaxpr_eqns(jaxpr.jaxpr))
    names = [e.primitive.name for e in eqns]
    calls = [e for e in eqns if e.primitive.name == "ffi_call"]
    targets = [e.params["target_name"] for e in calls]
    # step 0 once, then (n - 1) steps of two c x c blocks each; forward and backward
    assert targets.count("lowbit_attention_fwd") == 1 + 2 * (N - 1), targets
    assert targets.count("lowbit_attention_bwd") == 1 + 2 * (N - 1), targets
    # balanced: past step 0 every kernel runs on a quarter block (half the queries x half the
    # keys), chosen by offset: no cond (XLA's GPU conditional syncs with the host every step)
    block = s // N
    half = [e for e in calls[1:] if e.params["target_name"] == "lowbit_attention_fwd"]
    shapes = {(e.invars[0].aval.shape[1], e.invars[1].aval.shape[1]) for e in half}
    assert shapes == {(block // 2, block // 2)}, shapes
    assert "cond" not in names, "a branch per step"
    q_block = block * h * d
    # the largest array a device holds: inside the shard_map (outside it are the global arrays)
    inner = [i for e in eqns if e.primitive.name == "shard_map" for i in jaxpr_eqns(e.params["jaxpr"])]
    big = max(int(np.prod(v.aval.shape)) for e in inner for v in e.outvars if hasattr(v.aval, "shape"))
    return names, big, q_block, block


def _run(case):
    from helpers import jaxpr_eqns, randn
    from jax.sharding import Mesh

    from lowbit.ops.attention import attention
    from lowbit.ops.attention.context_parallel_fused import fused_context_parallel

    mesh = Mesh(np.array(jax.devices()), ("cp",))
    if case in ("ring_structure", "all_gather_structure"):
        strategy = case[: -len("_structure")]
        names, big, q_block, block = _structure(mesh, strategy)
        # unbalanced causal: a later device's block is computed and dropped, not branched on
        with jax.set_mesh(mesh):
            q = jax.ShapeDtypeStruct((1, 512, 4, 8), jnp.bfloat16)
            f = lambda q, k, v: jnp.sum(  # noqa: E731
                fused_context_parallel(q, k, v, axis="cp", strategy=strategy).astype(jnp.float32)
            )
            unbalanced = jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, q, q)
        assert "cond" not in [e.primitive.name for e in jaxpr_eqns(unbalanced.jaxpr)]
        if strategy == "ring":
            assert "all_gather" not in names and "psum_scatter" not in names, names
            # (k, v) passed on 3 times forward, 3 times backward; (dk, dv) 4 times
            assert names.count("ppermute") == 2 * 3 + 2 * 3 + 2 * 4, names.count("ppermute")
            assert names.index("ppermute") < names.index("ffi_call") or names[:1] == ["ppermute"]
            step1 = names.index("ffi_call", names.index("ffi_call") + 1)
            assert "ppermute" in names[names.index("ffi_call") : step1], (
                "the next transfer is issued before step 1's attention"
            )
            assert big <= 2 * q_block, (big, q_block)  # O(s / n): no scores, no gathered keys
        else:
            # (k, v) gathered forward and again backward; (dk, dv) reduce-scattered once
            assert names.count("all_gather") == 4 and names.count("reduce_scatter") == 2, names
            assert big <= N * q_block, (big, q_block)  # the gathered keys, never scores
        return
    if case == "picked_where_the_handler_runs":
        from lowbit.ops.attention import context_parallel_fused as cpf
        from lowbit.ops.attention import make_spec, pick_implementation

        x = jnp.zeros((1, 64, 4, 128), jnp.bfloat16)
        with jax.set_mesh(mesh):
            spec = make_spec(x, x, x, scale=0.1, mask_type="causal", context_parallel_axis="cp")
            assert pick_implementation(spec) == "xla"  # no GPU here: the jnp path as before
            cpf.handler_runs = lambda spec: True
            assert pick_implementation(spec) == "cudnn_cp"  # where lowbit's handler runs
            spec_drop = make_spec(
                x, x, x, scale=0.1, mask_type="causal", context_parallel_axis="cp", dropout_rate=0.1
            )
            assert pick_implementation(spec_drop) == "xla"  # dropout keeps the jnp path
        return
    if case == "errors":
        x = jnp.zeros((1, 8 * N, 2, 8))
        with jax.set_mesh(mesh):
            for kw, msg in (
                (dict(strategy="p2p"), "strategy must be 'ring' or 'all_gather'"),
                (dict(kernels="triton"), "kernels must be one of"),
                (dict(load_balanced=True, causal=True, q=jnp.zeros((1, 4 * N + 2, 2, 8))), "must divide"),
                (dict(load_balanced=True, causal=True, q=jnp.zeros((1, N, 2, 8))), "even block"),
            ):
                qq = kw.pop("q", x)
                try:
                    fused_context_parallel(qq, qq, qq, axis="cp", **kw)
                except ValueError as e:
                    assert msg in str(e), (msg, e)
                else:
                    raise AssertionError(f"no error for {kw}")
        return

    gqa = "gqa" in case
    g = 2 if gqa else H
    causal, balanced = not gqa, "balanced" in case
    strategy = "all_gather" if case.startswith("all_gather") else "ring"
    scale = 0.3
    if case == "dispatch_vs_one_device":  # float32 through attention(): the spec's fields reach it
        q, k, v, dy = (
            randn((B, S, H, D), 1),
            randn((B, S, 2, D), 2),
            randn((B, S, 2, D), 3),
            randn((B, S, H, D), 4),
        )
        kw = dict(scale=scale, mask_type="causal")
        one = _loss(lambda q, k, v: attention(q, k, v, **kw), dy, False)(q, k, v)
        for strat in ("RING", "ALL_GATHER"):
            cp_kw = dict(kw, context_parallel_axis="cp", context_parallel_strategy=strat)
            cp_kw.update(context_parallel_load_balanced=True)
            f = lambda q, k, v: attention(q, k, v, implementation="blockwise_cp", **cp_kw)  # noqa: E731
            with jax.set_mesh(mesh):
                got = jax.jit(_loss(f, dy, True))(q, k, v)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
                assert rel(a, b) < 1e-5, (strat, rel(a, b))
        return
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(0)
    q, dy = (jnp.asarray(r.standard_normal((B, S, H, D))) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((B, S, g, D))) for _ in range(2))
    want = _loss(lambda q, k, v: _reference(q, k, v, causal, scale), dy, False)(q, k, v)

    def f(q, k, v):
        return fused_context_parallel(
            q, k, v, axis="cp", strategy=strategy, causal=causal, load_balanced=balanced, scale=scale,
            kernels="reference",
        )  # fmt: skip

    with jax.set_mesh(mesh):
        got = jax.jit(_loss(f, dy, balanced))(q, k, v)
    assert got[0][1].dtype == jnp.float64
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel(a, b) < 1e-12, rel(a, b)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _run(sys.argv[1])
    print(f"OK {sys.argv[1]}")
