"""What each collective costs on this host: all-reduce, all-gather, reduce-scatter and all-to-all
of bf16 buffers over 2 and all devices, through XLA's collectives (NCCL on GPUs) in a jitted
shard_map, as lowbit's sharded ops issue them. Rows carry the time, the algorithm bandwidth
(bytes of the per-device buffer / time) and NCCL's bus bandwidth (algbw x 2(n-1)/n for an
all-reduce, x (n-1)/n for the others), the numbers that extrapolate to other device counts.

Stage ``collectives`` of ``python -m lowbit.bench multi_device``.
"""

from __future__ import annotations

# (name, bus-bandwidth factor of n)
OPS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
}


def _body(op: str, axis: str):
    import jax

    if op == "all-reduce":
        return lambda a: jax.lax.psum(a, axis)
    if op == "all-gather":
        return lambda a: jax.lax.all_gather(a, axis, tiled=True)
    if op == "reduce-scatter":
        return lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0, tiled=True)
    return lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)


def collective_rows(small: bool, timed) -> list[dict]:
    """``timed(fn, args) -> ms``: the stage's timer. Buffers: the per-device operand holds
    ``MB`` megabytes (all-gather: its output does)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from lowbit.sharding import shard_map

    sizes_mb = (1, 4) if small else (1, 16, 64, 256)
    counts = sorted({2, len(jax.devices())})
    rows = []
    for n in counts:
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        for op, factor in OPS.items():
            for mb in sizes_mb:
                elems = mb * 2**20 // 2
                per_dev = elems // n if op == "all-gather" else elems
                rows_per = max(per_dev // 1024, n)  # (rows, 1024) bf16, rows divisible by n
                rows_per -= rows_per % n
                a = jax.device_put(jnp.ones((rows_per * n, 1024), jnp.bfloat16), NamedSharding(mesh, P("x")))
                out_spec = P() if op == "all-reduce" else P("x")
                fn = shard_map(_body(op, "x"), mesh, (P("x"),), out_spec)
                ms = timed(fn, (a,))
                nbytes = rows_per * 1024 * 2 * (n if op == "all-gather" else 1)
                algbw = nbytes / (ms * 1e-3) / 1e9
                rows.append(
                    dict(
                        op=op,
                        devices=n,
                        MB=nbytes / 2**20,
                        ms=ms,
                        algbw_GBps=algbw,
                        busbw_GBps=algbw * factor(n),
                    )
                )
    return rows


COLUMNS = ["op", "devices", "MB", "ms", "algbw_GBps", "busbw_GBps"]
