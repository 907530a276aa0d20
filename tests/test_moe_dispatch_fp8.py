"""The fused FP8 dispatch wired into the grouped GEMM: grouped_gemm_prequantized(qlhs=
permute_quantize(...)) equals the grouped GEMM that quantizes the permuted bf16 rows itself, bit
for bit (output, dlhs through the permutation, dW, the DelayedScaling state); the MoE block under
lowbit.moe.kernels("fused") takes that path (one gather and one token cast fewer in the compiled
step) with the same results (CPU and, gpu marker, the GPU), within FP8 bounds of the float64
reference; bad qlhs arguments."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_block import inputs, reference, rel

import lowbit
from lowbit.moe import (
    kernels,
    moe_block,
    permute,
    permute_quantize,
    plan_dispatch,
    quantize_experts,
    topk_routing,
)
from lowbit.ops.fused import moe as moe_engine
from lowbit.ops.fused.grouped_prequantized import grouped_gemm_prequantized

RECIPES = [lowbit.Float8CurrentScaling(), lowbit.DelayedScaling(amax_history_len=4)]
IDS = ["current", "delayed"]


def _state(recipe, E):
    return lowbit.init_grouped_delayed_state(recipe, E) if isinstance(recipe, lowbit.DelayedScaling) else None


def _equal_trees(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_quantized_lhs_equals_the_casting_gemm(recipe):
    # T * k = 74 rows (not a multiple of 16) and K = 40: both padded inside the GEMM.
    T, Kd, N, E, k = 37, 40, 24, 6, 2
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(ks[0], (T, Kd), jnp.float32) * 2
    w = jax.random.normal(ks[1], (E, Kd, N), jnp.float32)
    dy = jax.random.normal(ks[2], (T * k, N), jnp.float32)
    experts = jax.random.randint(ks[3], (T, k), 0, E)
    state = _state(recipe, E)
    scale = None if state is None else jnp.linspace(2.0, 9.0, E, dtype=jnp.float32)
    if state is not None:
        state = {**state, "x_scale": scale}

    def casting(x, w, state):
        plan = plan_dispatch(experts, E)
        xs = permute(x.astype(jnp.bfloat16), plan)
        y = lowbit.grouped_gemm(
            xs, w, plan.group_sizes, recipe=recipe, state=state, preferred_element_type=jnp.float32
        )
        return jnp.sum(y * dy)

    def fused(x, w, state):
        plan = plan_dispatch(experts, E)
        xb = x.astype(jnp.bfloat16)
        mode, q = recipe.scaling_mode("x"), recipe.q_dtype("x")
        qx = permute_quantize(xb, plan, experts, mode, q, scale=None if state is None else state["x_scale"])
        y = grouped_gemm_prequantized(
            permute(xb, plan), w, quantize_experts(w, recipe, state), plan.group_sizes, recipe=recipe,
            state=state, preferred_element_type=jnp.float32, qlhs=qx,
        )  # fmt: skip
        return jnp.sum(y * dy)

    argn = (0, 1, 2) if state is not None else (0, 1)
    a = jax.jit(jax.value_and_grad(casting, argnums=argn))(x, w, state)
    b = jax.jit(jax.value_and_grad(fused, argnums=argn))(x, w, state)
    _equal_trees(a, b)


def _block_step(recipe):
    def loss(x, gate, wi, wo, state):
        with kernels("fused"):  # entered while tracing
            y, _, _ = moe_block(x, gate, wi, wo, num_experts_per_tok=2, recipe=recipe, state=state)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _targets(hlo):
    names = re.findall(r'custom_call_target="([^"]+)"', hlo)
    return {n: names.count(n) for n in set(names)}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_block_fused_dispatch_equals_the_casting_block(device, recipe, monkeypatch):
    x, gate, wi, wo, _, _ = jax.device_put(inputs(5), device)
    E = wi.shape[0]
    state = None if _state(recipe, E) is None else (_state(recipe, E),) * 2
    args = (x, gate, wi, wo, state)
    step = _block_step(recipe)
    got, hlo = step(*args), step.lower(*args).compile().as_text()
    monkeypatch.setattr(moe_engine, "_dispatch_quantized", lambda *a: None)  # the old path
    old_step = _block_step(recipe)
    want, old_hlo = old_step(*args), old_step.lower(*args).compile().as_text()
    _equal_trees(got, want)
    new, old = _targets(hlo), _targets(old_hlo)
    # The old path gathers bf16 rows (one moe_permute) and casts them in fc1; the new one's only
    # gather is the FP8 dispatch (the bf16 gather left the forward) and fc1 casts no tokens.
    assert new["lowbit_moe_permute"] == old["lowbit_moe_permute"] == 1
    assert new["lowbit_grouped_quantize"] == old["lowbit_grouped_quantize"] - 1


def test_block_fused_dispatch_within_fp8_bounds_of_float64():
    x, gate, wi, wo, _, _ = inputs(2)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(9), x.shape), np.float32)

    def loss(x, gate, wi, wo):
        with kernels("fused"):
            y, aux, _ = moe_block(
                x, gate, wi, wo, num_experts_per_tok=2, aux_loss_coeff=0.01,
                recipe=lowbit.Float8CurrentScaling(),
            )  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * dy) + aux, y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, gate, wi, wo)
    ref_y, _, ref_g = reference(x, gate, wi, wo, None, None, dy)
    assert rel(y, ref_y) < 8e-2
    for name, g in zip(("x", "gate", "wi", "wo"), grads):
        assert rel(g, ref_g[name]) < 1.2e-1, (name, rel(g, ref_g[name]))


def test_permute_quantize_under_grad_of_the_router():
    """permute_quantize inside jax.grad with routing from the fused (custom-VJP) router: the FFI
    call got the routing's integer tangents and refused them."""
    T, E, d = 16, 4, 32
    x = jax.random.normal(jax.random.PRNGKey(0), (T, d), jnp.float32)
    gate = jax.random.normal(jax.random.PRNGKey(1), (d, E), jnp.float32)

    def f(x):
        w, ex = topk_routing(x @ gate, 2, impl="fused")
        plan = plan_dispatch(ex, E, impl="fused")
        q = permute_quantize(x.astype(jnp.bfloat16), plan, ex, lowbit.ScalingMode.CURRENT_TENSOR_SCALING)
        return jnp.sum(q.amax) * jnp.sum(w * w)

    g = jax.jit(jax.grad(f))(x)  # under jit: the stop_gradient on x alone did not reach the call
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


