"""Timing, environment capture and reporting shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Optional, Sequence

import jax

from lowbit._native import has_cuda_backend as on_gpu  # noqa: F401  (the suites import it from here)
from lowbit.bench.clocks import Sampler


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def environment() -> dict:
    import jaxlib

    env = {
        "device": device_name(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        import flax

        env["flax"] = flax.__version__
    except ImportError:
        pass
    return env


def env_names(var: str, known: Sequence[str], suite: str) -> list:
    """The ';'-separated names in the environment variable ``var`` (empty when unset), each one
    of ``known`` (an unknown name is an error listing them)."""
    names = [n.strip() for n in os.environ.get(var, "").split(";") if n.strip()]
    for n in names:
        if n not in known:
            raise ValueError(f"{suite}: {var} names {n!r}; known are {list(known)}")
    return names


def case_named(cases: Sequence[tuple], name: str, suite: str) -> tuple:
    """The row of a suite's case table whose first field is `name` (a clear error otherwise)."""
    for case in cases:
        if case[0] == name:
            return case
    raise ValueError(f"{suite}: no case named {name!r}; cases are {[c[0] for c in cases]}")


def time_fn(
    fn: Callable, *args, warmup: int = 3, iters: int = 20, repeats: int = 5, clocks: Optional[dict] = None
) -> float:
    """Median milliseconds per call of an already-jitted fn. Calls are queued back to back
    (dispatch is asynchronous) and the device is synchronised once per repeat. ``clocks``: a dict
    that receives the GPU's median SM clock and power during the repeats (lowbit.bench.clocks)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    with Sampler(clocks is not None and on_gpu()) as sampler:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    if clocks is not None:
        clocks.update(sampler.result)
    return statistics.median(samples)


def print_table(title: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print(f"\n## {title}")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")


def write_json(name: str, payload: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    return path
