"""The Dense tutorial: one large ``flax.linen.Dense`` whose GEMM is swapped for lowbit's.

The model is plain Flax; the only change for lowbit is the ``dot_general_cls`` it is built with
(``lowbit.flax.make_dot_general_cls(recipe)``). Parameters, their initialization and the
optimizer stay as they were.

    python examples/dense.py --recipe delayed            # seed shapes on a GPU, small on CPU
    python examples/dense.py --recipe nvfp4 --small

Recipes: delayed, current (FP8, per-tensor scales; Hopper and later), block (FP8 with 1x128 /
128x128 block scales, cuBLASLt's block-scaled GEMM on Hopper), mxfp8, nvfp4 (block scaled; on
Hopper they run lowbit's numerically faithful study path, not fast), none (plain Flax).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

import lowbit
from lowbit import flax as lowbit_flax


# DENSE_BASELINE_MODEL_START
class FlaxDenseBlock(nn.Module):
    """A single Dense layer; `dot_general_cls` lets us swap the GEMM without touching the model."""

    features: int
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return nn.Dense(features=self.features, use_bias=True, dot_general=self.dot_general_cls())(x)


# DENSE_BASELINE_MODEL_END


RECIPES = {
    "delayed": lowbit.DelayedScaling,
    "current": lowbit.Float8CurrentScaling,
    "mxfp8": lowbit.MXFP8BlockScaling,
    "block": lowbit.Float8BlockScaling,
    "nvfp4": lowbit.NVFP4BlockScaling,
    "none": None,
}


def make_recipe(name: str):
    cls = RECIPES[name]
    return None if cls is None else cls()


def dot_general_cls_for(recipe):
    """What the tutorial passes as `dot_general_cls`: lowbit's module class, or Flax's default."""
    if recipe is None:
        return lambda: None
    return lowbit_flax.make_dot_general_cls(recipe)


def rngs_for(recipe, dropout_key):
    rngs = {"dropout": dropout_key}
    if isinstance(recipe, lowbit.NVFP4BlockScaling):
        # NVFP4 rounds gradients stochastically: it draws from the `sr_rng` stream.
        rngs["sr_rng"] = jax.random.PRNGKey(0)
    return rngs


def speedometer(
    model_apply_fn,
    variables,
    input,
    output_grad,
    forward_kwargs=None,
    rngs=None,
    warmup_iters: int = 3,
    timing_iters: int = 10,
) -> float:
    """Times a JIT-compiled forward+backward (gradients w.r.t. all variables and the input)."""
    forward_kwargs = dict(forward_kwargs or {})

    def loss_fn(variables, x, dy):
        out = model_apply_fn(variables, x, rngs=rngs, **forward_kwargs)
        return jnp.vdot(out.astype(jnp.float32), dy.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    for _ in range(warmup_iters):
        jax.block_until_ready(step(variables, input, output_grad))
    times = []
    for _ in range(timing_iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(variables, input, output_grad))
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.mean(times)
    print(f"Mean time: {ms:.3f} ms")
    return ms


def on_gpu() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=list(RECIPES), default="delayed")
    ap.add_argument("--small", action="store_true", help="tiny shapes (default without a GPU)")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    small = args.small or not on_gpu()

    # DENSE_INPUTS_SETUP_START
    if small:
        batch, seq, hidden, features = 2, 64, 256, 512
    else:
        batch, seq, hidden, features = 4, 2048, 4096, 16384  # 8192 tokens, 4096 -> 16384
    key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
    x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (batch, seq, features)).astype(jnp.bfloat16)
    # DENSE_INPUTS_SETUP_END

    # DENSE_TE_SETUP_START
    recipe = make_recipe(args.recipe)
    model = FlaxDenseBlock(features=features, dot_general_cls=dot_general_cls_for(recipe))
    var_collect = model.init(key, x)
    # DENSE_TE_SETUP_END
    print(
        f"recipe: {args.recipe}   x {tuple(x.shape)} -> {features} features   "
        f"device: {jax.devices()[0].device_kind}"
    )
    print("params:", jax.tree_util.tree_map(lambda a: a.shape, var_collect["params"]))
    extra = {k: v for k, v in var_collect.items() if k != "params"}
    if extra:
        print("additional state:", jax.tree_util.tree_map(lambda a: a.shape, extra))

    # DENSE_SINGLE_GPU_BENCH_START
    ms = speedometer(
        model.apply,
        var_collect,
        x,
        dy,
        rngs=rngs_for(recipe, dropout_key),
        timing_iters=args.iters or (3 if small else 10),
    )
    # DENSE_SINGLE_GPU_BENCH_END
    return {"recipe": args.recipe, "ms": ms}


if __name__ == "__main__":
    main()