def test_bad_qlhs_named():
    E, M, Kd, N = 4, 32, 32, 16
    x = jnp.ones((M, Kd), jnp.bfloat16)
    w = jnp.ones((E, Kd, N), jnp.float32)
    gs = jnp.array([8, 8, 8, 8], jnp.int32)
    cur = lowbit.Float8CurrentScaling()
    qw = quantize_experts(w, cur)
    row = lowbit.grouped_quantize(x, gs, lowbit.ScalingMode.CURRENT_TENSOR_SCALING, layout="rowwise")
    with pytest.raises(ValueError, match="qlhs must be a ScaledTensor with both layouts"):
        grouped_gemm_prequantized(x, w, qw, gs, recipe=cur, qlhs=row)
    both = lowbit.grouped_quantize(x[:16], gs // 2, lowbit.ScalingMode.CURRENT_TENSOR_SCALING, layout="both")
    with pytest.raises(ValueError, match=r"qlhs must hold lhs's \(M, K\)"):
        grouped_gemm_prequantized(x, w, qw, gs, recipe=cur, qlhs=both)
    delayed = lowbit.DelayedScaling()
    st = lowbit.init_grouped_delayed_state(delayed, E)
    full = lowbit.grouped_quantize(x, gs, lowbit.ScalingMode.CURRENT_TENSOR_SCALING, layout="both")
    with pytest.raises(ValueError, match="quantized as the recipe's x"):
        grouped_gemm_prequantized(
            x, w, quantize_experts(w, delayed, st), gs, recipe=delayed, state=st, qlhs=full
        )
