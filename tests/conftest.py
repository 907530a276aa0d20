"""Shared test helpers: the CPU/GPU ``device`` parametrization.

The ``gpu`` marker is declared in pyproject.toml (not registered again here). A test that takes
the ``device`` fixture runs twice: ``[cpu]`` always, ``[gpu]`` (marked ``gpu``) on the first CUDA
device, skipped when ``jax.devices('cuda')`` has none. ``run_on(device, fn, *args)`` puts the
arguments on that device and runs ``jax.jit(fn)`` there, so the same body tests both backends;
``to_cpu`` brings results back for comparisons. Select with ``-m gpu`` / ``-m "not gpu"``.

Two tiers: the tests marked ``slow`` are deselected unless ``--all`` is given, a ``-m`` expression
picks the tests, or a test is named by node id (``file.py::test``); CI runs both tiers.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np
import pytest

# Make `import oracle` work however pytest is invoked (rootdir / importmode).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run the slow tier too (deselected by default)")


def pytest_collection_modifyitems(config, items):
    # The default tier fits 10 minutes on two cores; an explicit choice of tests overrides it.
    if config.getoption("--all") or config.option.markexpr or any("::" in a for a in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@functools.cache
def cuda_devices() -> tuple:
    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:
        return ()


def cpu_device():
    return jax.devices("cpu")[0]


def has_gpu() -> bool:
    return bool(cuda_devices())


def _require_gpu():
    if not has_gpu():
        pytest.skip("no CUDA device (jax.devices('cuda') is unavailable)")
    from lowbit import _native

    if _native.cuda_library() is None:
        pytest.fail(
            "a CUDA device is present but liblowbit_cuda.so was not found next to the lowbit package; "
            "build with -DLOWBIT_CUDA=ON and copy it into src/lowbit/"
        )


DEVICE_PARAMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request):
    """A jax.Device: the CPU, or (``gpu`` marker) the first CUDA device. The test body runs under
    ``jax.default_device(device)``, so eager calls it makes land there too."""
    if request.param == "gpu":
        _require_gpu()
        dev = cuda_devices()[0]
    else:
        dev = cpu_device()
    with jax.default_device(dev):
        yield dev


@pytest.fixture
def gpu_device():
    """The first CUDA device, for tests that only make sense on a GPU (mark them ``gpu``)."""
    _require_gpu()
    dev = cuda_devices()[0]
    with jax.default_device(dev):
        yield dev


@pytest.fixture
def on_cpu():
    """Runs the test with the CPU as the default device (also on a machine with a GPU): for
    device-independent tests such as argument checks. Use with
    ``pytestmark = pytest.mark.usefixtures("on_cpu")``."""
    with jax.default_device(cpu_device()):
        yield cpu_device()


def is_gpu(device) -> bool:
    return device.platform != "cpu"


def run_on(device, fn, *args, static_argnums=(), **kwargs):
    """``jax.jit(fn)(*args, **kwargs)`` with the array arguments placed on ``device``.

    keyword arguments are closed over (static: modes, dtypes, layouts); the positional args are
    pytrees of arrays put on ``device`` with jax.device_put, and the computation is pinned there
    with ``jax.default_device`` as well.
    """
    args = jax.device_put(args, device)
    with jax.default_device(device):
        return jax.jit(functools.partial(fn, **kwargs), static_argnums=static_argnums)(*args)


def to_cpu(tree):
    """Results as NumPy arrays (None leaves stay None)."""
    return jax.tree_util.tree_map(lambda a: None if a is None else np.asarray(jax.device_get(a)), tree)


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the test's node id: fresh inputs per test, reproducible."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
