"""The Python <-> C++ contract has one source per side: csrc/include/lowbit/abi.h and
lowbit.abi hold the same codes under the same names (kFooBar is FOO_BAR), read here from the
header text (no compiler) and checked both ways; and the Python enums and tables built on them
agree with it."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np

from lowbit import abi
from lowbit.ops._ffi import activation, gemm, grouped_gemm, norm, softmax
from lowbit.quantization import scaling_modes
from lowbit.quantization.scaling_modes import ScalingMode, dtype_code

HEADER = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "include" / "lowbit" / "abi.h"
DECL = re.compile(r"^\s*constexpr\s+int32_t\s+(k\w+)\s*=\s*(-?(?:0[xX][0-9a-fA-F]+|\d+))\s*;", re.M)


def python_name(cpp: str) -> str:
    """kGemmABlockShift -> GEMM_A_BLOCK_SHIFT, kModeMxfp8_1dScaling -> MODE_MXFP8_1D_SCALING."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cpp[1:]).upper()


def header_codes() -> dict[str, int]:
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    codes = {python_name(name): int(value, 0) for name, value in DECL.findall(text)}
    # Every constant is one parseable line: a declaration the regex misses would go unchecked.
    assert len(codes) == len(re.findall(r"\bconstexpr\b", text)), "abi.h: a constant the test cannot read"
    return codes


def python_codes() -> dict[str, int]:
    return {k: v for k, v in vars(abi).items() if k.isupper() and isinstance(v, int)}


def test_names_convert():
    assert python_name("kGemmABlockShift") == "GEMM_A_BLOCK_SHIFT"
    assert python_name("kModeMxfp8_1dScaling") == "MODE_MXFP8_1D_SCALING"
    assert python_name("kDtypeBf16") == "DTYPE_BF16"
    assert python_name("kGroupedBlockN128") == "GROUPED_BLOCK_N128"


def test_header_and_python_agree_both_ways():
    h, py = header_codes(), python_codes()
    assert len(h) > 40
    assert sorted(set(h) - set(py)) == [], "in abi.h but not in lowbit.abi"
    assert sorted(set(py) - set(h)) == [], "in lowbit.abi but not in abi.h"
    assert {k: py[k] for k in h if py[k] != h[k]} == {}, "values differ"


def test_flag_bits_are_distinct_bits():
    py = python_codes()
    for family in ("QUANTIZE_", "GROUPED_"):
        bits = [v for k, v in py.items() if k.startswith(family) and "RAGGED" not in k]
        assert all(b > 0 and b & (b - 1) == 0 for b in bits) and len(set(bits)) == len(bits), family
    fields = (abi.GEMM_BLOCK_MASK << abi.GEMM_A_BLOCK_SHIFT, abi.GEMM_BLOCK_MASK << abi.GEMM_B_BLOCK_SHIFT)
    assert not fields[0] & fields[1] and not (fields[0] | fields[1]) & abi.GEMM_FAST_ACCUM


def test_python_tables_use_the_codes():
    assert {m.name: int(m) for m in ScalingMode} == {
        k[len("MODE_") :]: v for k, v in python_codes().items() if k.startswith("MODE_")
    }
    dtypes = {
        "F32": jnp.float32,
        "BF16": jnp.bfloat16,
        "F16": jnp.float16,
        "E4M3": jnp.float8_e4m3fn,
        "E5M2": jnp.float8_e5m2,
        "E2M1": jnp.float4_e2m1fn,
        "E8M0": jnp.float8_e8m0fnu,
    }
    assert {k: dtype_code(np.dtype(d)) for k, d in dtypes.items()} == {
        k[len("DTYPE_") :]: v for k, v in python_codes().items() if k.startswith("DTYPE_")
    }
    assert scaling_modes.LAYOUT_FLAGS == {
        "rowwise": abi.QUANTIZE_ROWWISE,
        "colwise": abi.QUANTIZE_COLWISE,
        "both": abi.QUANTIZE_ROWWISE | abi.QUANTIZE_COLWISE,
    }
    assert scaling_modes.DEFAULT_RHT_SIGN_MASK == abi.DEFAULT_RHT_SIGN_MASK
    # The FFI layer's names are the abi's values.
    assert (norm.LAYERNORM, norm.RMSNORM) == (abi.NORM_LAYERNORM, abi.NORM_RMSNORM)
    assert (softmax.SCALED, softmax.SCALED_MASKED, softmax.SCALED_UPPER_TRIANG_MASKED) == (
        abi.SOFTMAX_SCALED,
        abi.SOFTMAX_SCALED_MASKED,
        abi.SOFTMAX_SCALED_UPPER_TRIANG_MASKED,
    )
    assert activation.SQUARED_RELU == abi.ACT_SQUARED_RELU and activation.LINEAR == abi.ACT_LINEAR
    assert (grouped_gemm.RAGGED_M, grouped_gemm.RAGGED_K) == (abi.GROUPED_RAGGED_M, abi.GROUPED_RAGGED_K)
    assert (gemm.BLOCK_1D, gemm.BLOCK_2D) == (abi.GEMM_BLOCK_1D, abi.GEMM_BLOCK_2D)


def test_no_code_is_spelled_by_hand_in_the_handlers():
    """The handlers take every code from abi.h: no `constexpr ... k<Name> = <number>` left in
    csrc/ffi, and the enums of the headers are defined from abi:: constants."""
    root = HEADER.parent.parent.parent
    own = re.compile(r"constexpr\s+\w+\s+k\w+\s*=\s*\d")
    for cc in sorted((root / "ffi").glob("*.cc")):
        assert not own.findall(cc.read_text()), f"{cc.name} defines its own codes; use lowbit/abi.h"
    enum = re.compile(r"enum class \w+ : int32_t \{([^}]*)\}", re.S)
    for h in sorted(HEADER.parent.glob("*.h")):
        for body in enum.findall(h.read_text()):
            for entry in re.sub(r"//[^\n]*", "", body).split(","):
                entry = entry.strip()
                if entry:
                    assert re.fullmatch(r"k\w+ = abi::k\w+", entry), f"{h.name}: {entry!r} not from abi.h"
