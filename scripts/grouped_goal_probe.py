"""Issue 27's grouped-GEMM goal rows (fwd+bwd with every cast, ms and speed-up over lowbit BF16) at
the bench's three MoE shapes, the bench's size distributions and ``dirichlet16`` (the Dirichlet draw
in 16-row units, as lowbit's MoE dispatch pads groups under FP8): a quick subset of
`python -m lowbit.bench grouped`.
The ``primary`` cases read FP8 weight copies made outside the timed call (by the optimizer step);
``split`` ones run with ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1`` (split accumulation in every
per-tensor FP8 GEMM; the default is TE 2.20's fast accumulation). ``PROBE_SHAPES=G64,G128`` keeps
those shapes only."""

import os

import jax.numpy as jnp

from lowbit.bench import grouped as g
from lowbit.bench.common import time_fn

cases = (
    "lowbit bf16",
    "lowbit fp8 delayed",
    "lowbit fp8",
    "lowbit fp8 block",
    "lowbit fp8 delayed primary",
    "lowbit fp8 delayed primary split",
    "lowbit fp8 block primary",
)
SPLIT = " split"
keep = os.environ.get("PROBE_SHAPES")


def timed(name, lhs, rhs, gs):
    split = name.endswith(SPLIT)
    if split:
        os.environ["NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION"] = "1"
    try:  # the switch is read when the case is traced: inside time_fn's first call
        fn, args = g._case(name.removesuffix(SPLIT), "fwd+bwd", lhs, rhs, gs)
        return time_fn(fn, *args, warmup=2, iters=10, repeats=3)
    finally:
        os.environ.pop("NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION", None)


print("| shape | sizes | " + " | ".join(cases) + " |")
for G, M, K, N in g.GPU_SHAPES:
    if keep and f"G{G}" not in keep.split(","):
        continue
    lhs, rhs = g.operands(G, M, K, N)
    for dist in g.DISTS + ("dirichlet16",):
        gs = jnp.asarray(g.group_sizes(G, M, dist))
        ms = [timed(name, lhs, rhs, gs) for name in cases]
        cells = [f"{m:.3f}" + ("" if i == 0 else f" ({ms[0] / m:.3f}x)") for i, m in enumerate(ms)]
        print(f"| G{G} {M}x{K}x{N} | {dist} | " + " | ".join(cells) + " |", flush=True)
