"""What TE's JAX test harness imports that is no part of lowbit.te's API: TE's native extension
module (``transformer_engine_jax``), its version queries and a few private helpers. Answers are
the CPU's: compute capability 0 (TE's tests then skip their GPU-only cases), no cuDNN."""

import enum
import sys
import types


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


class DType(enum.IntEnum):
    """TE's native dtype codes (quantize.helper.DType), as TE's tests compare them."""

    kByte = 0
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


def _version_utils():
    return _mod(
        "transformer_engine.jax.version_utils",
        TRITON_EXTENSION_MIN_JAX_VERSION="0.8.0",
        is_triton_extension_supported=lambda: False,
        is_collective_stream_supported=lambda: False,
    )


def _patch_quantize_helper():
    # TE's private helpers its tests import from quantize.helper, added to lowbit's module.
    import lowbit.te.quantize.helper as helper

    helper.DType = DType
    helper._format2dtypes = lambda fmt: (fmt.fwd_dtype, fmt.bwd_dtype)


def _misc():
    # TE's device queries its harness imports, added to lowbit's module (get_xla_flag is lowbit's).
    import lowbit.te.cpp_extensions.misc as misc

    misc.get_cudnn_version = lambda: (0, 0, 0)
    misc.get_min_device_compute_capability = lambda: 0
    misc.get_all_device_compute_capability = lambda: [0]


_MODULES = {
    "transformer_engine.jax.version_utils": _version_utils,
}


def install():
    """Registers the stand-ins TE's harness imports (submodules of lowbit.te modules that are
    not packages must be in sys.modules before the import system looks for them)."""
    sys.modules["transformer_engine_jax"] = _mod(
        "transformer_engine_jax",
        get_device_compute_capability=lambda gpu_id=0: 0,
        get_cudnn_version=lambda: 0,
        get_num_compute_streams=lambda: 1,
    )
    for name, make in _MODULES.items():
        sys.modules.setdefault(name, make())
    _patch_quantize_helper()
    _misc()
