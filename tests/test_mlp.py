"""lowbit.ops.fused.mlp.mlp: the fused two-GEMM MLP (activation kernels writing the FP8 operands)
equals dense(activation(dense(x))) bit for bit, and a float64 reference within FP8 rounding;
LayerNormMLP takes it; argument errors; non-finite input."""

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
from lowbit.ops.activation import activation
from lowbit.ops.dense import dense
from lowbit.ops.fused.mlp import fusable, mlp

RECIPES = {"delayed": lowbit.DelayedScaling(amax_history_len=4), "current": lowbit.Float8CurrentScaling()}
ACTS = [("gelu",), ("relu",), ("silu", "linear"), ("gelu", "linear")]


def _operands(rng, M, K, F, N, gated, bias, dtype=jnp.bfloat16):
    W = 2 * F if gated else F
    x = jnp.asarray(rng.standard_normal((2, M // 2, K)), dtype)
    k1 = jnp.asarray(rng.standard_normal((K, W)) / np.sqrt(K), jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((F, N)) / np.sqrt(F), jnp.float32)
    b1 = jnp.asarray(rng.standard_normal((W,)) * 0.1, jnp.float32) if bias else None
    b2 = jnp.asarray(rng.standard_normal((N,)) * 0.1, jnp.float32) if bias else None
    dy = jnp.asarray(rng.standard_normal((2, M // 2, N)), jnp.float32)
    return x, k1, b1, k2, b2, dy


def _states(recipe):
    if isinstance(recipe, lowbit.DelayedScaling):
        return (lowbit.init_delayed_state(recipe), lowbit.init_delayed_state(recipe))
    return (None, None)


def _composed(x, k1, b1, k2, b2, acts, recipe, states):
    h = dense(x, k1, b1, recipe=recipe, state=states[0], out_dtype=x.dtype)
    return dense(activation(h, acts), k2, b2, recipe=recipe, state=states[1], out_dtype=x.dtype)


def _fused(x, k1, b1, k2, b2, acts, recipe, states):
    return mlp(x, k1, b1, k2, b2, acts, recipe=recipe, states=states)


def _grads(fn, acts, recipe):
    def loss(x, k1, b1, k2, b2, states, dy):
        y = fn(x, k1, b1, k2, b2, acts, recipe, states)
        return jnp.vdot(y.astype(jnp.float32), dy)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize(
    "acts",
    [pytest.param(a, marks=pytest.mark.slow) if a in (("relu",), ("gelu", "linear")) else a for a in ACTS],
    ids=["-".join(a) for a in ACTS],
)
@pytest.mark.parametrize("bias", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["bias", "nobias"])
def test_fused_equals_composition(device, rng, recipe_name, acts, bias):
    """Two steps (DelayedScaling: the second with the state the first returned): loss, every
    gradient and the new states are the same bits as the unfused composition's."""
    recipe = RECIPES[recipe_name]
    gated = len(acts) == 2
    x, k1, b1, k2, b2, dy = _operands(rng, 64, 48, 80, 32, gated, bias)
    states = _states(recipe)
    for _ in range(2):
        got = to_cpu(run_on(device, _grads(_fused, acts, recipe), x, k1, b1, k2, b2, states, dy))
        want = to_cpu(run_on(device, _grads(_composed, acts, recipe), x, k1, b1, k2, b2, states, dy))
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)
        assert np.isfinite(got[0]) and np.abs(got[0]) > 0
        if states[0] is None:
            break
        states = got[1][5]  # the new DelayedScaling states (the states' "gradient")


def _reference(x, k1, b1, k2, b2, acts):
    """float64: act(x k1 + b1) k2 + b2."""
    f = {
        "gelu": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))),
        "relu": lambda v: np.maximum(v, 0),
        "silu": lambda v: v / (1 + np.exp(-v)),
    }[acts[0]]
    h = np.asarray(x, np.float64) @ np.asarray(k1, np.float64)
    if b1 is not None:
        h = h + np.asarray(b1, np.float64)
    F = k2.shape[0]
    z = f(h[..., :F]) * h[..., F:] if len(acts) == 2 else f(h)
    y = z @ np.asarray(k2, np.float64)
    return y + np.asarray(b2, np.float64) if b2 is not None else y


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
def test_fused_against_float64(device, rng, recipe_name, acts):
    """Output and input gradient near float64 (E4M3 operands, E5M2 gradients); the gradient
    reference is the float64 VJP of the same function."""
    recipe = RECIPES[recipe_name]
    x, k1, b1, k2, b2, dy = _operands(rng, 128, 64, 96, 48, len(acts) == 2, True, jnp.float32)
    y = np.asarray(
        to_cpu(
            run_on(device, lambda *a: mlp(*a, acts, recipe=recipe, states=_states(recipe)), x, k1, b1, k2, b2)
        )
    )
    want = _reference(x, k1, b1, k2, b2, acts)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 8e-2

    def loss(x):
        return jnp.vdot(mlp(x, k1, b1, k2, b2, acts, recipe=recipe, states=_states(recipe)), dy)

    gx = np.asarray(to_cpu(run_on(device, jax.grad(loss), x)))
    # float64 chain rule by hand: dz = dy k2^T; dh = dz * act'(h) (gated: both halves); dx = dh k1^T
    h = np.asarray(x, np.float64) @ np.asarray(k1, np.float64) + np.asarray(b1, np.float64)
    F = k2.shape[0]
    a = h[..., :F]
    if acts[0] == "gelu":
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (a + 0.044715 * a**3))
        f, df = 0.5 * a * (1 + t), 0.5 * (1 + t) + 0.5 * a * (1 - t**2) * c * (1 + 3 * 0.044715 * a**2)
    else:
        s = 1 / (1 + np.exp(-a))
        f, df = a * s, s * (1 + a * (1 - s))
    dz = np.asarray(dy, np.float64) @ np.asarray(k2, np.float64).T
    dh = np.concatenate([dz * h[..., F:] * df, dz * f], -1) if len(acts) == 2 else dz * df
    gref = dh @ np.asarray(k1, np.float64).T
    assert np.linalg.norm(gx - gref) / np.linalg.norm(gref) < 2e-1


def _quantize_calls(module, variables, x, recipe):
    def loss(v, x):
        return module.apply(v, x)[0].astype(jnp.float32).sum()

    with lowbit.autocast(recipe):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).as_text()
    return len(re.findall(r"lowbit_quantize\b", text))


