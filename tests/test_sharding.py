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

N_DEV = 4
CASES = (
    "column_delayed",
    "column_current",
    "column_mxfp8",
    "column_block",
    "row_block",
    "dp_only",
    "row_parallel",
    "column_hlo",
    "flax_dot_general",
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
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEV}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
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

    def step_for(recipe):
        def step(x, w, b, dy, st):
            y, vjp = jax.vjp(lambda x, w, b, st: lowbit.dense(x, w, b, recipe=recipe, state=st), x, w, b, st)
            return (y,) + vjp(dy)

        return step

    def state_for(recipe):
        return lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None

    def run(recipe, mesh, resource, specs, layout="column", lower=False):
        step = step_for(recipe)
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
    dp_tp = MeshResource(dp_resource="dp", tp_resource="tp")
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
                MeshResource(dp_resource="dp"),
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
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"OK {case}")


if __name__ == "__main__":
    _worker(sys.argv[1])
