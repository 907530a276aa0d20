"""Where one benchmark step spends its GPU time: ``python -m lowbit.bench.profile SUITE CASE...``.

Traces a few steps of a case from ``lowbit.bench.dense``, ``.layer`` or ``.moe`` (the same
model, parameters and jitted fwd+bwd as the timed run) with ``jax.profiler`` and prints the GPU
kernels by total time per step, then per group (GEMM, attention, lowbit kernels, XLA fusions).
SUITE is ``dense``, ``docs`` (TransformerEngine's Dense tutorial block), ``layer`` (the seed
layer, dot_general swapped), ``module`` (lowbit's TransformerLayer), ``moe`` (a MoE block,
CASE "<shape> <case>", e.g. ``"G64 deepseek fp8 delayed"``) or ``grouped`` (a grouped GEMM fwd+bwd,
CASE "G<experts> <sizes> <case>", e.g. ``"G128 balanced lowbit fp8 delayed primary"``); CASE is
a row name of that suite, e.g. ``"lowbit delayed bf16 params"``. ``--host`` adds the host's events and the
GPU's idle gaps between steps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
from typing import Optional

import jax

from lowbit.bench import dense as dense_bench
from lowbit.bench import grouped as grouped_bench
from lowbit.bench import layer as layer_bench
from lowbit.bench import moe as moe_bench
from lowbit.bench.common import on_gpu, time_fn

STEPS = 5


def _group(kernel: str) -> str:
    k = kernel.lower()
    if "lowbit" in k:
        return "lowbit kernels"
    if "cudnn" in k or "flash" in k or "fmha" in k or "sdpa" in k:
        return "attention (cuDNN)"
    if "gemm" in k or "cutlass" in k or "sm90_xmma" in k or "nvjet" in k or "cublas" in k:
        return "GEMM (cuBLAS/CUTLASS)"
    if "fusion" in k or "loop_" in k or "input_" in k or "reduce" in k or "triton" in k:
        return "XLA fusions"
    return "other"


def _trace(trace_dir: str):
    """The trace jax.profiler wrote under ``trace_dir`` (its newest xplane file), read once."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    return ProfileData.from_file(path)


def traced_calls(fn, args, steps: int):
    """The profiler trace of ``steps`` back-to-back calls of ``fn(*args)`` (read once)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
        return _trace(d)


def _gpu_events(trace, device: Optional[int] = None) -> list:
    """(start_ns, duration_ns, name, details) of every kernel on the trace's GPU stream lines
    (GPU ``device``'s only, when given), in start order; details are the event's stats
    (grid/block sizes where the trace has them)."""
    events = []
    for plane in trace.planes:
        if device is None:
            if not plane.name.startswith("/device:GPU"):
                continue
        elif plane.name != f"/device:GPU:{device}":
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                try:
                    details = {k: v for k, v in ev.stats if k in ("kernel_details", "memcpy_details")}
                except Exception:  # stats are optional in the trace format
                    details = {}
                events.append((ev.start_ns, ev.duration_ns, ev.name, details))
    return sorted(events)


def _host_events(trace) -> list:
    """(start_ns, duration_ns, name, thread) of every host-side event (runtime API calls, XLA's
    execution scopes) in the trace."""
    events = []
    for plane in trace.planes:
        if plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                events.append((ev.start_ns, ev.duration_ns, ev.name, line.name))
    return sorted(events)


def _host_summary(events: list, steps: int, top: int) -> None:
    """Host events by total time per step: a synchronising call (stream/event synchronise, a
    blocking copy) shows up here when the GPU idles between steps."""
    totals: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for _, dur, name, thread in events:
        t = totals[(name[:90], thread[:30])]
        t[0] += dur / steps / 1e6
        t[1] += 1
        t[2] = max(t[2], dur / 1e6)
    print("  host events by time per step (ms per step, calls in all, longest ms, thread):")
    for (name, thread), (ms, n, mx) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.3f}  {n:6d}  {mx:8.3f}  {thread:30s}  {name}")


def _step_gaps(events: list, steps: int) -> None:
    """The GPU's idle time between consecutive steps: gaps over 50 us between kernels."""
    end, gaps = None, []
    for start, dur, name, _ in events:
        if end is not None and start - end > 50_000:
            gaps.append(((start - end) / 1e6, name[:60]))
        end = start + dur if end is None else max(end, start + dur)
    print(
        f"  gaps over 50 us between kernels ({steps} steps): "
        + ", ".join(f"{g:.3f} ms before {n}" for g, n in gaps)
    )


def _timeline(events: list, steps: int) -> None:
    """The last step's kernels in order (offset, gap before, duration, name, launch shape) and
    the step's idle time between kernels: what CUDA graphs or fewer launches could recover."""
    per = len(events) // steps
    last = events[-per:] if per else []
    if not last:
        return
    t0, idle, end = last[0][0], 0.0, last[0][0]
    print(f"  timeline of the last step ({per} kernels; gap = idle time before the kernel):")
    for start, dur, name, details in last:
        gap = max(0.0, start - end)
        idle += gap
        end = max(end, start + dur)
        shape = " ".join(str(v) for v in details.values())[:60]
        print(
            f"  {(start - t0) / 1e3:9.1f} us  gap {gap / 1e3:6.1f}  {dur / 1e3:8.1f} us  {name[:70]}  {shape}"
        )
    print(f"  idle between kernels: {idle / 1e6:.3f} ms of {(end - t0) / 1e6:.3f} ms")


def _build(suite: str, case: str):
    key, drop = jax.random.split(jax.random.PRNGKey(42))
    cfg = dense_bench.FULL if on_gpu() else dense_bench.SMALL
    if suite == "moe":
        return moe_bench.build_case(case)
    if suite == "grouped":
        return grouped_bench.build_case(case)
    if suite == "module":
        return layer_bench.build_case(case, cfg, key, drop)
    return dense_bench.build_case("docs dense" if suite == "docs" else suite, case, cfg, key, drop)


def profile(suite: str, case: str, top: int = 25, timeline: bool = False, host: bool = False) -> None:
    fn, args = _build(suite, case)
    wall = time_fn(fn, *args, warmup=2, iters=10, repeats=3)
    trace = traced_calls(fn, args, STEPS)
    events = _gpu_events(trace)
    hosts = _host_events(trace) if host else []
    totals: dict[str, float] = collections.defaultdict(float)
    for _, dur, name, _ in events:
        totals[name] += dur
    per_step = {k: v / STEPS / 1e6 for k, v in totals.items()}
    total = sum(per_step.values())
    print(f"\n## {suite}: {case}: wall {wall:.3f} ms per step, GPU kernel time {total:.3f} ms")
    groups: dict[str, float] = collections.defaultdict(float)
    for k, ms in per_step.items():
        groups[_group(k)] += ms
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {100 * ms / total:5.1f}%  {g}")
    print("  top kernels:")
    for k, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.3f} ms  {k[:140]}")
    if timeline:
        _timeline(events, STEPS)
    if host:
        _step_gaps(events, STEPS)
        _host_summary(hosts, STEPS, top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.bench.profile", description=__doc__)
    ap.add_argument("suite", choices=["dense", "docs", "layer", "module", "moe", "grouped"])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", action="store_true", help="list the last step's kernels in order")
    ap.add_argument("--host", action="store_true", help="the host's events and the GPU's idle gaps")
    a = ap.parse_args(argv)
    for case in a.cases:
        profile(a.suite, case, a.top, a.timeline, a.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