@pytest.mark.parametrize(
    "recipe_name", [pytest.param(r, marks=pytest.mark.slow) if r == "current" else r for r in sorted(RECIPES)]
)
def test_layernorm_mlp_takes_fused_path(on_cpu, recipe_name):
    """The step quantizes two kernels and the output's gradient: 3 quantize calls (x's FP8 copies
    come from the norm kernel, inside the same VJP). The composed path had 6 (x, the activation
    and its gradient quantized separately)."""
    recipe = RECIPES[recipe_name]
    x = jnp.ones((2, 8, 32), jnp.bfloat16)
    m = lf.LayerNormMLP(
        intermediate_dim=64, activations=("gelu",), intermediate_dropout_rate=0.0, dtype=jnp.bfloat16
    )
    with lowbit.autocast(recipe):
        v = nn.unbox(m.init(jax.random.PRNGKey(0), x))
    assert _quantize_calls(m, v, x, recipe) == 3
    if isinstance(recipe, lowbit.DelayedScaling):  # the same state variables as two DenseOps
        assert set(v[lf.OVERWRITE_WITH_GRADIENT]) == {"wi_op", "wo_op"}
    # Active intermediate dropout sits between the GEMMs: the composed path, 6 calls.
    md = m.clone(intermediate_dropout_rate=0.5)

    def loss_d(v, x):
        return md.apply(v, x, rngs={"dropout": jax.random.PRNGKey(1)})[0].astype(jnp.float32).sum()

    with lowbit.autocast(recipe):
        text = jax.jit(jax.grad(loss_d)).lower(v, x).as_text()
    assert len(re.findall(r"lowbit_quantize\b", text)) == 6


def test_other_recipes_compose(on_cpu, rng):
    """MXFP8 (its kernels do not write MX copies) and unfusable activations take the composition
    (same values); Float8BlockScaling is fused (tests/test_block_fusion.py)."""
    recipe = lowbit.MXFP8BlockScaling()
    assert not fusable(recipe, ("gelu",)) and not fusable(None, ("gelu",))
    assert fusable(lowbit.Float8BlockScaling(), ("gelu",))
    assert not fusable(RECIPES["current"], ("relu", "relu"))
    x, k1, b1, k2, b2, _ = _operands(rng, 128, 128, 128, 128, False, True)
    got = mlp(x, k1, b1, k2, b2, ("gelu",), recipe=recipe)
    want = _composed(x, k1, b1, k2, b2, ("gelu",), recipe, (None, None))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(k1=(32, 64), k2=(64, 16), x=(4, 31)), r"agree on K"),
        (dict(k1=(32, 64), k2=(48, 16), x=(4, 32)), r"kernel_2 must be \(64, N\)"),
        (dict(k1=(32, 64), k2=(64, 16), x=(4, 32), b1=(63,)), r"bias_1 must have shape \(64,\)"),
        (dict(k1=(32, 64), k2=(64, 16), x=(4, 32), b2=(15,)), r"bias_2 must have shape \(16,\)"),
        (dict(k1=(32, 64, 1), k2=(64, 16), x=(4, 32)), r"kernel_1 \(K, W\)"),
    ],
)
def test_errors(on_cpu, args, match):
    z = lambda s: None if s is None else jnp.zeros(s, jnp.float32)
    with pytest.raises(ValueError, match=match):
        mlp(
            z(args["x"]),
            z(args["k1"]),
            z(args.get("b1")),
            z(args["k2"]),
            z(args.get("b2")),
            recipe=RECIPES["current"],
        )
    with pytest.raises(TypeError, match="states must be a pair"):
        mlp(z((4, 32)), z((32, 64)), None, z((64, 16)), None, recipe=RECIPES["current"], states=None)


def test_nonfinite_input(device, rng):
    """NaN in x gives NaN out and NaN gradients; the DelayedScaling state stays finite."""
    recipe = RECIPES["delayed"]
    x, k1, b1, k2, b2, dy = _operands(rng, 64, 32, 48, 16, False, True)
    x = x.at[0, 3, 5].set(jnp.nan)
    loss, grads = to_cpu(
        run_on(device, _grads(_fused, ("gelu",), recipe), x, k1, b1, k2, b2, _states(recipe), dy)
    )
    assert np.isnan(loss) and np.isnan(grads[1]).any()
    for leaf in jax.tree_util.tree_leaves(grads[5]):
        assert np.isfinite(leaf).all()
