"""How much of a multi-GPU step's communication the GPU hides behind compute, measured from a
``jax.profiler`` trace rather than read off the compiled schedule: on one GPU's kernel lines,
the union of NCCL kernel intervals (communication), the union of every other kernel (compute),
their intersection (hidden communication) and the time neither runs (idle).

A schedule can place an all-reduce's start and done around compute (scripts/dp_overlap_probe.py
reports that) and still expose it, because NCCL's kernels slow the GEMMs beside them or wait on
a peer; this reports what ran.
"""

from __future__ import annotations

import collections

import jax

from lowbit.bench.profile import _gpu_events, traced_calls


def _is_comm(name: str) -> bool:
    return name.startswith("nccl") or "ncclDevKernel" in name or "ncclKernel" in name


def device_events(trace, device: int = 0) -> list:
    """(start_ns, end_ns, name) of every kernel on GPU ``device``'s stream lines."""
    return [(s, s + d, name) for s, d, name, _ in _gpu_events(trace, device)]


def _union(intervals) -> list:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _length(iv) -> float:
    return sum(e - s for s, e in iv)


def _intersection(a, b) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: list, steps: int, top: int = 12) -> dict:
    """Per-step milliseconds of one GPU's kernels: span (first start to last end / steps),
    compute and communication busy time, hidden communication, exposed communication, idle,
    and the ``top`` kernels by time per step."""
    comm = _union((s, e) for s, e, n in events if _is_comm(n))
    comp = _union((s, e) for s, e, n in events if not _is_comm(n))
    per = 1e6 * steps
    span = (max(e for _, e, _ in events) - min(s for s, _, _ in events)) / per if events else 0.0
    hidden = _intersection(comm, comp) / per
    busy = _length(_union([tuple(x) for x in comm + comp])) / per
    totals: dict[str, float] = collections.defaultdict(float)
    for s, e, n in events:
        totals[n[:110]] += (e - s) / per
    return dict(
        span_ms=span,
        compute_ms=_length(comp) / per,
        comm_ms=_length(comm) / per,
        comm_hidden_ms=hidden,
        comm_exposed_ms=_length(comm) / per - hidden,
        idle_ms=span - busy,
        top=sorted(totals.items(), key=lambda kv: -kv[1])[:top],
    )


def trace_step(fn, args, steps: int = 4, device: int = 0) -> dict:
    """:func:`summarize` of ``steps`` calls of the compiled ``fn(*args)`` (warmed up first)."""
    jax.block_until_ready(fn(*args))
    return summarize(device_events(traced_calls(fn, args, steps), device), steps)


def report(label: str, s: dict) -> str:
    lines = [
        f"OVERLAP {label}: span {s['span_ms']:.3f} ms/step | compute {s['compute_ms']:.3f} | "
        f"comm {s['comm_ms']:.3f} (hidden {s['comm_hidden_ms']:.3f}, exposed {s['comm_exposed_ms']:.3f}) | "
        f"idle {s['idle_ms']:.3f}"
    ]
    lines += [f"    {ms:8.3f} ms  {name}" for name, ms in s["top"]]
    return "\n".join(lines)


__all__ = ["device_events", "report", "summarize", "trace_step"]
