"""lowbit.ops.fused.grouped_prequantized: the grouped GEMM on expert weights quantized once
(quantize_experts) equals lowbit.grouped_gemm bit for bit (output, dlhs, dw, the DelayedScaling
state), for every FP8 recipe; the copies are reused across calls; bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops.fused.grouped_prequantized import grouped_gemm_prequantized, quantize_experts

G, M, K, N = 4, 72, 40, 24


def _data(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k[0], (M, K), jnp.float32)
    w = jax.random.normal(k[1], (G, K, N), jnp.float32)
    dy = jax.random.normal(k[2], (M, N), jnp.float32)
    return x, w, dy, jnp.array([20, 0, 30, 14], jnp.int32)  # 8 rows in no group


RECIPES = [
    lowbit.Float8CurrentScaling(),
    lowbit.DelayedScaling(amax_history_len=4),
    pytest.param(lowbit.Float8BlockScaling(), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_prequantized_equals_grouped_gemm(recipe):
    x, w, dy, gs = _data(0)
    delayed = isinstance(recipe, lowbit.DelayedScaling)
    state = lowbit.init_grouped_delayed_state(recipe, G) if delayed else None

    def plain(x, w, state):
        return jnp.sum(
            lowbit.grouped_gemm(x, w, gs, recipe=recipe, state=state, preferred_element_type=jnp.float32) * dy
        )

    def pre(x, w, state):
        qw = quantize_experts(w, recipe, state)  # once per step; reused by forward and backward
        y = grouped_gemm_prequantized(
            x, w, qw, gs, recipe=recipe, state=state, preferred_element_type=jnp.float32
        )
        return jnp.sum(y * dy)

    argn = (0, 1, 2) if delayed else (0, 1)
    a = jax.jit(jax.value_and_grad(plain, argnums=argn))(x, w, state)
    b = jax.jit(jax.value_and_grad(pre, argnums=argn))(x, w, state)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _casts(f, *args):
    from helpers import jaxpr_eqns

    eqns = jaxpr_eqns(jax.make_jaxpr(f)(*args).jaxpr)
    return sum(e.params.get("target_name") == "lowbit_grouped_quantize" for e in eqns)


def test_a_step_given_the_copies_casts_no_weight():
    """FP8 primary weights: the copies come from outside the step (the optimizer update that
    wrote w); the step's fwd+bwd quantizes tokens and gradients only, and its weight gradient
    equals the plain grouped GEMM's."""
    recipe = lowbit.Float8CurrentScaling()
    x, w, dy, gs = _data(1)

    def plain(w):
        return jnp.sum(lowbit.grouped_gemm(x, w, gs, recipe=recipe, preferred_element_type=jnp.float32) * dy)

    def step(w, qw):
        return jnp.sum(
            grouped_gemm_prequantized(x, w, qw, gs, recipe=recipe, preferred_element_type=jnp.float32) * dy
        )

    qw = jax.jit(quantize_experts, static_argnums=1)(w, recipe)
    np.testing.assert_array_equal(np.asarray(jax.grad(plain)(w)), np.asarray(jax.grad(step)(w, qw)))
    assert _casts(jax.grad(plain), w) == 3  # x, w (both layouts in one pass), grad
    assert _casts(jax.grad(step), w, qw) == 2  # x, grad


def test_bad_arguments():
    x, w, _, gs = _data(2)
    with pytest.raises(ValueError, match="recipe"):
        quantize_experts(w, lowbit.MXFP8BlockScaling())
    qw = quantize_experts(w, lowbit.Float8CurrentScaling())
    with pytest.raises(ValueError, match="qw"):
        grouped_gemm_prequantized(x, w[:, :, :8], qw, gs, recipe=lowbit.Float8CurrentScaling())
    with pytest.raises(ValueError, match="state"):
        quantize_experts(w, lowbit.DelayedScaling())
