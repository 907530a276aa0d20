"""Tensor-parallel overlap (``lowbit.dense(..., tp_overlap=True)``, lowbit.ops.collective_dense,
issue 24) on 4 forced CPU devices, a subprocess per case as tests/test_sequence_parallel.py runs
them: the mesh is dp=2 x tp=2 with ``tpsp_resource="tp"``.

Each recipe's overlapped step (rings of collective-permutes) is compared with the non-overlapped
one (XLA's all-gather / reduce-scatter) and with a float64 reference of the same inputs: FP8
y and dx are exact (each element is one unsplit dot, or a sum of tp=2 float32 partials, which
commutes), the wgrad and dbias within one rounding of their float32 sums, and both paths equally
far from float64. The compiled steps move their activations by collective-permute only.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import multi_device_env

N_DEV = 4
CASES = ("column", "row", "hlo", "mlp", "bad_input")


@pytest.mark.parametrize("case", CASES)
def test_collective_dense(case):
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case],
        env=multi_device_env(N_DEV),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


def test_bench_overlap_stage(tmp_path):
    """`python -m lowbit.bench multi_device --stage overlap` on 4 host devices: every case off and
    on, the same results, and the rings in place of the gathers and scatters."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "lowbit.bench", "multi_device", "--stage", "overlap", "--small", "--quick"]
        + ["--cpu-devices", str(N_DEV), "--out", str(tmp_path)],
        env=multi_device_env(1),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    (path,) = glob.glob(os.path.join(str(tmp_path), "multi_device-overlap-*.json"))
    with open(path) as f:
        rows = json.load(f)["rows"]
    assert {(x["case"], x["recipe"]) for x in rows} == {
        (c, rec) for c in ("mlp", "dense column", "dense row") for rec in ("bf16", "current")
    }
    for x in rows:
        assert x["ms_off"] > 0 and x["ms_on"] > 0 and x["rel_diff"] <= 2.0**-6, x
        ag, rs, perm = map(int, x["ag_rs_permute_on"].split("/"))
        assert ag == rs == 0 and perm > 0, x


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
# S / tp = 128 rows per shard: whole 128-row blocks for Float8BlockScaling.
B, S, H, F = 4, 256, 256, 256
SEQ, FULL = ("dp", "tp", None), ("dp", None, "tp")  # (b, s, features): sequence / feature split
#: The collective-permute operands of a lowered step (StableHLO): XLA's CPU backend widens FP8
#: collectives when it compiles, so the dtype moved is read before that.
_PERMUTE_OPERAND = re.compile(r'"stablehlo\.collective_permute".* : \(tensor<[\dx]*x(\w+)>\) ->')


def _recipes():
    import lowbit

    return {
        "bf16": lambda: None,
        "delayed": lambda: lowbit.DelayedScaling(amax_history_len=4),
        "current": lowbit.Float8CurrentScaling,
        "block": lowbit.Float8BlockScaling,
        "mxfp8": lowbit.MXFP8BlockScaling,
    }


def _inputs():
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    x = np.asarray(jnp.asarray(rng.standard_normal((B, S, H)), bf))
    w = np.asarray(jnp.asarray(rng.standard_normal((H, F)) * 0.05, bf))
    b = np.asarray(jnp.asarray(rng.standard_normal(F), bf))
    dy = np.asarray(jnp.asarray(rng.standard_normal((B, S, F)), bf))
    return x, w, b, dy


