"""The Dense tutorial's multi-device section: DP=2 / TP=2 on one Dense, on a 2x2 mesh.

Data parallelism on mesh axis "dp" (the batch), tensor parallelism on "tp" (column-parallel: the
kernel's output features). lowbit learns which axis is which from ``MeshResource``, set with
``global_shard_guard``; its quantized GEMMs then run per shard (per-tensor scales from the global
amax), so XLA does not gather the kernel or the activations.

    python examples/dense_multi_device.py                       # 4 GPUs
    python examples/dense_multi_device.py --cpu-devices 4       # 4 host devices (XLA_FLAGS)
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=("delayed", "current", "mxfp8", "none"), default="delayed")
    ap.add_argument("--cpu-devices", type=int, default=0, help="run on this many forced CPU devices")
    ap.add_argument("--iters", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.cpu_devices:
        # Must be set before jax initializes its backends.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        ).strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dense import FlaxDenseBlock, dot_general_cls_for, make_recipe, on_gpu, speedometer

    if len(jax.devices()) < 4:
        raise SystemExit(f"needs 4 devices, found {len(jax.devices())} (try --cpu-devices 4)")
    small = not on_gpu()
    batch, seq, hidden, features = (4, 64, 256, 512) if small else (8, 2048, 4096, 16384)

    # DENSE_MULTI_GPU_MESH_SETUP_START
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    mesh_resource = lowbit.MeshResource(dp_resource="dp", tp_resource="tp")
    # DENSE_MULTI_GPU_MESH_SETUP_END

    key = jax.random.PRNGKey(42)
    x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (batch, seq, features)).astype(jnp.bfloat16)
    recipe = make_recipe(args.recipe)
    model = FlaxDenseBlock(features=features, dot_general_cls=dot_general_cls_for(recipe))
    var_collect = model.init(key, x)

    # DENSE_MULTI_GPU_SHARD_SETUP_START
    def shard(tree, spec_of):
        return jax.tree_util.tree_map_with_path(
            lambda p, a: jax.device_put(a, NamedSharding(mesh, spec_of(jax.tree_util.keystr(p), a))), tree
        )

    # Kernel (hidden, features): P(None, 'tp'); bias P('tp'); DelayedScaling's state replicated.
    sharded_vars = shard(
        var_collect,
        lambda p, a: (
            P(None, "tp") if p.endswith("['kernel']") else (P("tp") if p.endswith("['bias']") else P())
        ),
    )
    x_sh = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
    dy_sh = jax.device_put(dy, NamedSharding(mesh, P("dp", None, "tp")))
    # DENSE_MULTI_GPU_SHARD_SETUP_END

    # DENSE_MULTI_GPU_BENCH_START
    with jax.sharding.set_mesh(mesh), lowbit.global_shard_guard(mesh_resource):
        ms = speedometer(model.apply, sharded_vars, x_sh, dy_sh, timing_iters=args.iters)
        grads = jax.jit(
            jax.grad(lambda v, x: jnp.vdot(model.apply(v, x).astype(jnp.float32), dy_sh.astype(jnp.float32)))
        )
        hlo = grads.lower(sharded_vars, x_sh).compile().as_text()
        g_sharded = grads(sharded_vars, x_sh)
    # DENSE_MULTI_GPU_BENCH_END

    # The same step on one device: the kernel gradient sums over dp in another order (float32).
    g_one = jax.jit(
        jax.grad(lambda v, x: jnp.vdot(model.apply(v, x).astype(jnp.float32), dy.astype(jnp.float32)))
    )(var_collect, x)
    k1 = np.asarray(g_one["params"]["Dense_0"]["kernel"], np.float32)
    k4 = np.asarray(g_sharded["params"]["Dense_0"]["kernel"], np.float32)
    diff = float(np.abs(k1 - k4).max() / np.abs(k1).max())
    gathers = sum("all-gather" in line for line in hlo.splitlines())
    print(
        f"recipe: {args.recipe}  x {tuple(x.shape)} -> {features}  mesh {dict(mesh.shape)}  "
        f"all-gathers in the step: {gathers}  kernel grad vs one device: max rel diff {diff:.2e}"
    )
    return {"recipe": args.recipe, "ms": ms, "all_gathers": gathers, "kernel_grad_diff": diff}


if __name__ == "__main__":
    main()
