"""Data-parallel TransformerLayer step under one XLA flag set: its time and how much of its
all-reduce traffic XLA's schedule overlaps with compute (issue 24: the wgrad all-reduces were
exposed on 2 GPUs). Run once per flag set, each in a fresh process (XLA reads its flags once):

  XLA_FLAGS="..." python3 scripts/dp_overlap_probe.py [--recipe delayed] [--label NAME]

Prints one JSON line: label, flags, ms, one-device ms (when --one), all-reduce count/MB and the MB
whose start/done pair encloses compute in the scheduled HLO.
"""

from __future__ import annotations

import argparse
import json
import os
import re


def overlap(hlo_text: str) -> dict:
    """Async collectives of a scheduled module: for every ``*-start``, the compute ops (fusions,
    custom calls, dots) the schedule places before its ``*-done``."""
    from lowbit.bench.multi_device import collectives

    lines = [ln.strip() for ln in hlo_text.splitlines()]
    starts = {}
    out = []
    for i, ln in enumerate(lines):
        m = re.match(
            r"(?:ROOT )?(%?[\w.\-]+) = .*? (all-reduce|all-gather|reduce-scatter|all-to-all)-start\(", ln
        )
        if m:
            starts[m.group(1).lstrip("%")] = (i, m.group(2), ln)
            continue
        m = re.search(r"(all-reduce|all-gather|reduce-scatter|all-to-all)-done\(\S*? ?%?([\w.\-]+)\)", ln)
        if m and m.group(2) in starts:
            j, op, sl = starts.pop(m.group(2))
            between = lines[j + 1 : i]
            compute = sum(bool(re.search(r" (fusion|custom-call|dot|convolution)\(", b)) for b in between)
            c = collectives(sl)
            out.append(dict(op=op, MB=(c[0]["bytes"] / 1e6 if c else 0.0), compute_between=compute))
    return dict(
        async_ops=len(out),
        MB=round(sum(o["MB"] for o in out), 1),
        overlapped_MB=round(sum(o["MB"] for o in out if o["compute_between"]), 1),
        ops=out,
    )


def _Stack(layer, depth: int):
    """``depth`` copies of ``layer`` applied in sequence (separate parameters)."""
    import flax.linen as nn

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, **kw):
            for i in range(depth):
                x = layer.clone(parent=self, name=f"layer_{i}")(x, **kw)
            return x

    return Stack()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="delayed", choices=("delayed", "current", "none"))
    ap.add_argument("--label", default="default")
    ap.add_argument("--one", action="store_true", help="also time the one-device step")
    ap.add_argument("--per-device", type=int, default=4, help="sequences per device")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (a smoke run)")
    ap.add_argument("--dump", default="", help="write the compiled (scheduled) HLO text here")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="a stack of this many layers (each layer's wgrad can hide behind the next)",
    )
    ap.add_argument("--trace", action="store_true", help="GPU 0's kernels: hidden vs exposed NCCL time")
    ap.add_argument(
        "--pgle", type=int, default=0, help="JAX's automatic profile-guided latency estimator: profiling runs"
    )
    args = ap.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if args.pgle:  # jit's dispatch profiles the first runs, then recompiles with the measured costs
        jax.config.update("jax_enable_pgle", True)
        jax.config.update("jax_pgle_profiling_runs", args.pgle)

    import lowbit
    from lowbit.bench import multi_device as md
    from lowbit.bench.dense import FULL, SMALL

    n = len(jax.devices())
    cfg = dict(FULL, batch=args.per_device * n)
    if args.small:
        cfg = dict(SMALL, batch=n, seq=32, hidden=128, ffn=256, heads=4)
    rec = {"delayed": lowbit.DelayedScaling(), "current": lowbit.Float8CurrentScaling(), "none": None}[
        args.recipe
    ]
    layer, kw, _ = md._lowbit_models(cfg)["TransformerLayer"]
    model = layer if args.layers == 1 else _Stack(layer, args.layers)
    shape = (cfg["batch"], cfg["seq"], cfg["hidden"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(jnp.bfloat16)
    dy = rng.standard_normal(shape).astype(np.float32)
    with lowbit.autocast(rec is not None, rec):
        boxed = model.init(jax.random.PRNGKey(0), jnp.asarray(x), **kw)
    v = nn.unbox(boxed)
    step = md._grad_step(model.apply, kw)
    row = dict(
        label=args.label, flags=os.environ.get("XLA_FLAGS", ""), n=n, recipe=args.recipe, layers=args.layers
    )
    if args.one:
        one = md._Ctx(None, None, rec).wrap(step)
        row["ms_one_device"] = md._timed(one, (v, jnp.asarray(x), jnp.asarray(dy)), args.small)
    mesh = md._mesh((n,), ("dp",))
    res = lowbit.MeshResource(dp_resource="dp")
    specs = md._logical_shardings(nn.get_partition_spec(boxed), mesh, ())
    data = NamedSharding(mesh, P("dp", None, None))
    args_ = md.put((v, x, dy), (specs, data, data))
    ctx = md._Ctx(mesh, res, rec, [])
    with ctx:
        fn = step.lower(*args_).compile()
    if args.pgle:
        call = ctx.wrap(step)
        for _ in range(args.pgle + 2):  # the profiled runs, then the recompiled executable
            jax.block_until_ready(call(*args_))
        row["ms"] = md._timed(call, args_, args.small)
        row["label"] += f" pgle{args.pgle}"
    else:
        row["ms"] = md._timed(fn, args_, args.small)
    if "ms_one_device" in row:
        row["scaling_eff"] = row["ms_one_device"] / (n * row["ms"])
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(fn.as_text())
    ov = overlap(fn.as_text())
    row.update({k: ov[k] for k in ("async_ops", "MB", "overlapped_MB")})
    row["ops"] = [f"{o['op']}:{o['MB']:.1f}MB/{o['compute_between']}" for o in ov["ops"]]
    print("PROBE " + json.dumps(row), flush=True)
    if args.trace:
        from lowbit.bench.comm_overlap import report, trace_step

        with ctx:
            print(report(f"dp{n} {args.label}", trace_step(fn, args_)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
