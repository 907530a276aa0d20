"""The GPU's SM clock and power draw while a benchmark case is timed.

FP8 GEMMs on random data hold an H100 at its 700 W cap (SM clock 1.2-1.75 GHz instead of 1.98),
so a case's time depends on the clock the cap leaves it and drifts with the GPU's temperature.
Rows carry the median SM clock (MHz) and power (W) that ``nvidia-smi`` reported during their
timing loop, so tables from different runs, or from different points of one run, can be read
against each other. Without ``nvidia-smi`` (or without a GPU) nothing is sampled.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
from typing import Optional

_FORMAT = ["--format=csv,noheader,nounits"]


@functools.cache
def _power_field(exe: str) -> str:
    """``power.draw.instant`` where the driver has it (``power.draw`` averages over about a
    second, too long for a half-second timing loop), else ``power.draw``."""
    try:
        probe = subprocess.run(
            [exe, "--query-gpu=power.draw.instant", *_FORMAT, "-i", gpu_index()],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "power.draw"
    return (
        "power.draw.instant"
        if probe.returncode == 0 and parse(f"0, {probe.stdout.strip()}")
        else "power.draw"
    )


def gpu_index() -> str:
    """The GPU this process times: the first of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID, as
    ``nvidia-smi -i`` takes them), else 0. Without it nvidia-smi reports every GPU of the host, and
    the medians mixed the other streams' GPUs into a row (several benchmarks, one per GPU)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


def parse(text: str) -> dict:
    """``{"sm_mhz", "power_w"}`` medians of nvidia-smi's ``clock, power`` lines (other lines,
    e.g. "[N/A]", are skipped); empty when no line parses."""
    clocks, power = [], []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            c, p = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        clocks.append(c)
        power.append(p)
    if not clocks:
        return {}
    return {"sm_mhz": round(statistics.median(clocks)), "power_w": round(statistics.median(power), 1)}


class Sampler:
    """``with Sampler(enabled) as s: <timing loop>``, then ``s.result`` (see :func:`parse`)."""

    def __init__(self, enabled: bool = True):
        self._exe = shutil.which("nvidia-smi") if enabled else None
        self._proc: Optional[subprocess.Popen] = None
        self.result: dict = {}

    def __enter__(self) -> Sampler:
        if self._exe:
            try:
                query = f"--query-gpu=clocks.sm,{_power_field(self._exe)}"
                self._proc = subprocess.Popen(
                    [self._exe, query, *_FORMAT, "-lms", "100", "-i", gpu_index()],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.result = parse(out or "")
