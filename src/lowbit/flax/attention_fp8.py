"""DotProductAttention's FP8 path: under :func:`lowbit.autocast` with a recipe whose
``fp8_dpa`` is True (DelayedScaling, Float8CurrentScaling), attention runs in FP8
(:func:`lowbit.ops.attention.fp8.fp8_attention`). DelayedScaling's amax histories and scales live
in the module's ``_overwrite_with_gradient`` collection, as the dense layers' do (one set per call
of the module in a step). A call FP8 attention cannot take (a bias, sinks, packing, a window,
context parallelism, a mesh split) runs in the input precision, with a warning that says why.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import jax.numpy as jnp

from lowbit.autocast import get_recipe
from lowbit.flax.state_module import OVERWRITE_WITH_GRADIENT, call_index, state_variable_name
from lowbit.ops.attention import cp_active, fp8_scales
from lowbit.ops.attention.fp8 import fp8_attention, unsupported
from lowbit.recipe import DelayedScaling


def fp8_state_variables(module, recipe: DelayedScaling) -> dict:
    """The FP8 attention state of ``module`` (created at init, read after)."""
    call = call_index(module, "fp8_dpa")
    return {
        k: module.variable(
            OVERWRITE_WITH_GRADIENT, state_variable_name(k, call), init, shape, jnp.float32
        ).value
        for k, (shape, init) in fp8_scales.state_layout(recipe).items()
    }


def fp8_dpa(module, query, key, value, desc, bias, mask_type, softmax, window, rate) -> Optional[jnp.ndarray]:
    """FP8 attention of DotProductAttention ``module`` on (b, s, h, d) inputs, or None when the
    active recipe asks for none (or the call falls back; then with a warning)."""
    recipe = get_recipe()
    if recipe is None or not (getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False)):
        return None
    _, sq, _, d = query.shape
    why = unsupported(
        bias=bias is not None,
        softmax_type=softmax,
        segments=desc is not None,
        window=window,
        cp=cp_active(module.context_parallel_axis),
        mask_type=mask_type,
        sq=sq,
        sk=key.shape[1],
    )
    if why is not None:
        warnings.warn(f"fp8_dpa=True: this attention runs in {query.dtype}, not FP8: {why}", stacklevel=3)
        return None
    fp8_scales.check_recipe(recipe)
    state = fp8_state_variables(module, recipe) if isinstance(recipe, DelayedScaling) else None
    rng = module.make_rng(module.dropout_rng_name) if rate > 0 else None
    impl = {None: None, "cudnn": "cudnn"}.get(module.implementation, "emulate")
    scale = float(module.scale_factor) if module.scale_factor is not None else 1.0 / math.sqrt(d)
    return fp8_attention(
        query,
        key.astype(query.dtype),
        value.astype(query.dtype),
        recipe=recipe,
        state=state,
        causal=mask_type == "causal",
        scale=scale,
        dropout_rate=rate,
        rng=rng,
        implementation=impl,
    )


__all__ = ["fp8_dpa", "fp8_state_variables"]
