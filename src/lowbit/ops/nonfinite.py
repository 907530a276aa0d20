"""Non-finite operands stay visible: quantization saturates Inf to the format's max, which would
hide an overflow from the loss (and from ``optax.apply_if_finite``). Where an operand's amax is
not finite, its decode scales become NaN, so every GEMM that reads it returns NaN, as the
unquantized product would be non-finite: no extra pass over the data (NaN inputs already encode
to NaN in FP8)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.quantization.tensor import ScaledTensor


def _nan_where(bad: jax.Array, s):
    """``s`` with NaN where ``bad`` (per tensor (1,) or per group (G,)); a (1,) flag covers a
    whole block-scale array."""
    if s is None:
        return None
    nan = jnp.array(np.nan, jnp.float32).astype(s.dtype)  # E8M0's NaN is 0xFF, E4M3's 0x7F
    flag = bad if s.shape == bad.shape else bad.reshape((1,) * s.ndim)
    return jnp.where(flag, nan, s)


def poison_nonfinite(qt: ScaledTensor) -> ScaledTensor:
    """``qt`` whose decode scales are NaN where its source's amax is Inf (or NaN)."""
    bad = ~jnp.isfinite(qt.amax)
    if qt.scaling_mode.is_nvfp4:  # the float32 tensor scales multiply the GEMM output
        return dataclasses.replace(qt, global_scale_inv=_nan_where(bad.any().reshape(1), qt.global_scale_inv))
    if bad.shape != (1,) and not qt.scaling_mode.is_tensor_scaling:
        bad = bad.any().reshape(1)
    return dataclasses.replace(
        qt, scale_inv=_nan_where(bad, qt.scale_inv), colwise_scale_inv=_nan_where(bad, qt.colwise_scale_inv)
    )
