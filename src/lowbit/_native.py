"""Loads lowbit's shared libraries and registers their XLA FFI handlers, once per platform.

``liblowbit_cpu.so`` is always there; ``liblowbit_cuda.so`` exists when the package was built
with nvcc and is loaded only when JAX has a CUDA backend. Handler symbols are named
``lowbit_<op>_<platform>`` and registered as the target ``lowbit_<op>``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import jax

# Op families whose handlers are registered; other op modules add theirs with register_ops().
_ops: tuple[str, ...] = ("quantize", "dequantize", "grouped_quantize")
_lock = threading.Lock()
_state: dict = {}


def _lib_dirs() -> list[str]:
    """Where the libraries may be: $LOWBIT_LIBRARY_DIR, then every folder of the package (an
    editable install keeps the sources and the built libraries in different folders)."""
    import lowbit

    dirs = [os.environ["LOWBIT_LIBRARY_DIR"]] if os.environ.get("LOWBIT_LIBRARY_DIR") else []
    return dirs + [os.path.abspath(d) for d in getattr(lowbit, "__path__", [])]


def _find(name: str) -> str | None:
    for d in _lib_dirs():
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    return None


def _has_cuda_backend() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def _preload_cublaslt() -> None:
    """Makes libcublasLt loadable from the NVIDIA wheels that jax[cuda] installs."""
    try:
        import nvidia  # type: ignore
    except ImportError:
        return
    for root in getattr(nvidia, "__path__", []):
        for pattern in ("cu13/lib/libcublasLt.so*", "cublas/lib/libcublasLt.so*", "*/lib/libcublasLt.so*"):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


def _load_cuda():
    path = _find("liblowbit_cuda.so")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        _preload_cublaslt()
        return ctypes.CDLL(path)


def _gemm_command_buffer() -> bool:
    # Opt-in trial: the GEMM handler marked command-buffer compatible (csrc/ffi/gemm.cc).
    return os.environ.get("LOWBIT_GEMM_COMMAND_BUFFER", "") == "1"


def _register(libs: dict, ops) -> None:
    """Registers `ops` from the loaded libraries: lowbit_<op>_cpu / lowbit_<op>_cuda."""
    for lib, platform, suffix in ((libs["cpu"], "cpu", "cpu"), (libs["cuda"], "CUDA", "cuda")):
        if lib is None:
            continue
        for op in ops:
            symbol = f"lowbit_{op}_{suffix}"
            if op == "gemm" and suffix == "cuda" and _gemm_command_buffer():
                symbol = "lowbit_gemm_cmdbuf_cuda"
                lib.lowbit_gemm_init_cuda()  # the cuBLASLt handle exists before XLA captures a graph
            fn = getattr(lib, symbol, None)
            if fn is not None:
                jax.ffi.register_ffi_target(f"lowbit_{op}", jax.ffi.pycapsule(fn), platform=platform)


def ensure_loaded() -> dict:
    """Loads and registers once; returns {'cpu': lib, 'cuda': lib or None}."""
    if _state:
        return _state
    with _lock:
        if _state:
            return _state
        cpu_path = _find("liblowbit_cpu.so")
        if cpu_path is None:
            raise ImportError(
                f"lowbit's native library was not found in {_lib_dirs()}; install the package with "
                "`pip install -e .` (or set LOWBIT_LIBRARY_DIR to the folder holding liblowbit_cpu.so)"
            )
        loaded = dict(cpu=ctypes.CDLL(cpu_path), cuda=_load_cuda() if _has_cuda_backend() else None)
        _register(loaded, _ops)
        _state.update(loaded)  # published only once registered: callers test _state unlocked
        return _state


def register_ops(*ops: str) -> None:
    """Adds op families (gemm, norm, ...) to register; registers them at once if the libraries
    are already loaded, so import order does not matter."""
    global _ops
    with _lock:
        new = tuple(op for op in ops if op not in _ops)
        _ops = _ops + new
        if _state and new:
            _register(_state, new)


def cuda_library():
    return ensure_loaded()["cuda"]


def workspace_bytes(fn_name: str, *args: int) -> int:
    """Asks the CUDA library for a kernel's scratch size at trace time (0 without CUDA).

    ``fn_name`` is an exported ``extern "C" int64_t fn(int64_t, ...)``: every argument is passed
    as int64."""
    lib = cuda_library()
    if lib is None:
        return 0
    fn = getattr(lib, fn_name)
    fn.restype = ctypes.c_int64
    return int(fn(*[ctypes.c_int64(int(a)) for a in args]))
