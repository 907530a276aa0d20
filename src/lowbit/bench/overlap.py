"""Tensor-parallel overlap on and off (``tp_overlap``, lowbit.ops.collective_dense): the
sequence-parallel MLP and the seed's dense with their all-gathers and reduce-scatters as XLA's
collectives ("off") and as ppermute rings under the chunk GEMMs ("on"), on one tp axis over all
devices (``MeshResource(tpsp_resource="tp")``), x split along the sequence.

Stage ``overlap`` of ``python -m lowbit.bench multi_device``. Rows: ``ms`` per fwd+bwd step off
and on, ``speedup`` = off / on, ``rel_diff`` the largest relative norm difference of the outputs
and gradients between the two, and the compiled steps' collective counts (AG / RS / permutes).
"""

from __future__ import annotations

#: (case, B, S, H, F): an MLP H -> F -> H (column then row), the seed's dense H -> F (column) and
#: its row-parallel mirror F -> H. Full: the seed's x (8, 2048, 4096) and N = 16384.
SHAPES = {
    True: (("mlp", 2, 256, 256, 512), ("dense column", 2, 256, 256, 512), ("dense row", 2, 256, 512, 256)),
    False: (
        ("mlp", 8, 2048, 4096, 16384),
        ("dense column", 8, 2048, 4096, 16384),
        ("dense row", 8, 2048, 16384, 4096),
    ),
}


def _recipe(name):
    import lowbit

    return {
        "bf16": lambda: None,
        "delayed": lambda: lowbit.DelayedScaling(),
        "current": lowbit.Float8CurrentScaling,
        "block": lowbit.Float8BlockScaling,
    }[name]()


def _step(case, recipe, overlap):
    """jit(value_and_grad) of <y, dy> over (x, kernels) with ``tp_overlap=overlap``."""
    import jax
    import jax.numpy as jnp

    import lowbit
    from lowbit.ops.fused.mlp import mlp

    delayed = isinstance(recipe, lowbit.DelayedScaling)

    def state():
        return lowbit.init_delayed_state(recipe) if delayed else None

    s1, s2 = state(), state()

    def apply(x, ks):
        if case == "mlp":
            return mlp(
                x, ks[0], None, ks[1], None, ("gelu",), recipe=recipe, states=(s1, s2), tp_overlap=overlap
            )
        layout = case.split()[1]
        return lowbit.dense(x, ks[0], recipe=recipe, state=s1, tp_layout=layout, tp_overlap=overlap)

    def loss(x, ks, dy):
        return jnp.sum(apply(x, ks).astype(jnp.float32) * dy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def overlap_rows(small: bool, timed, md, recipes=("bf16", "current", "delayed")) -> list[dict]:
    """``timed(fn, args) -> ms``: the stage's timer; ``md``: lowbit.bench.multi_device (its mesh,
    placement and HLO helpers; passed in, as that module runs this stage)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit

    n = len(jax.devices())
    mesh = md._mesh((n,), ("tp",))
    resource = lowbit.MeshResource(tpsp_resource="tp")
    rows = []
    for case, B, S, H, F in SHAPES[small]:
        key = jax.random.split(jax.random.PRNGKey(0), 4)
        bf = jnp.bfloat16
        x = jax.random.normal(key[0], (B, S, H), bf)
        k1 = (jax.random.normal(key[1], (H, F), jnp.float32) * H**-0.5).astype(bf)
        k2 = (jax.random.normal(key[2], (F, H), jnp.float32) * F**-0.5).astype(bf)
        out = H if case == "mlp" else F
        dy = jax.random.normal(key[3], (B, S, out), jnp.float32)
        seq, feat = P(None, "tp", None), P(None, None, "tp")
        row = case == "dense row"
        ks, kspecs = (
            ((k1, k2), (P(None, "tp"), P("tp", None))) if case == "mlp" else ((k1,), (P(None, "tp"),))
        )
        if row:
            kspecs = (P("tp", None),)
        shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
        args = md.put(
            (x, ks, dy),
            (
                shard(feat if row else seq),
                tuple(map(shard, kspecs)),
                shard(seq if row or case == "mlp" else feat),
            ),
        )
        for rname in recipes:
            recipe = _recipe(rname)
            ctx = md._Ctx(mesh, resource, None)
            res, ms, counts = {}, {}, {}
            for on in (False, True):
                fn = _step(case, recipe, on)
                with ctx:
                    colls = md.collectives(fn.lower(*args).compile().as_text())
                counts[on] = "/".join(
                    str(sum(c["op"] == op for c in colls))
                    for op in ("all-gather", "reduce-scatter", "collective-permute")
                )
                call = ctx.wrap(fn)
                res[on] = md.to_host(call(*args))
                ms[on] = timed(call, args)
            rows.append(
                dict(
                    case=case,
                    recipe=rname,
                    devices=n,
                    shape=f"{B}x{S}x{H}->{F}",
                    ms_off=ms[False],
                    ms_on=ms[True],
                    speedup=ms[False] / ms[True],
                    rel_diff=md.max_rel_diff(res[False], res[True]),
                    ag_rs_permute_off=counts[False],
                    ag_rs_permute_on=counts[True],
                )
            )
    return rows


COLUMNS = [
    "case",
    "recipe",
    "devices",
    "shape",
    "ms_off",
    "ms_on",
    "speedup",
    "rel_diff",
    "ag_rs_permute_off",
    "ag_rs_permute_on",
]