def _run(recipe, layout, overlap, inputs, mesh, resource):
    """The step's results and its (StableHLO, compiled HLO) on the mesh."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench import multi_device as md

    st = lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None

    def dense(x, w, b, st):
        return lowbit.dense(x, w, b, recipe=recipe, state=st, tp_layout=layout, tp_overlap=overlap)

    def step(x, w, b, dy, st):
        y, vjp = jax.vjp(dense, x, w, b, st)
        return (y,) + vjp(dy)

    step = jax.jit(step)
    col = layout == "column"
    specs = (SEQ, (None, "tp"), ("tp",), FULL) if col else (FULL, ("tp", None), (None,), SEQ)
    args = md.put(inputs, tuple(NamedSharding(mesh, P(*s)) for s in specs))
    ctx = md._Ctx(mesh, resource, None)
    with ctx:
        lowered = step.lower(*args, st)
        texts = (lowered.as_text(), lowered.compile().as_text())
    return ctx.wrap(step)(*args, st), texts


def _reference(x, w, b, dy):
    """float64 y, dx, dkernel, dbias of the bf16 inputs."""
    import numpy as np

    x, w, b, dy = (np.asarray(a, np.float64) for a in (x, w, b, dy))
    x2, dy2 = x.reshape(-1, H), dy.reshape(-1, F)
    return (x @ w + b, dy @ w.T, x2.T @ dy2, dy2.sum(0))


def _equal_worker(layout):
    import jax
    import numpy as np
    from helpers import rel

    import lowbit
    from lowbit.bench import multi_device as md

    mesh = md._mesh((2, 2), ("dp", "tp"))
    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp", partial_sum_dtype="float32")
    inputs = _inputs()
    ref64 = _reference(*inputs)
    for name, make in _recipes().items():
        base, _ = _run(make(), layout, False, inputs, mesh, sp)
        got, _ = _run(make(), layout, True, inputs, mesh, sp)
        fp8 = name != "bf16"
        for n, r, g, r64 in zip(("y", "dx", "dk", "db"), base, got, ref64):
            tag = (name, layout, n)
            r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
            assert g.shape == r.shape == r64.shape, tag
            if fp8 and n in ("y", "dx"):
                assert np.array_equal(r, g), (tag, np.abs(r - g).max())
            elif fp8 or n in ("y", "dx"):  # float32 sums in another order: one rounding apart
                np.testing.assert_allclose(
                    g, r, rtol=2.0**-7, atol=2.0**-7 * np.abs(r64).max(), err_msg=str(tag)
                )
            # As close to float64 as the non-overlapped path (FP8: the formats' error; BF16:
            # rounding; XLA's BF16 wgrad and dbias sum in bf16 where the rings sum in float32).
            e_got, e_base = rel(g, r64), rel(r, r64)
            assert e_got <= 1.05 * e_base + 1e-3, (tag, e_got, e_base)
            assert e_got <= (0.1 if fp8 else 0.01), (tag, e_got)
        # DelayedScaling's state advances with the same global amaxes.
        for a, c in zip(jax.tree.leaves(base[4]), jax.tree.leaves(got[4])):
            assert np.array_equal(np.asarray(a), np.asarray(c)), name


def _hlo_worker():
    import numpy as np

    import lowbit
    from lowbit.bench import multi_device as md

    mesh = md._mesh((2, 2), ("dp", "tp"))
    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp")
    inputs = _inputs()
    for layout in ("column", "row"):
        for name in ("bf16", "current", "block"):
            recipe = _recipes()[name]()
            _, (stablehlo, hlo) = _run(recipe, layout, True, inputs, mesh, sp)
            colls = md.collectives(hlo)
            tag = (layout, name)
            ops = [c["op"] for c in colls]
            # No gather or scatter of an activation: the sequence moves chunk by chunk.
            assert "all-gather" not in ops and "reduce-scatter" not in ops, (tag, ops)
            permutes = [c for c in colls if c["op"] == "collective-permute"]
            # tp=2: one hand-over per ring; forward ring + backward ring; FP8 ships data and
            # (block scaling) its scales, the backward of the column layout a running sum too.
            assert len(permutes) >= 2, (tag, ops)
            chunk = B // 2 * S // 2  # a (dp, tp) shard's rows
            sizes = {e for c in permutes for e in c["elements"]}
            assert chunk * (H if layout == "column" else F) in sizes, (tag, sizes)
            # The only large all-reduce: the wgrad over dp; the amaxes are scalars.
            big = [c for c in colls if c["op"] == "all-reduce" and max(c["elements"], default=0) > 64]
            kshard = (H, F // 2) if layout == "column" else (H // 2, F)
            assert [s for c in big for _, s in c["results"] if len(s) > 1] == [kshard], (tag, big)
            moved = [m.group(1).lower() for m in map(_PERMUTE_OPERAND.search, stablehlo.splitlines()) if m]
            # Chunks and running sums only: no scalar (amax, per-tensor scale) goes round.
            assert len(permutes) == len(moved) and all(max(c["elements"]) > 64 for c in permutes), (
                tag,
                permutes,
            )
            if name == "bf16":
                assert set(moved) <= {"bf16", "f32"}, (tag, moved)
            else:  # FP8 chunks travel as FP8: x's (column forward), dy's (row backward)
                want = np.dtype(recipe.q_dtype("x" if layout == "column" else "grad")).name.replace(
                    "float8_", "f8"
                )
                assert want in moved, (tag, moved)


def _mlp_worker():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench import multi_device as md
    from lowbit.ops.fused.mlp import mlp

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 64, 128)), jnp.bfloat16)
    k1 = jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.bfloat16)
    k2 = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((4, 64, 128)), jnp.bfloat16)
    mesh = md._mesh((2, 2), ("dp", "tp"))
    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp", partial_sum_dtype="float32")
    for recipe in (lowbit.Float8CurrentScaling(), None):

        def step(x, k1, k2, dy, overlap, recipe=recipe):
            def f(x, k1, k2):
                return mlp(x, k1, None, k2, None, ("gelu",), recipe=recipe, tp_overlap=overlap)

            y, vjp = jax.vjp(f, x, k1, k2)
            return (y,) + vjp(dy)

        xs = NamedSharding(mesh, P(*SEQ))
        args = md.put(
            (x, k1, k2, dy), (xs, NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp")), xs)
        )
        ctx = md._Ctx(mesh, sp, None)
        outs = {}
        for overlap in (False, True):
            fn = jax.jit(lambda *a, o=overlap: step(*a, o))
            with ctx:
                ops = [c["op"] for c in md.collectives(fn.lower(*args).compile().as_text())]
            assert ("collective-permute" in ops) == overlap, (recipe, overlap, ops)
            assert ("all-gather" in ops or "reduce-scatter" in ops) != overlap, (recipe, overlap, ops)
            outs[overlap] = ctx.wrap(fn)(*args)
        for n, a, b in zip(("y", "dx", "dk1", "dk2"), outs[False], outs[True]):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(
                b, a, rtol=2.0**-6, atol=2.0**-7 * np.abs(a).max(), err_msg=f"{recipe} {n}"
            )
        assert tuple(outs[True][0].sharding.spec)[:2] == ("dp", "tp"), outs[True][0].sharding


def _bad_input_worker():
    import jax
    import jax.numpy as jnp

    import lowbit
    from lowbit.bench import multi_device as md

    mesh = md._mesh((2, 2), ("dp", "tp"))
    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp")
    w = jnp.ones((64, 64), jnp.bfloat16)
    for recipe in (lowbit.Float8CurrentScaling(), None):
        for shape, layout in (((4, 7, 64), "column"), ((4, 7, 64), "row"), ((4, 5, 64), "column")):
            x = jnp.ones(shape, jnp.bfloat16)
            with md._Ctx(mesh, sp, None):
                try:
                    jax.jit(
                        lambda x, w: lowbit.dense(x, w, recipe=recipe, tp_layout=layout, tp_overlap=True)
                    )(x, w)
                except ValueError as e:
                    msg = str(e)
                    assert "tp_overlap" in msg and "'tp'" in msg and str(shape) in msg, msg
                else:
                    raise AssertionError(f"no error for x {shape} ({layout}, {recipe})")
    # Without sequence parallelism tp_overlap changes nothing (no ring, same result).
    x = jnp.ones((4, 8, 64), jnp.bfloat16)
    with md._Ctx(mesh, lowbit.MeshResource(dp_resource="dp", tp_resource="tp"), None):
        a = jax.jit(lambda x, w: lowbit.dense(x, w, tp_overlap=True))(x, w)
        b = jax.jit(lambda x, w: lowbit.dense(x, w))(x, w)
    assert (a == b).all()


def _worker(case: str) -> None:
    import jax

    assert len(jax.devices()) == N_DEV, jax.devices()
    if case in ("column", "row"):
        _equal_worker(case)
    elif case == "hlo":
        _hlo_worker()
    elif case == "mlp":
        _mlp_worker()
    elif case == "bad_input":
        _bad_input_worker()
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"OK {case}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(sys.argv[1])
