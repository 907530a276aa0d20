"""Loads lowbit's shared libraries and registers their XLA FFI handlers, once per platform.

``liblowbit_cpu.so`` is always there; ``liblowbit_cuda.so`` exists when the package was built
with nvcc and is loaded only when JAX has a CUDA backend. Handler symbols are named
``lowbit_<op>_<platform>`` and registered as the target ``lowbit_<op>``. Every op module calls
its handlers through :func:`ffi_call`, which loads the libraries first and adds the workspace.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Every op family (csrc/ffi/<family>.cc); a handler a library lacks is skipped.
OPS: tuple[str, ...] = (
    "quantize",
    "dequantize",
    "grouped_quantize",
    "gemm",
    "grouped_gemm",
    "norm_fwd",
    "norm_bwd",
    "act_fwd",
    "act_bwd",
    "softmax_fwd",
    "softmax_bwd",
    "attention_fwd",
    "attention_bwd",
    "moe_router_fwd",
    "moe_router_bwd",
    "moe_plan",
    "moe_permute",
    "moe_combine_fwd",
    "moe_combine_bwd",
)

# Stand-ins for optional operands and results the handlers take as zero-length buffers.
EMPTY_F32 = np.zeros((0,), np.float32)
EMPTY_U32 = np.zeros((0,), np.uint32)
EMPTY_U8 = np.zeros((0,), np.uint8)
NO_RESULT_U8 = jax.ShapeDtypeStruct((0,), jnp.uint8)
NO_RESULT_F32 = jax.ShapeDtypeStruct((0,), jnp.float32)
_lock = threading.Lock()
_state: dict = {}


def _lib_dirs() -> list[str]:
    """Where the libraries may be: $LOWBIT_LIBRARY_DIR, then every folder of the package (an
    editable install keeps the sources and the built libraries in different folders)."""
    package = sys.modules[__package__]  # imported before this module; importing it would be a cycle
    dirs = [os.environ["LOWBIT_LIBRARY_DIR"]] if os.environ.get("LOWBIT_LIBRARY_DIR") else []
    return dirs + [os.path.abspath(d) for d in getattr(package, "__path__", [])]


def _find(name: str) -> str | None:
    for d in _lib_dirs():
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    return None


def has_cuda_backend() -> bool:
    """Whether JAX has a CUDA device (the CUDA library is loaded only then)."""
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
        loaded = dict(cpu=ctypes.CDLL(cpu_path), cuda=_load_cuda() if has_cuda_backend() else None)
        _register(loaded, OPS)
        _state.update(loaded)  # published only once registered: callers test _state unlocked
        return _state


def cuda_library():
    return ensure_loaded()["cuda"]


def workspace_bytes(op: str, *args: int) -> int:
    """Asks the CUDA library for op's scratch size at trace time (0 without CUDA).

    ``lowbit_<op>_workspace_bytes`` is an exported ``extern "C" int64_t fn(int64_t, ...)``: every
    argument is passed as int64."""
    lib = cuda_library()
    if lib is None:
        return 0
    fn = getattr(lib, f"lowbit_{op}_workspace_bytes")
    fn.restype = ctypes.c_int64
    return int(fn(*[ctypes.c_int64(int(a)) for a in args]))


def ffi_call(op: str, result_types, *operands, workspace: Optional[Sequence[int]] = None, **attrs):
    """Calls the handler ``lowbit_<op>`` (batched by a loop under vmap).

    ``workspace``: the arguments of op's workspace-size query; the scratch is then one more
    uint8 result (XLA owns it, so it stays valid in CUDA graphs), which is not returned.
    ``result_types``: one ShapeDtypeStruct (one array returned) or a tuple of them."""
    ensure_loaded()
    # Zero-length stand-ins as values made in the trace, not closed-over NumPy constants: inside
    # shard_map on GPUs, XLA (jax 0.11.2) passed those constants into the manual region as
    # zero-sized operands and segfaulted in its post-partitioning simplification.
    operands = tuple(
        jnp.zeros(o.shape, o.dtype) if isinstance(o, np.ndarray) and o.size == 0 else o for o in operands
    )
    if workspace is None:
        return jax.ffi.ffi_call(f"lowbit_{op}", result_types, vmap_method="sequential")(*operands, **attrs)
    single = isinstance(result_types, jax.ShapeDtypeStruct)
    types = ((result_types,) if single else tuple(result_types)) + (
        jax.ShapeDtypeStruct((workspace_bytes(op, *workspace),), jnp.uint8),
    )
    out = jax.ffi.ffi_call(f"lowbit_{op}", types, vmap_method="sequential")(*operands, **attrs)
    return out[0] if single else tuple(out[:-1])
