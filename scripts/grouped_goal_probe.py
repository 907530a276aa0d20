"""Issue 27's grouped-GEMM goal rows (fwd+bwd with every cast, ms and speed-up over lowbit BF16) at the
bench's three MoE shapes, both size distributions: a quick subset of `python -m lowbit.bench grouped`.
The ``primary`` cases read FP8 weight copies made outside the timed call (by the optimizer step)."""

import jax
import jax.numpy as jnp

from lowbit.bench import grouped as g
from lowbit.bench.common import time_fn

cases = (
    "lowbit bf16",
    "lowbit fp8 delayed",
    "lowbit fp8",
    "lowbit fp8 block",
    "lowbit fp8 delayed primary",
    "lowbit fp8 block primary",
)
print("| shape | sizes | " + " | ".join(cases) + " |")
for G, M, K, N in g.GPU_SHAPES:
    key = jax.random.PRNGKey(0)
    lhs = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.fold_in(key, 1), (G, K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
    for dist in g.DISTS:
        gs = jnp.asarray(g.group_sizes(G, M, dist))
        ms = []
        for name in cases:
            fn, args = g._case(name, "fwd+bwd", lhs, rhs, gs)
            ms.append(time_fn(fn, *args, warmup=2, iters=10, repeats=3))
        cells = [f"{m:.3f}" + ("" if i == 0 else f" ({ms[0] / m:.3f}x)") for i, m in enumerate(ms)]
        print(f"| G{G} {M}x{K}x{N} | {dist} | " + " | ".join(cells) + " |", flush=True)
