"""Remat policies that know lowbit's GEMMs.

``jax.checkpoint_policies.checkpoint_dots`` saves the outputs of ``lax.dot_general``; lowbit's
GEMMs are XLA FFI calls it does not recognise, so under it they would be recomputed in the
backward pass. Every lowbit GEMM output is named ``"lowbit_gemm"`` (``jax.ad_checkpoint.
checkpoint_name``); the policies below save those as well. (Matching on the name rather than the
FFI primitive keeps the GEMM's workspace result out of the saved residuals.)
"""

from __future__ import annotations

import jax

from lowbit.ops.gemm import GEMM_CHECKPOINT_NAME

_save_gemms = jax.checkpoint_policies.save_only_these_names(GEMM_CHECKPOINT_NAME)

#: Saves dot_general/convolution outputs and lowbit GEMM outputs.
checkpoint_dots_and_lowbit_gemms = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.checkpoint_dots, _save_gemms
)

#: Saves dot_general outputs without batch dimensions and lowbit GEMM outputs.
dots_with_no_batch_dims_and_lowbit_gemms = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _save_gemms
)

#: Saves only lowbit GEMM outputs.
lowbit_gemms_saveable = _save_gemms

# TransformerEngine's names.
checkpoint_dots_and_te_gemms = checkpoint_dots_and_lowbit_gemms
dots_and_te_gemms_with_no_batch_dims = dots_with_no_batch_dims_and_lowbit_gemms

__all__ = [
    "checkpoint_dots_and_lowbit_gemms",
    "checkpoint_dots_and_te_gemms",
    "dots_and_te_gemms_with_no_batch_dims",
    "dots_with_no_batch_dims_and_lowbit_gemms",
    "lowbit_gemms_saveable",
]
