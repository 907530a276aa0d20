"""lowbit.dense under jit with a Mesh and a MeshResource, on 4 forced CPU devices.

Each check runs in a subprocess (this file as a script) with
XLA_FLAGS=--xla_force_host_platform_device_count=4, so the rest of the suite keeps one device.
Sharded results are compared with the same function on one device: exact where each output
element is one unsplit GEMM dot (and for every amax/scale); GEMMs whose contraction is split
across devices (psum of float32 partials) agree to within one rounding of the output dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import jaxpr_eqns, multi_device_env

N_DEV = 4
CASES = (
    "column_delayed",
    "column_current",
    "column_mxfp8",
    "column_block",
    "row_block",
    "dp_only",
    "row_parallel",
    "row_argument",
    "column_hlo",
    "flax_dot_general",
    "partial_sums_bf16",
    "amax_reductions",
    "uneven_warns",
)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow)
        if c in ("column_current", "column_mxfp8", "column_block", "row_block", "dp_only", "flax_dot_general")
        else c
        for c in CASES
    ],
)
def test_sharded(case):
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case],
        env=multi_device_env(N_DEV),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


def test_tp_layout_is_an_argument_checked_by_name():
    """tp_layout is None, "column" or "row"; anything else is a ValueError naming it, from the op
    and from the module field. The old context manager still works, with a DeprecationWarning."""
    import jax
    import jax.numpy as jnp

    import lowbit
    from lowbit import flax as lf
    from lowbit.ops.fused.dense_split import split_dense
    from lowbit.sharding import plan_dense, resolve_tp_layout, tensor_parallel_layout

    x, w = jnp.ones((4, 32)), jnp.ones((32, 32))
    bad = "rows"
    for call in (
        lambda: lowbit.dense(x, w, tp_layout=bad),
        lambda: split_dense(x, w.reshape(32, 2, 16), tp_layout=bad),
        lambda: plan_dense(lowbit.Float8CurrentScaling(), 4, 32, 32, tp_layout=bad),
        lambda: lf.DenseGeneral(8, tp_layout=bad).init(jax.random.PRNGKey(0), x),
    ):
        with pytest.raises(ValueError, match=r"tp_layout must be None, 'column' or 'row', got 'rows'"):
            call()
    assert resolve_tp_layout(None) == "column" and resolve_tp_layout("row") == "row"
    with pytest.warns(DeprecationWarning, match="tp_layout"), tensor_parallel_layout("row"):
        assert resolve_tp_layout(None) == "row" and resolve_tp_layout("column") == "column"


def test_second_gemms_ask_for_row_parallel(monkeypatch):
    """The GEMM after a column-parallel one runs row-parallel by argument (no context): the
    attention output projection, LayerNormMLP's wo and lowbit.ops.fused.mlp's second GEMM ask
    plan_dense for "row", the first GEMMs for the default (None)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lowbit
    from lowbit import flax as lf
    from lowbit.ops import dense as dense_mod
    from lowbit.ops.fused.mlp import mlp

    asked = []
    plan = dense_mod.plan_dense

    def recording(recipe, M, K, N, tp_layout=None, lead=()):
        asked.append((K, N, tp_layout))
        return plan(recipe, M, K, N, tp_layout, lead)

    monkeypatch.setattr(dense_mod, "plan_dense", recording)
    recipe = lowbit.MXFP8BlockScaling()  # not tensor-scaled: every GEMM goes through dense()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 64)), jnp.float32)
    key = jax.random.PRNGKey(0)
    with lowbit.autocast(recipe):
        mha = lf.MultiHeadAttention(head_dim=32, num_attention_heads=2, transpose_batch_sequence=False)
        mha.init(key, x, deterministic=True)
        assert asked == [(64, 192, None), (64, 64, "row")]  # qkv (fused), out
        asked.clear()
        lf.LayerNormMLP(intermediate_dim=128, intermediate_dropout_rate=0.0).init(key, x, deterministic=True)
        assert asked == [(64, 128, None), (128, 64, "row")]  # wi, wo
    asked.clear()
    w1, w2 = jnp.ones((64, 128)), jnp.ones((128, 64))
    mlp(x, w1, None, w2, None, ("gelu",), recipe=recipe)
    assert asked == [(64, 128, None), (128, 64, "row")]


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
def _primitive_inputs(jaxpr, name: str) -> list:
    """The input variables of every ``name`` equation in ``jaxpr`` and its nested jaxprs."""
    return [v for e in jaxpr_eqns(jaxpr) if e.primitive.name == name for v in e.invars]


