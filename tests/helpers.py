"""Helpers that several test files share: error measures, random inputs, bit views, the
environment of a multi-device subprocess. (The float64 model of the formats is oracle.py; the
CPU/GPU ``device`` fixtures are in conftest.py.)"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def rel(got, ref) -> float:
    """Relative Frobenius error ``|got - ref| / |ref|`` in float64 (absolute where ref is 0)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


def randn(shape, seed=0, scale=1.0):
    """float32 standard normal values times ``scale``, the same for the same seed."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def bits(a):
    """Bitwise view (NaN-safe equality) of a NumPy/JAX array."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def multi_device_env(devices: int) -> dict:
    """The environment of a subprocess that sees ``devices`` CPU devices and imports lowbit from
    this checkout's src/ (the rest of the suite keeps one device)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
    return env


def run_worker(script: str, case: str, devices: int = 4, timeout: float = 900) -> None:
    """Runs ``script case`` (a test file as its own worker) in a subprocess that sees ``devices``
    CPU devices; fails with its output's tail unless it exits 0 printing ``OK case``."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, os.path.abspath(script), case],
        env=multi_device_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0 and f"OK {case}" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


def jaxpr_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (jit, shard_map, custom VJPs:
    lowbit's shard_map is jitted, so its body sits one level down)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)
