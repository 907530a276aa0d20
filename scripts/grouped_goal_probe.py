"""Issue 27's grouped-GEMM goal rows (fwd+bwd with every cast, ms and speed-up over lowbit BF16) at
the bench's three MoE shapes, the bench's size distributions and ``dirichlet16`` (the Dirichlet draw
in 16-row units, as lowbit's MoE dispatch pads groups under FP8): a quick subset of
`python -m lowbit.bench grouped`.
The ``primary`` cases read FP8 weight copies made outside the timed call (by the optimizer step)."""

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
    lhs, rhs = g.operands(G, M, K, N)
    for dist in g.DISTS + ("dirichlet16",):
        gs = jnp.asarray(g.group_sizes(G, M, dist))
        ms = []
        for name in cases:
            fn, args = g._case(name, "fwd+bwd", lhs, rhs, gs)
            ms.append(time_fn(fn, *args, warmup=2, iters=10, repeats=3))
        cells = [f"{m:.3f}" + ("" if i == 0 else f" ({ms[0] / m:.3f}x)") for i, m in enumerate(ms)]
        print(f"| G{G} {M}x{K}x{N} | {dist} | " + " | ".join(cells) + " |", flush=True)
