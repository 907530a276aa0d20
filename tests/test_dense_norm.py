"""A norm fused into the input of split_dense / mlp (lowbit.ops.fused.dense_norm): the norm kernel
writes the GEMM's FP8 input and its backward runs inside the GEMM's VJP. Equal bit for bit to
layernorm followed by the unfused op (outputs, the norm output when returned, every gradient,
the DelayedScaling state), near a float64 reference; LayerNormMLP and MultiHeadAttention take it."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on, to_cpu

import lowbit
from lowbit import flax as lf
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.fused.dense_split import split_dense
from lowbit.ops.fused.mlp import mlp
from lowbit.ops.norm import layernorm

RECIPES = {"delayed": lowbit.DelayedScaling(amax_history_len=4), "current": lowbit.Float8CurrentScaling()}
NORMS = [("layernorm", False), ("layernorm", True), ("rmsnorm", False)]
NORM_IDS = ["ln", "ln-zc", "rms"]


def _state(recipe):
    return lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None


def _norm_params(rng, K, norm_type, zc):
    gamma = jnp.asarray(rng.standard_normal(K) * 0.2 + (0.0 if zc else 1.0), jnp.float32)
    beta = jnp.asarray(rng.standard_normal(K) * 0.1, jnp.float32) if norm_type == "layernorm" else None
    return gamma, beta


def _split_fused(x, gamma, beta, k, b, recipe, state, norm_type, zc, ret):
    norm = NormInput(gamma, beta, norm_type, zc, 1e-5, ret)
    return split_dense(x, k, b, recipe=recipe, state=state, norm=norm)


def _split_composed(x, gamma, beta, k, b, recipe, state, norm_type, zc, ret):
    y = layernorm(x, gamma, beta, norm_type=norm_type, zero_centered_gamma=zc, epsilon=1e-5)
    return split_dense(y, k, b, recipe=recipe, state=state), (y if ret else None)


def _split_grads(fn, recipe, norm_type, zc, ret):
    """Outputs and the gradients of <outputs, dys> (+ <norm output, dn>) for x, gamma, beta,
    kernel, bias and the state."""

    def loss(x, gamma, beta, k, b, state, dys, dn):
        outs, y = fn(x, gamma, beta, k, b, recipe, state, norm_type, zc, ret)
        total = sum(jnp.vdot(o.astype(jnp.float32), d) for o, d in zip(outs, dys))
        if ret:
            total = total + jnp.vdot(y.astype(jnp.float32), dn)
        return total, (outs, y)

    def run(*args):
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(*args)
        return aux, grads

    return run


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize(
    "norm", [NORMS[0], pytest.param(NORMS[1], marks=pytest.mark.slow), NORMS[2]], ids=NORM_IDS
)
@pytest.mark.parametrize("ret", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["", "ret"])
def test_split_dense_norm_equals_composition(device, rng, recipe_name, norm, ret):
    """Two steps (DelayedScaling: the second with the state the first returned)."""
    recipe, (norm_type, zc) = RECIPES[recipe_name], norm
    M, K, n, F = 64, 128, 3, 64
    x = jnp.asarray(rng.standard_normal((2, M // 2, K)) * 2 + 0.5, jnp.bfloat16)
    gamma, beta = _norm_params(rng, K, norm_type, zc)
    k = jnp.asarray(rng.standard_normal((K, n, F)) / np.sqrt(K), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, F)) * 0.1, jnp.float32)
    dys = [jnp.asarray(rng.standard_normal((2, M // 2, F)), jnp.float32) for _ in range(n)]
    dn = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    state = _state(recipe)
    for _ in range(2):
        args = (x, gamma, beta, k, b, state, dys, dn)
        got = to_cpu(run_on(device, _split_grads(_split_fused, recipe, norm_type, zc, ret), *args))
        want = to_cpu(run_on(device, _split_grads(_split_composed, recipe, norm_type, zc, ret), *args))
        assert (got[0][1] is None) == (not ret)
        assert all(np.abs(o).max() > 0 for o in got[0][0])
        assert np.abs(got[1][1]).max() > 0  # dgamma
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)
        if state is None:
            break
        state = got[1][5]


def _mlp_fused(x, gamma, beta, k1, b1, k2, b2, recipe, states, norm_type, ret):
    norm = NormInput(gamma, beta, norm_type, return_output=ret)
    return mlp(x, k1, b1, k2, b2, ("gelu",), recipe=recipe, states=states, norm=norm)


def _mlp_composed(x, gamma, beta, k1, b1, k2, b2, recipe, states, norm_type, ret):
    y = layernorm(x, gamma, beta, norm_type=norm_type, epsilon=1e-6)
    return mlp(y, k1, b1, k2, b2, ("gelu",), recipe=recipe, states=states), (y if ret else None)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("norm_type", ["layernorm", pytest.param("rmsnorm", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ret", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["", "ret"])
def test_mlp_norm_equals_composition(device, rng, recipe_name, norm_type, ret):
    """Two steps; with ``ret`` the norm output is returned and a cotangent flows into it (as
    LayerNormMLP's ``return_layernorm_output``, TE's default)."""
    recipe = RECIPES[recipe_name]
    M, K, F, N = 64, 64, 96, 48
    x = jnp.asarray(rng.standard_normal((2, M // 2, K)), jnp.bfloat16)
    gamma, beta = _norm_params(rng, K, norm_type, False)
    k1 = jnp.asarray(rng.standard_normal((K, F)) / np.sqrt(K), jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((F, N)) / np.sqrt(F), jnp.float32)
    b1 = jnp.asarray(rng.standard_normal(F) * 0.1, jnp.float32)
    b2 = jnp.asarray(rng.standard_normal(N) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, M // 2, N)), jnp.float32)
    states = (_state(recipe), _state(recipe))

    dn = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def grads(fn):
        def loss(x, gamma, beta, k1, b1, k2, b2, states):
            out, y = fn(x, gamma, beta, k1, b1, k2, b2, recipe, states, norm_type, ret)
            total = jnp.vdot(out.astype(jnp.float32), dy)
            return total + jnp.vdot(y.astype(jnp.float32), dn) if ret else total

        return jax.value_and_grad(loss, argnums=tuple(range(8)))

    for _ in range(2):
        args = (x, gamma, beta, k1, b1, k2, b2, states)
        got = to_cpu(run_on(device, grads(_mlp_fused), *args))
        want = to_cpu(run_on(device, grads(_mlp_composed), *args))
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)
        assert np.abs(got[1][1]).max() > 0
        if states[0] is None:
            break
        states = got[1][7]


def test_split_dense_norm_against_float64(device, rng):
    """Slots and the gradients of x, gamma and beta near float64 (E4M3 input and kernel, E5M2
    gradients): layernorm by hand, its VJP by hand."""
    recipe = RECIPES["current"]
    M, K, F = 128, 128, 64
    x = jnp.asarray(rng.standard_normal((M, K)) * 3 + 1, jnp.float32)
    gamma, beta = _norm_params(rng, K, "layernorm", False)
    k = jnp.asarray(rng.standard_normal((K, 2, F)) / np.sqrt(K), jnp.float32)
    dys = [jnp.asarray(rng.standard_normal((M, F)), jnp.float32) for _ in range(2)]

    def loss(x, gamma, beta):
        outs, _ = split_dense(x, k, None, recipe=recipe, norm=NormInput(gamma, beta, epsilon=1e-5))
        return sum(jnp.vdot(o, d) for o, d in zip(outs, dys)), outs

    (_, outs), (gx, gg, gb) = to_cpu(
        run_on(device, jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), x, gamma, beta)
    )
    x64, g64, b64 = (np.asarray(a, np.float64) for a in (x, gamma, beta))
    mu = x64.mean(-1, keepdims=True)
    rs = 1 / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (x64 - mu) * rs
    y = xhat * g64 + b64
    k64 = np.asarray(k, np.float64)
    for i in range(2):
        want = y @ k64[:, i, :]
        assert np.linalg.norm(outs[i] - want) / np.linalg.norm(want) < 6e-2
    dy_norm = sum(np.asarray(d, np.float64) @ k64[:, i, :].T for i, d in enumerate(dys))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel(gb, dy_norm.sum(0)) < 1e-1
    assert rel(gg, (dy_norm * xhat).sum(0)) < 1e-1
    dxhat = dy_norm * g64
    dx = rs * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True) - dxhat.mean(-1, keepdims=True))
    assert rel(gx, dx) < 1.5e-1


def test_norm_input_errors(on_cpu):
    x, k = jnp.ones((4, 32)), jnp.ones((32, 3, 16))
    with pytest.raises(ValueError, match=r"gamma must have shape \(32,\)"):
        split_dense(x, k, norm=NormInput(jnp.ones(16)))
    with pytest.raises(ValueError, match="beta must be None for norm_type='rmsnorm'"):
        split_dense(x, k, norm=NormInput(jnp.ones(32), jnp.zeros(32), "rmsnorm"))
    with pytest.raises(TypeError, match="norm must be a lowbit.ops.fused.dense_norm.NormInput"):
        mlp(x, jnp.ones((32, 64)), None, jnp.ones((64, 16)), None, norm=(jnp.ones(32),))


def _custom_calls(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return {name: len(re.findall(rf"@lowbit_{name}\(", text)) for name in ("norm_fwd", "quantize")}


@pytest.mark.parametrize(
    "recipe_name", [pytest.param(r, marks=pytest.mark.slow) if r == "current" else r for r in sorted(RECIPES)]
)
def test_transformer_layer_norms_write_fp8(on_cpu, recipe_name):
    """In the fused layer's step both norms write their GEMM's FP8 input: two norm calls, and the
    quantize calls are the four kernels', the attention output's and three gradients' (the
    output projection's, fc2's, the QKV gradient in parts; fc1's comes from the activation
    kernel): 4 + 1 + 3 = 8 (10 with the norm outputs quantized separately)."""
    recipe = RECIPES[recipe_name]
    layer = lf.TransformerLayer(
        hidden_size=64,
        mlp_hidden_size=128,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        intermediate_dropout=0.0,
        mlp_activations=("gelu",),
        use_bias=True,
        dtype=jnp.bfloat16,
        transpose_batch_sequence=False,
        self_attn_mask_type="causal",
    )
    x = jnp.ones((2, 64, 64), jnp.bfloat16)
    with lowbit.autocast(recipe):
        v = nn.unbox(layer.init(jax.random.PRNGKey(0), x, deterministic=True))

        def loss(v, x):
            return layer.apply(v, x, deterministic=True).astype(jnp.float32).sum()

        calls = _custom_calls(jax.grad(loss, argnums=(0, 1)), v, x)
    assert calls == {"norm_fwd": 2, "quantize": 8}, calls
