"""Context-parallel attention step on every local GPU (issue 26's CP rows): its time and, from a
profiler trace of GPU 0, how much of the ring's / all-gather's communication runs hidden behind
the cuDNN block kernels. Run once per XLA flag set, each in a fresh process:

  XLA_FLAGS="..." python3 scripts/cp_probe.py [--seq 32768] [--strategies ring,all_gather]
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--strategies", default="ring,all_gather")
    ap.add_argument("--label", default="")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (a smoke run)")
    args = ap.parse_args()

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from lowbit.bench import context_parallel as cp
    from lowbit.bench.comm_overlap import report, trace_step
    from lowbit.bench.common import time_fn
    from lowbit.ops.attention import ReorderStrategy
    from lowbit.ops.attention.context_parallel import load_balance_order

    h, d, s, _ = cp.SHAPES[args.small]
    s = s if args.small else args.seq
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    split = NamedSharding(mesh, P(None, "cp"))
    kernels = "reference" if args.small else "cudnn"
    host = [np.asarray(a) for a in cp._inputs(s, h, d)]
    order = load_balance_order(ReorderStrategy.DualChunkSwap, n, s)
    cp_args = [jax.device_put(a[:, order], split) for a in host]
    label = args.label or os.environ.get("XLA_FLAGS", "") or "default"
    for strategy in args.strategies.split(","):
        step, _ = cp._cp_step(mesh, strategy, True, kernels, cp_args[0])
        with jax.set_mesh(mesh):
            fn = step.lower(*cp_args).compile()
            ms = time_fn(fn, *cp_args, warmup=1, iters=5, repeats=3)
            ov = trace_step(fn, cp_args, steps=3)
        row = dict(label=label, strategy=strategy, seq=s, devices=n, ms=ms)
        row.update({k: round(v, 3) for k, v in ov.items() if k != "top"})
        print("CPPROBE " + json.dumps(row), flush=True)
        print(report(f"{strategy} {label}", ov), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
