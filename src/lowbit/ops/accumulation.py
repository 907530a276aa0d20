"""How each FP8 GEMM accumulates on the GPU, as TransformerEngine's environment says.

Hopper's FP8 tensor cores accumulate in reduced precision; split (2x) accumulation promotes the
partial sums into float32 every 128-deep block of K (slower, exact to float32), fast accumulation
does not. TE 2.20 accumulates every FP8 GEMM fast unless
``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1`` (its grouped GEMM always fast); TE < 2.10 read a
switch per GEMM, ``NVTE_JAX_FP8_2X_ACC_{FPROP,DGRAD,WGRAD}``. lowbit reads both, for the dense
and the grouped GEMMs alike; the CPU kernels always accumulate in float32."""

from __future__ import annotations

import os
from typing import Optional

GEMMS = ("FPROP", "DGRAD", "WGRAD")


def _env_bit(name: str) -> Optional[bool]:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"


def split_accumulation(gemm: str) -> bool:
    """Whether the FP8 GEMM ``gemm`` (FPROP, DGRAD, WGRAD) accumulates in split (2x) precision.

    TE < 2.10's per-GEMM ``NVTE_JAX_FP8_2X_ACC_<gemm>`` where set, else TE 2.20's
    ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION`` (every GEMM: 1 split, 0 fast); unset: fast,
    TE 2.20's default. Read when an op is traced."""
    if gemm not in GEMMS:
        raise ValueError(f"split_accumulation: gemm must be one of {GEMMS}, got {gemm!r}")
    per_gemm = _env_bit(f"NVTE_JAX_FP8_2X_ACC_{gemm}")
    if per_gemm is not None:
        return per_gemm
    return bool(_env_bit("NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION"))


def config_fields(fast_accum: bool) -> dict:
    """The accumulation fields of an FP8 op's config (dense's and the grouped GEMM's): the
    forward GEMM fast where the call (``fast_accum``) and the environment both allow it, the
    gradients' GEMMs as the environment says."""
    return dict(
        fast_accum=bool(fast_accum) and not split_accumulation("FPROP"),
        fast_accum_dgrad=not split_accumulation("DGRAD"),
        fast_accum_wgrad=not split_accumulation("WGRAD"),
    )
