"""The seed Dense tutorial's multi-GPU section (DP=2 x TP=2) as a TransformerEngine user writes it,
with only the imports changed to lowbit.te.

Two flows, both from the tutorial: ``--flow inside`` initialises the model eagerly inside
``with mesh, autocast(recipe, mesh_resource)`` (the flow that crashed in issue 24);
``--flow outside`` initialises on one device, then shards the variables and runs the step under
``jax.set_mesh(mesh)`` + ``global_shard_guard``. Each prints the fwd+bwd step time of plain Flax
BF16 and of lowbit on the same mesh, and checks lowbit's sharded gradients against its own
one-device run.

    python examples/dense_multi_gpu.py [--recipe delayed|current|block|none] [--flow inside|outside]
    python examples/dense_multi_gpu.py --small      # CPU: 4 host devices, small shapes
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=("delayed", "current", "block", "none"), default="delayed")
    ap.add_argument("--flow", choices=("inside", "outside"), default="inside")
    ap.add_argument("--small", action="store_true", help="small shapes on 4 CPU host devices")
    ap.add_argument("--iters", type=int, default=None)
    return ap.parse_args(argv)


ARGS = parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.small and "jax" not in sys.modules:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lowbit.te as te  # noqa: E402  (was: import transformer_engine.jax as te)
from lowbit import recipe as te_recipe  # noqa: E402  (was: from transformer_engine.common import recipe)
from lowbit.te import flax as te_flax  # noqa: E402
from lowbit.te.sharding import MeshResource, global_shard_guard  # noqa: E402


class DenseBlock(nn.Module):
    """The tutorial's model: one bias-free Dense whose GEMM implementation is a constructor arg."""

    features: int
    dtype: jnp.dtype = jnp.bfloat16
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        dg = self.dot_general_cls() if self.dot_general_cls is not None else None
        kw = {} if dg is None else {"dot_general": dg}
        return nn.Dense(self.features, use_bias=False, dtype=self.dtype, **kw)(x)


RECIPES = {
    "delayed": te_recipe.DelayedScaling,
    "current": te_recipe.Float8CurrentScaling,
    "block": te_recipe.Float8BlockScaling,
    "none": None,
}


def shapes(small: bool):
    return (8, 64, 256, 512) if small else (8, 2048, 4096, 16384)  # batch, seq, hidden, out


def step_fn(model):
    """fwd + bwd of sum(y * dy): returns y and the gradients (so XLA keeps the forward)."""

    def loss(variables, x, dy):
        y = model.apply(variables, x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def timed(fn, args, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3, out


def shard_tree(mesh, variables):
    """The tutorial's plan: kernel column-parallel P(None, 'tp'), everything else replicated."""

    def one(path, a):
        spec = P(None, "tp") if jax.tree_util.keystr(path).endswith("['kernel']") else P()
        return jax.device_put(a, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, variables)


def rel_err(ref, got) -> float:
    r, g = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))


def main(args=ARGS) -> dict:
    batch, seq, hidden, out = shapes(args.small)
    iters = args.iters or (2 if args.small else 20)
    n = len(jax.devices())
    if n < 4:
        print(f"needs 4 devices, found {n}")
        return {}
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("dp", "tp"))
    mesh_resource = MeshResource(dp_resource="dp", tp_resource="tp")
    key = jax.random.PRNGKey(0)
    k_init, k_x, k_dy = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(k_dy, (batch, seq, out)).astype(jnp.bfloat16)
    recipe = RECIPES[args.recipe]() if RECIPES[args.recipe] else None
    dg_cls = te_flax.make_dot_general_cls(recipe) if recipe is not None else None
    base, model = DenseBlock(out), DenseBlock(out, dot_general_cls=dg_cls)
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
    dys = jax.device_put(dy, NamedSharding(mesh, P("dp", None, "tp")))
    res = {"recipe": args.recipe, "flow": args.flow, "devices": str(jax.devices()[0].device_kind)}

    one_vars = model.init(k_init, x)  # one device, no mesh: the reference
    (g_one, _), _ = step_fn(model)(one_vars, x, dy)
    base_vars = shard_tree(mesh, base.init(k_init, x))
    if args.flow == "inside":
        with mesh, te.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=mesh_resource):
            variables = shard_tree(mesh, model.init(k_init, x))  # eager init inside the mesh
            res["flax_bf16_ms"], _ = timed(step_fn(base), (base_vars, xs, dys), iters)
            res["lowbit_ms"], ((g, _), _) = timed(step_fn(model), (variables, xs, dys), iters)
    else:
        variables = shard_tree(mesh, one_vars)
        with jax.set_mesh(mesh), global_shard_guard(mesh_resource):
            res["flax_bf16_ms"], _ = timed(step_fn(base), (base_vars, xs, dys), iters)
            res["lowbit_ms"], ((g, _), _) = timed(step_fn(model), (variables, xs, dys), iters)
    k_one, k_sh = g_one["params"]["Dense_0"]["kernel"], g["params"]["Dense_0"]["kernel"]
    res["kernel_grad_rel_err"] = rel_err(k_one, k_sh)
    # float64 reference of the kernel gradient x^T dy on its first 128 columns (host numpy)
    x64 = np.asarray(x, np.float64).reshape(-1, hidden)
    ref = x64.T @ np.asarray(dy, np.float64).reshape(-1, out)[:, :128]
    res["one_device_err_vs_f64"] = rel_err(ref, np.asarray(k_one)[:, :128])
    res["sharded_err_vs_f64"] = rel_err(ref, np.asarray(k_sh)[:, :128])
    res["speedup"] = res["flax_bf16_ms"] / res["lowbit_ms"]
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return res


if __name__ == "__main__":
    main()