def _worker(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.sharding import MeshResource, global_shard_guard, tensor_parallel_layout

    assert len(jax.devices()) == N_DEV, jax.devices()
    recipes = {
        "delayed": lowbit.DelayedScaling(amax_history_len=4),
        "current": lowbit.Float8CurrentScaling(),
        "mxfp8": lowbit.MXFP8BlockScaling(),
        "block": lowbit.Float8BlockScaling(),
    }
    rng = np.random.default_rng(0)
    B, S, H, F = 4, 32, 128, 256
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((B, S, H)), bf)
    w = jnp.asarray(rng.standard_normal((H, F)) * 0.05, bf)
    b = jnp.asarray(rng.standard_normal(F), bf)
    dy = jnp.asarray(rng.standard_normal((B, S, F)), bf)

    def step_for(recipe, tp_layout=None):
        def dense(x, w, b, st):
            return lowbit.dense(x, w, b, recipe=recipe, state=st, tp_layout=tp_layout)

        def step(x, w, b, dy, st):
            y, vjp = jax.vjp(dense, x, w, b, st)
            return (y,) + vjp(dy)

        return step

    def state_for(recipe):
        return lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None

    def run(recipe, mesh, resource, specs, layout="column", lower=False, tp_layout=None):
        step = step_for(recipe, tp_layout)
        args = (x, w, b, dy, state_for(recipe))
        with jax.set_mesh(mesh), global_shard_guard(resource), tensor_parallel_layout(layout):
            args = tuple(
                a if s is None else jax.device_put(a, NamedSharding(mesh, P(*s)))
                for a, s in zip(args, specs + (None,))
            )
            fn = jax.jit(step)
            out = fn(*args)
            return (out, fn.lower(*args).compile().as_text()) if lower else out

    def compare(ref, got, exact):
        """exact: names that must match bit for bit; the rest: within one output rounding."""
        names = ("y", "dx", "dk", "db", "state")
        for n, r, g in zip(names, ref, got):
            for lr, lg in zip(jax.tree.leaves(r), jax.tree.leaves(g)):
                lr, lg = np.asarray(lr, np.float32), np.asarray(lg, np.float32)
                if n in exact or n == "state":
                    assert np.array_equal(lr, lg), (n, np.abs(lr - lg).max())
                else:  # bf16 outputs: float32 sums in another order, rounded once to bf16
                    np.testing.assert_allclose(lg, lr, rtol=2.0**-7, atol=1e-6 * np.abs(lr).max(), err_msg=n)

    mesh22 = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    # float32 partial sums: the split contractions then match one device to one output rounding.
    dp_tp = MeshResource(dp_resource="dp", tp_resource="tp", partial_sum_dtype="float32")
    seed_specs = (("dp", None, None), (None, "tp"), ("tp",), ("dp", None, "tp"))

    if case in ("column_block", "row_block"):
        # 128-row blocks along the tokens: 512 tokens, so each dp shard holds whole blocks; the
        # x colwise copy is then 1x128 per shard exactly as unsharded, and the kernel's 128x128
        # tiles split at tile boundaries (F / tp = 128, H / tp = 128 for row-parallel).
        recipe = recipes["block"]
        xb = jnp.asarray(rng.standard_normal((8, 64, 256)), bf)
        wb = jnp.asarray(rng.standard_normal((256, 256)) * 0.05, bf)
        dyb = jnp.asarray(rng.standard_normal((8, 64, 256)), bf)
        step = step_for(recipe)
        ref = jax.jit(step)(xb, wb, b, dyb, None)
        row = case == "row_block"
        specs = (
            (("dp", None, "tp"), ("tp", None), (None,), ("dp", None, None))
            if row
            else (("dp", None, None), (None, "tp"), ("tp",), ("dp", None, "tp"))
        )
        with (
            jax.set_mesh(mesh22),
            global_shard_guard(dp_tp),
            tensor_parallel_layout("row" if row else "column"),
        ):
            args = tuple(
                jax.device_put(a, NamedSharding(mesh22, P(*s))) for a, s in zip((xb, wb, b, dyb), specs)
            )
            fn = jax.jit(step)
            got = fn(*args, None)
            hlo = fn.lower(*args, None).compile().as_text()
        assert "all-gather" not in hlo, [l for l in hlo.splitlines() if "all-gather" in l][:4]
        compare(ref, got, exact={"dx"} if row else {"y"})
    elif case.startswith("column_") and case != "column_hlo":
        recipe = recipes[case.split("_")[1]]
        ref = jax.jit(step_for(recipe))(x, w, b, dy, state_for(recipe))
        got = run(recipe, mesh22, dp_tp, seed_specs)
        # y: each element one full-K dot; dx sums over tp, dk and db over dp.
        compare(ref, got, exact={"y"})
    elif case == "dp_only":
        mesh = Mesh(np.array(jax.devices()), ("dp",))
        for name in ("delayed", "current"):
            recipe = recipes[name]
            ref = jax.jit(step_for(recipe))(x, w, b, dy, state_for(recipe))
            got = run(
                recipe,
                mesh,
                MeshResource(dp_resource="dp", partial_sum_dtype="float32"),
                (("dp", None, None), (None, None), (None,), ("dp", None, None)),
            )
            compare(ref, got, exact={"y", "dx"})
    elif case == "row_parallel":
        for name in ("delayed", "current"):
            recipe = recipes[name]
            ref = jax.jit(step_for(recipe))(x, w, b, dy, state_for(recipe))
            specs = (("dp", None, "tp"), ("tp", None), (None,), ("dp", None, None))
            got, hlo = run(recipe, mesh22, dp_tp, specs, layout="row", lower=True)
            compare(ref, got, exact={"dx"})  # y sums over tp; dk, db over dp
            assert "all-gather" not in hlo, [l for l in hlo.splitlines() if "all-gather" in l][:4]
    elif case == "row_argument":
        # dense(..., tp_layout="row"): row-parallel without the deprecated context, and the
        # argument wins over it; the same results as the context's row layout, bit for bit.
        recipe = recipes["current"]
        specs = (("dp", None, "tp"), ("tp", None), (None,), ("dp", None, None))
        via_context = run(recipe, mesh22, dp_tp, specs, layout="row")
        got, hlo = run(recipe, mesh22, dp_tp, specs, layout="column", lower=True, tp_layout="row")
        for a, g in zip(jax.tree.leaves(via_context), jax.tree.leaves(got)):
            assert np.array_equal(np.asarray(a, np.float32), np.asarray(g, np.float32))
        assert "all-gather" not in hlo, [l for l in hlo.splitlines() if "all-gather" in l][:4]
        compare(jax.jit(step_for(recipe))(x, w, b, dy, None), got, exact={"dx"})
    elif case == "column_hlo":
        recipe = recipes["current"]
        _, hlo = run(recipe, mesh22, dp_tp, seed_specs, lower=True)
        gathers = [l.strip() for l in hlo.splitlines() if "all-gather" in l]
        assert not gathers, gathers[:4]
        # Without a MeshResource the ops run unsharded: XLA gathers (this makes the check meaningful),
        # and the results are those of one device, bit for bit.
        ref = jax.jit(step_for(recipe))(x, w, b, dy, None)
        got, hlo = run(recipe, mesh22, None, seed_specs, lower=True)
        assert "all-gather" in hlo
        compare(ref, got, exact={"y", "dx", "dk", "db"})
    elif case == "flax_dot_general":
        import flax.linen as nn

        from lowbit.flax import make_dot_general_cls

        for name in ("delayed", "current"):
            recipe = recipes[name]
            model = nn.Dense(
                F,
                dtype=bf,
                param_dtype=bf,
                dot_general_cls=make_dot_general_cls(recipe),
                kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tp")),
                bias_init=nn.with_partitioning(nn.initializers.normal(1.0), ("tp",)),
            )

            def loss_fn(v, x):
                return jnp.sum(model.apply(v, x).astype(jnp.float32) * dy.astype(jnp.float32))

            def train(v, x):
                return jax.grad(loss_fn)(v, x)

            boxed = model.init(jax.random.PRNGKey(0), x)
            v = nn.unbox(boxed)
            ref = jax.jit(train)(v, x)
            with mesh22, global_shard_guard(dp_tp):  # the legacy `with mesh:` context
                v_sh = jax.device_put(
                    v, nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh22, [])
                )
                x_sh = jax.device_put(x, NamedSharding(mesh22, P("dp", None, None)))
                fn = jax.jit(train)
                got = fn(v_sh, x_sh)
                hlo = fn.lower(v_sh, x_sh).compile().as_text()
            assert "all-gather" not in hlo, [l for l in hlo.splitlines() if "all-gather" in l][:4]
            # dk and dbias sum over dp; the state (DelayedScaling's new amax histories) is exact.
            for path, r in jax.tree_util.tree_leaves_with_path(ref):
                g = np.asarray(dict(jax.tree_util.tree_leaves_with_path(got))[path], np.float32)
                r = np.asarray(r, np.float32)
                if "_overwrite_with_gradient" in jax.tree_util.keystr(path):
                    assert np.array_equal(r, g), path
                else:
                    np.testing.assert_allclose(
                        g, r, rtol=2.0**-7, atol=1e-6 * np.abs(r).max(), err_msg=str(path)
                    )
    elif case == "partial_sums_bf16":
        # The default: split contractions all-reduce bf16 partials (XLA's bytes for a sharded dot),
        # so dx (over tp) and dk (over dp) are within a rounding of the partials, not the result.
        recipe = recipes["current"]
        ref = jax.jit(step_for(recipe))(x, w, b, dy, None)
        res = MeshResource(dp_resource="dp", tp_resource="tp")
        got = run(recipe, mesh22, res, seed_specs)
        with jax.set_mesh(mesh22), global_shard_guard(res):
            args = [
                jax.device_put(a, NamedSharding(mesh22, P(*s))) for a, s in zip((x, w, b, dy), seed_specs)
            ]
            jaxpr = jax.make_jaxpr(step_for(recipe))(*args, None)
        # The psums in the jaxpr (XLA's CPU backend promotes bf16 all-reduces to f32 later; GPUs
        # reduce bf16 natively): the 2-D ones (dx's and dk's partials) are bf16.
        psums = [v.aval for v in _primitive_inputs(jaxpr.jaxpr, "psum")]
        big = [a for a in psums if a.ndim == 2]
        assert len(big) >= 2 and all(a.dtype == jnp.bfloat16 for a in big), big
        for n, r, g in zip(("y", "dx", "dk", "db"), ref, got):
            r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
            if n == "y":
                assert np.array_equal(r, g)
            else:
                np.testing.assert_allclose(g, r, rtol=2.0**-7, atol=2.0**-7 * np.abs(r).max(), err_msg=n)
    elif case == "amax_reductions":
        # Scalar all-reduces: delayed scaling one per step (the forward's local x and kernel amaxes
        # ride along with the gradient's in the backward; the old code reduced them in the forward
        # too), current scaling one per direction (each amax is needed before quantizing).
        res = MeshResource(dp_resource="dp", tp_resource="tp")
        for name in ("delayed", "current"):
            recipe = recipes[name]
            with jax.set_mesh(mesh22), global_shard_guard(res):
                args = [
                    jax.device_put(a, NamedSharding(mesh22, P(*s))) for a, s in zip((x, w, b, dy), seed_specs)
                ]
                jaxpr = jax.make_jaxpr(step_for(recipe))(*args, state_for(recipe))
            pmax = _primitive_inputs(jaxpr.jaxpr, "pmax")
            want = 1 if name == "delayed" else 2
            assert len(pmax) == want, (name, [v.aval for v in pmax])
            ref = jax.jit(step_for(recipe))(x, w, b, dy, state_for(recipe))
            got = run(recipe, mesh22, dp_tp, seed_specs)
            compare(ref, got, exact={"y"})
    elif case == "uneven_warns":
        # A size the MeshResource's axes do not divide: the dense runs unsharded (right results),
        # and says so, naming the axes and the size (it used to fall back silently).
        import warnings

        from lowbit.sharding import ShardingFallbackWarning, plan_dense

        with jax.set_mesh(mesh22), global_shard_guard(dp_tp):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                assert plan_dense(recipes["current"], 64, 128, 256) is not None
                assert not [w for w in seen if w.category is ShardingFallbackWarning]
                assert plan_dense(recipes["current"], 64, 128, 255) is None
                assert plan_dense(recipes["current"], 63, 128, 256) is None
            got = [str(w.message) for w in seen if w.category is ShardingFallbackWarning]
            assert len(got) == 2, got
            assert "('tp',) (size 2)" in got[0] and "N = 255" in got[0], got[0]
            assert "('dp',) (size 2)" in got[1] and "M (x's rows) = 63" in got[1], got[1]
            xo = jnp.asarray(np.random.default_rng(1).standard_normal((63, 128)), jnp.bfloat16)
            wo = jnp.asarray(np.random.default_rng(2).standard_normal((128, 256)), jnp.bfloat16)
            with pytest.warns(ShardingFallbackWarning, match="dp"):
                y = jax.jit(lambda a, b: lowbit.dense(a, b, recipe=recipes["current"]))(xo, wo)
        ref = jax.jit(lambda a, b: lowbit.dense(a, b, recipe=recipes["current"]))(xo, wo)
        assert np.array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"OK {case}")


if __name__ == "__main__":
    _worker(sys.argv[1])
