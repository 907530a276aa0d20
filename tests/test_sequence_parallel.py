"""Sequence parallelism (``MeshResource(tpsp_resource=...)``, issue 24 point 6) on 4 forced CPU
devices, as tests/test_sharding.py runs its checks: a subprocess per case (this file as a script)
with XLA_FLAGS=--xla_force_host_platform_device_count=4.

The mesh is dp=2 x tp=2 with ``tpsp_resource="tp"``: activations between blocks split along the
sequence over tp, an FP8 all-gather along the sequence before each column-parallel GEMM and a
reduce-scatter after each row-parallel one. Results are compared with one device's: exact where
each element is one unsplit dot (y of a column GEMM, dx of a row GEMM, a norm's output), within
test_sharding's bound where a contraction is split (float32 partial sums, rounded once); modules
within ``lowbit.bench.multi_device.bound_ratio`` <= 1 (test_multi_device's bound).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import jaxpr_eqns, multi_device_env

N_DEV = 4
CASES = (
    "dense_column",
    "dense_row",
    "dense_hlo",
    "dense_uneven",
    "norm",
    "bad_resource",
    "layernorm_mlp",
    "transformer_layer",
    "layer_constraints",
)


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel(case):
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case],
        env=multi_device_env(N_DEV),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
FP8 = ("f8e4m3fn", "f8e5m2")
#: XLA's CPU backend widens FP8 collectives to f16 when it compiles (GPUs move FP8 bytes), so the
#: dtype a step gathers is read from its lowered StableHLO; the compiled HLO gives the counts.
_GATHER_OPERAND = re.compile(r'"stablehlo\.all_gather".* : \(tensor<[\dx]*x(\w+)>\) ->')


def _gathered_dtypes(stablehlo: str) -> list:
    """The element type of each all-gather operand of a lowered step, lower-cased."""
    return [m.group(1).lower() for m in map(_GATHER_OPERAND.search, stablehlo.splitlines()) if m]


def _spec(sharding, ndim=3):
    """A NamedSharding's (or a PartitionSpec's) entries padded to ``ndim``, one-name tuples as
    the name."""
    spec = getattr(sharding, "spec", sharding)
    out = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in tuple(spec)]
    return tuple(out + [None] * (ndim - len(out)))


def _dense_worker(case, rng):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench import multi_device as md

    recipes = {
        "delayed": lambda: lowbit.DelayedScaling(amax_history_len=4),
        "current": lowbit.Float8CurrentScaling,
        "mxfp8": lowbit.MXFP8BlockScaling,
        "block": lowbit.Float8BlockScaling,
        # 128x128 tiles on x: its colwise copy's scale array pads (1.0) to 4 tile columns a shard
        "block_x2d": lambda: lowbit.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    }
    # S / tp = 128 rows per shard: whole 128-row blocks for Float8BlockScaling.
    B, S, H, F = 4, 256, 256, 256
    bf = jnp.bfloat16
    x = np.asarray(jnp.asarray(rng.standard_normal((B, S, H)), bf))
    w = np.asarray(jnp.asarray(rng.standard_normal((H, F)) * 0.05, bf))
    b = np.asarray(jnp.asarray(rng.standard_normal(F), bf))
    dy = np.asarray(jnp.asarray(rng.standard_normal((B, S, F)), bf))
    mesh = md._mesh((2, 2), ("dp", "tp"))
    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp", partial_sum_dtype="float32")
    seq, full = ("dp", "tp", None), ("dp", None, "tp")  # (b, s, features): sequence / feature split

    def step_for(recipe, layout):
        def dense(x, w, b, st):
            return lowbit.dense(x, w, b, recipe=recipe, state=st, tp_layout=layout)

        def step(x, w, b, dy, st):
            y, vjp = jax.vjp(dense, x, w, b, st)
            return (y,) + vjp(dy)

        return jax.jit(step)

    def run(recipe, layout, resource=sp):
        """(one device's results, the sharded ones, the sharded step's (jaxpr, StableHLO, compiled
        HLO))."""
        st = lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None
        step = step_for(recipe, layout)
        ref = step(x, w, b, dy, st)
        col = layout == "column"
        specs = (seq, (None, "tp"), ("tp",), full) if col else (full, ("tp", None), (None,), seq)
        args = md.put((x, w, b, dy), tuple(NamedSharding(mesh, P(*s)) for s in specs))
        ctx = md._Ctx(mesh, resource, None)
        with ctx:
            lowered = step.lower(*args, st)
            hlo = (jax.make_jaxpr(step)(*args, st).jaxpr, lowered.as_text(), lowered.compile().as_text())
        return ref, ctx.wrap(step)(*args, st), hlo

    def compare(ref, got, exact):
        for n, r, g in zip(("y", "dx", "dk", "db", "state"), ref, got):
            for lr, lg in zip(jax.tree.leaves(r), jax.tree.leaves(g)):
                lr, lg = np.asarray(lr, np.float32), np.asarray(lg, np.float32)
                if n in exact or n == "state":
                    assert np.array_equal(lr, lg), (n, np.abs(lr - lg).max())
                else:  # float32 partial sums in another order, rounded once to bf16
                    np.testing.assert_allclose(lg, lr, rtol=2.0**-7, atol=1e-6 * np.abs(lr).max(), err_msg=n)

    if case in ("dense_column", "dense_row"):
        layout = case.split("_")[1]
        for name, make in recipes.items():
            ref, got, _ = run(make(), layout)
            # Column: y is one full-K dot per element (x gathered), dx sums over tp, dk and db
            # over dp. Row: dx is one full-N dot (dy gathered), y sums over tp.
            compare(ref, got, exact={"y"} if layout == "column" else {"dx"})
            y, dx = got[0], got[1]
            want_y, want_x = (full, seq) if layout == "column" else (seq, full)
            assert _spec(y.sharding, 3) == want_y, (name, y.sharding)
            assert _spec(dx.sharding, 3) == want_x, (name, dx.sharding)
    elif case == "dense_hlo":
        for layout in ("column", "row"):
            for name in ("delayed", "current"):
                _, _, (jaxpr, stablehlo, hlo) = run(recipes[name](), layout)
                # The amaxes as without sequence parallelism: one scalar all-reduce per step over
                # every plan axis under delayed scaling, one per direction under current scaling.
                pmax = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "pmax"]
                want = 1 if name == "delayed" else 2
                assert len(pmax) == want and all(e.params["axes"] == ("dp", "tp") for e in pmax), (
                    layout,
                    pmax,
                )
                colls = md.collectives(hlo)
                gathers = [c for c in colls if c["op"] == "all-gather"]
                scatters = [c for c in colls if c["op"] == "reduce-scatter"]
                big_reduces = [
                    c for c in colls if c["op"] == "all-reduce" and max(c["elements"], default=0) > 64
                ]
                tag = (layout, name)
                # FP8 activations gathered along the sequence (column: x's rowwise copy in the
                # forward and its colwise copy in the backward; row: dy's two copies), never the
                # kernel and never a high-precision tensor.
                assert gathers, (tag, "no all-gather: the sequence is not split")
                assert _gathered_dtypes(stablehlo) == ["f8e4m3fn" if layout == "column" else "f8e5m2"] * 2, (
                    tag,
                    _gathered_dtypes(stablehlo),
                )
                for c in gathers:
                    assert all(d in FP8 + ("f16",) for d, _ in c["results"]), (tag, c)
                    assert all(sh not in ((H, F), (F, H)) for _, sh in c["results"]), (tag, c)
                # Each a dp shard's whole sequence of one FP8 copy: (B/dp) x S x features.
                feats = H if layout == "column" else F
                assert [c["elements"] for c in gathers] == [[B // 2 * S * feats]] * 2, (tag, gathers)
                # One reduce-scatter along the sequence: column dx (float32 partials), row y.
                assert len(scatters) == 1, (tag, scatters)
                assert scatters[0]["results"][0][1] == (B // 2, S // 2, H if layout == "column" else F), tag
                # The only large all-reduce: the wgrad over dp (a kernel shard), none of activations.
                kshard = (H, F // 2) if layout == "column" else (H // 2, F)
                assert [sh for c in big_reduces for _, sh in c["results"] if len(sh) > 1] == [kshard], (
                    tag,
                    big_reduces,
                )
    elif case == "dense_uneven":
        # A sequence tp does not divide (or shards without whole 128-row blocks): the plan is the
        # plain tensor-parallel one, and the results still match one device.
        from lowbit.sharding import global_shard_guard, plan_dense

        with jax.set_mesh(mesh), global_shard_guard(sp):
            rec = lowbit.Float8CurrentScaling()
            assert plan_dense(rec, B * S, H, F, "column", lead=(B, S)).rows == (B, S)
            assert plan_dense(rec, B * 7, H, F, "column", lead=(B, 7)).rows == ()
            assert plan_dense(rec, B * S, H, F, "column", lead=(B * S,)).rows == (2, B * S // 2)
            blk = lowbit.Float8BlockScaling()
            assert plan_dense(blk, B * 128, H, F, "row", lead=(B, 128)).rows == ()  # 64 rows a shard
            assert plan_dense(blk, B * 256, H, F, "row", lead=(B, 256)).seq == ("tp",)
    else:
        raise SystemExit(f"unknown case {case}")


def _norm_worker(rng):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench import multi_device as md

    x = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    be = jnp.asarray(0.1 * rng.standard_normal(64), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)

    def step(x, g, be, dy):
        y, vjp = jax.vjp(lambda x, g, be: lowbit.layernorm(x, g, be, epsilon=1e-5), x, g, be)
        return (y,) + vjp(dy)

    step = jax.jit(step)
    ref = step(x, g, be, dy)
    mesh = md._mesh((2, 2), ("dp", "tp"))
    xs = NamedSharding(mesh, P("dp", "tp", None))
    args = md.put((x, g, be, dy), (xs, NamedSharding(mesh, P()), NamedSharding(mesh, P()), xs))
    ctx = md._Ctx(mesh, lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp"), None)
    with ctx:
        hlo = step.lower(*args).compile().as_text()
    got = ctx.wrap(step)(*args)
    # Per (batch, sequence) shard: no gather; y and dx per row as on one device; dgamma/dbeta
    # summed over every row shard (dp and tp) in float32.
    assert md.audit_hlo(hlo)["counts"]["all-gather"] == 0
    assert _spec(got[0].sharding, 3) == ("dp", "tp", None), got[0].sharding
    for r, o in zip(ref[:2], got[:2]):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    for r, o in zip(ref[2:], got[2:]):
        r, o = np.asarray(r, np.float64), np.asarray(o, np.float64)
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def _bad_resource_worker():
    import jax
    import jax.numpy as jnp

    import lowbit
    from lowbit.bench import multi_device as md

    mesh = md._mesh((2, 2), ("dp", "tp"))
    x, w = jnp.ones((4, 32, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    rec = lowbit.Float8CurrentScaling()
    bad = (
        (lowbit.MeshResource(dp_resource="dp", tpsp_resource="sp"), "tpsp_resource names mesh axis 'sp'"),
        (
            lowbit.MeshResource(tp_resource="dp", tpsp_resource="tp"),
            "both tp_resource='dp' and tpsp_resource='tp'",
        ),
    )
    for res, words in bad:
        with md._Ctx(mesh, res, rec):
            try:
                jax.jit(lambda x, w: lowbit.dense(x, w))(x, w)
            except ValueError as e:
                assert words in str(e), str(e)
            else:
                raise AssertionError(f"no error for {res}")


def _module_worker(case, rng):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench import multi_device as md

    mname = {"layernorm_mlp": "LayerNormMLP", "transformer_layer": "TransformerLayer"}[case]
    cfg = dict(batch=4, seq=16, hidden=64, ffn=128, heads=4)
    x = rng.standard_normal((4, 16, 64)).astype(jnp.bfloat16)
    dy = rng.standard_normal((4, 16, 64)).astype(np.float32)
    mshape_fn, names, rkw, rules, xspec = md.PARALLEL["dp_tpsp"]
    assert rkw == dict(dp_resource="dp", tpsp_resource="tp") and tuple(xspec) == ("dp", "tp", None)
    mesh = md._mesh(mshape_fn(N_DEV), names)
    resource = lowbit.MeshResource(**rkw, partial_sum_dtype="float32")
    runs = [(lowbit.Float8CurrentScaling(), xspec), (lowbit.DelayedScaling(amax_history_len=4), xspec)]
    if mname == "TransformerLayer":
        # An input whole along the sequence (replicated over tp): sliced, never gathered, and the
        # layer's output is still split along the sequence.
        runs.append((lowbit.Float8CurrentScaling(), ("dp", None, None)))
    for recipe, in_spec in runs:
        model, kw, _ = md._lowbit_models(cfg)[mname]
        assert mname == "LayerNormMLP" or model.enable_sequence_parallel
        with lowbit.autocast(recipe):
            boxed = model.init(jax.random.PRNGKey(0), jnp.asarray(x), **kw)
        v = nn.unbox(boxed)

        def fwd_bwd(v, x, dy):
            def f(v, x):
                y = model.apply(v, x, **kw)
                return y[0] if isinstance(y, tuple) else y

            y, vjp = jax.vjp(f, v, x)
            return y, vjp(dy.astype(y.dtype))

        step = jax.jit(fwd_bwd)
        ref = md._Ctx(None, None, recipe).wrap(step)(v, jnp.asarray(x), jnp.asarray(dy))
        specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, list(rules))
        specs = jax.tree_util.tree_map(
            lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, P()),
            specs,
            is_leaf=lambda s: s is None or isinstance(s, (NamedSharding, P)),
        )
        xs = NamedSharding(mesh, P(*in_spec))
        args = md.put((v, x, dy), (specs, xs, xs))
        ctx = md._Ctx(mesh, resource, recipe, list(rules))
        with ctx:
            lowered = step.lower(*args)
            stablehlo, hlo = lowered.as_text(), lowered.compile().as_text()
        got = ctx.wrap(step)(*args)
        tag = (mname, type(recipe).__name__, in_spec)
        b, leaf = md.bound_ratio(ref, got, where=True)
        assert b <= 1.0, (tag, b, leaf)
        # The activation between blocks (the layer's output, the input's gradient) split along the
        # sequence, and the sequence-parallel collectives in the step.
        y, (_, dx) = got
        assert _spec(y.sharding, 3) == ("dp", "tp", None), (tag, y.sharding)
        if in_spec == xspec:
            assert _spec(dx.sharding, 3) == ("dp", "tp", None), (tag, dx.sharding)
        scatters = [c for c in md.collectives(hlo) if c["op"] == "reduce-scatter"]
        gathered = _gathered_dtypes(stablehlo)
        fp8 = [d for d in gathered if d in FP8]
        # Per GEMM pair (LayerNormMLP's wi/wo; the attention's QKV/out too): a reduce-scatter after
        # the row-parallel GEMM and of the column-parallel one's dgrad, FP8 gathers before them.
        pairs = 1 if mname == "LayerNormMLP" else 2
        assert len(scatters) >= 2 * pairs and len(fp8) >= 4 * pairs, (tag, scatters, gathered)
        if mname == "LayerNormMLP":  # nothing else: every all-gather is of an FP8 activation
            assert gathered == fp8, (tag, gathered)


def _constraints_worker(rng):
    """enable_sequence_parallel does what TransformerEngine's does: the residual stream (layer
    input, block outputs and residuals, MLP input) constrained to the sequence-split layout, the
    one lowbit's ops use (P(batch, tpsp, None)); nothing without tpsp_resource or the field."""
    import jax
    import jax.numpy as jnp

    import lowbit
    from lowbit import flax as lf
    from lowbit.bench import multi_device as md

    x = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
    mesh = md._mesh((2, 2), ("dp", "tp"))
    recipe = lowbit.Float8CurrentScaling()

    def constraints(esp, resource):
        layer = lf.TransformerLayer(
            hidden_size=64,
            mlp_hidden_size=128,
            num_attention_heads=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            intermediate_dropout=0.0,
            dtype=jnp.bfloat16,
            enable_sequence_parallel=esp,
        )
        with lowbit.autocast(recipe):
            v = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
        with md._Ctx(mesh, resource, recipe):
            jaxpr = jax.make_jaxpr(lambda v, x: layer.apply(v, x, deterministic=True))(v, x)
        # The residual stream's constraints (activations shaped as x; the relative position
        # bias has its own, per attention shard).
        return [
            e.params["sharding"].spec
            for e in jaxpr_eqns(jaxpr.jaxpr)
            if e.primitive.name == "sharding_constraint" and e.invars[0].aval.shape == x.shape
        ]

    sp = lowbit.MeshResource(dp_resource="dp", tpsp_resource="tp")
    got = constraints(True, sp)
    # inputs, the attention output and its residual, the MLP input, the MLP output and its residual
    assert len(got) >= 6 and all(_spec(s) == ("dp", "tp", None) for s in got), got
    assert constraints(False, sp) == []
    assert constraints(True, lowbit.MeshResource(dp_resource="dp", tp_resource="tp")) == []


def _worker(case: str) -> None:
    import jax
    import numpy as np

    assert len(jax.devices()) == N_DEV, jax.devices()
    rng = np.random.default_rng(0)
    if case.startswith("dense_"):
        _dense_worker(case, rng)
    elif case == "norm":
        _norm_worker(rng)
    elif case == "bad_resource":
        _bad_resource_worker()
    elif case in ("layernorm_mlp", "transformer_layer"):
        _module_worker(case, rng)
    elif case == "layer_constraints":
        _constraints_worker(rng)
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"OK {case}")


if __name__ == "__main__":
    _worker(sys.argv[1])
