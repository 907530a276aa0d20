"""FP8 block scaling (Float8BlockScaling's 1x128 / 128x128) fused into the norm and activation
kernels: their block-scaled copies, scales and amax equal lowbit.quantize of the unfused output
bit for bit (forward norms, forward activations, the activation gradient; its dbias too on the
CPU, within the float32 order bound on the GPU: tests/test_block_dbias.py), the
fused mlp / split_dense with a norm equal the composition bit for bit (loss and every gradient)
and stay near a float64 reference; LOWBIT_BLOCK_FUSION=0 and shapes that are not whole 16x16
tiles take the unfused path with the same results."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu

import lowbit
from lowbit import flax as lf
from lowbit.ops.activation import act_lu, activation, dact_dbias
from lowbit.ops.dense import dense
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.fused.dense_split import split_dense
from lowbit.ops.fused.mlp import fusable, mlp
from lowbit.ops.fused_quantize import is_fused, parse_quantize_spec
from lowbit.ops.norm import layernorm, layernorm_fwd

B1, B2 = lowbit.ScalingMode.BLOCK_1D_SCALING, lowbit.ScalingMode.BLOCK_2D_SCALING
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
FIELDS = ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax")


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same_tensor(got, want):
    assert got.shape == want.shape and got.scaling_mode == want.scaling_mode
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, (f, g.shape, w.shape)
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f)


def _norm_args(rng, R, C, dtype, norm_type, scale=3.0):
    x = jnp.asarray(rng.standard_normal((R, C)) * scale + 0.5, dtype)
    gamma = jnp.asarray(rng.standard_normal(C) * 0.5 + 1.0, jnp.float32)
    beta = jnp.asarray(rng.standard_normal(C) * 0.2, jnp.float32) if norm_type == "layernorm" else None
    return x, gamma, beta


# (mode, q dtype, layout, power_2_scale, amax_epsilon)
SPECS = [
    (B1, E4, "both", True, 0.0),
    (B1, E5, "both", False, 1e-2),
    (B2, E4, "both", False, 0.0),
    (B1, E4, "rowwise", False, 0.0),
    (B1, E4, "colwise", True, 0.0),
]
SPEC_IDS = ["1d-pow2", "1d-e5-eps", "2d", "1d-row", "1d-col-pow2"]


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("norm_type,zc", [("layernorm", False), ("rmsnorm", True)], ids=["ln", "rms-zc"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_norm_block_fused_equals_quantize(device, rng, spec, norm_type, zc, dtype):
    """The fused copies equal quantize(layernorm(x)) bit for bit; ragged tiles (272 x 400: the
    last 128-row/column tile partial) included."""
    mode, q, layout, pow2, eps = spec
    x, gamma, beta = _norm_args(rng, 272, 400, dtype, norm_type)
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc, epsilon=1e-5)

    def fused(x, gamma, beta):
        return layernorm_fwd(x, gamma, beta, quantize=(mode, q, None, layout, pow2, eps), **kw)[0]

    def composed(x, gamma, beta):
        y = layernorm(x, gamma, beta, **kw)
        return lowbit.quantize(y, mode, q, layout=layout, power_2_scale=pow2, amax_epsilon=eps)

    got = run_on(device, fused, x, gamma, beta)
    want = run_on(device, composed, x, gamma, beta)
    _assert_same_tensor(got, want)


def test_norm_block_fused_near_float64(device, rng):
    """The dequantized rowwise and colwise copies of the fused LayerNorm output are within E4M3
    rounding of a float64 LayerNorm."""
    x, gamma, beta = _norm_args(rng, 256, 384, jnp.float32, "layernorm")
    qt = run_on(
        device, lambda *a: layernorm_fwd(*a, quantize=(B1, E4, None, "both"), epsilon=1e-5)[0], x, gamma, beta
    )
    x64 = np.asarray(x, np.float64)
    mu, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(var + 1e-5) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    # E4M3: 3 mantissa bits, relative error <= 2^-4 per element; values below the block's E4M3
    # normal range (|v| < amax / 448 * 2^-6) land on subnormals: a small absolute error.
    for layout in ("rowwise", "colwise"):
        d = np.asarray(to_cpu(lowbit.dequantize(qt, layout, jnp.float32)), np.float64)
        assert np.all(np.abs(d - ref) <= 2.0**-4 * np.abs(ref) + 1e-3)


ACTS = [
    ("gelu",),
    ("silu", "linear"),
    ("relu",),
    ("gelu", "linear"),
    ("quick_gelu",),
    ("squared_relu", "linear"),
]
ACT_IDS = ["-".join(a) for a in ACTS]


def _acts_param(i, a):
    return pytest.param(a, marks=pytest.mark.slow) if i >= 2 else a


@pytest.mark.parametrize("acts", [_acts_param(i, a) for i, a in enumerate(ACTS)], ids=ACT_IDS)
@pytest.mark.parametrize("spec", SPECS[:3], ids=SPEC_IDS[:3])
def test_activation_block_fused_equals_quantize(device, rng, acts, spec):
    """Forward: the fused copies equal quantize(activation(x)); backward: the fused gradient's
    copies equal quantize_dbias(dact(dy, x))'s, and its dbias too on the CPU (the GPU sums per
    128-row tile: tests/test_block_dbias.py holds it to the float32 order bound)."""
    mode, q, layout, pow2, eps = spec
    gated = len(acts) == 2
    H = 144
    x = jnp.asarray(rng.standard_normal((208, 2 * H if gated else H)) * 2, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((208, H)), jnp.bfloat16)
    qkw = dict(layout=layout, power_2_scale=pow2, amax_epsilon=eps)
    spec_t = (mode, q, None, layout, pow2, eps)

    got = run_on(device, lambda x: act_lu(x, acts, quantize=spec_t), x)
    want = run_on(device, lambda x: lowbit.quantize(act_lu(x, acts), mode, q, **qkw), x)
    _assert_same_tensor(got, want)

    got_q, got_db = run_on(
        device, lambda dy, x: dact_dbias(dy, x, acts, quantize=spec_t, with_dbias=True), dy, x
    )

    def composed(dy, x):
        return lowbit.quantize_dbias(dact_dbias(dy, x, acts)[0], mode, q, **qkw)

    want_q, want_db = run_on(device, composed, dy, x)
    _assert_same_tensor(got_q, want_q)
    if not is_gpu(device):
        np.testing.assert_array_equal(_bits(got_db), _bits(want_db))


def test_is_fused_rules(on_cpu, monkeypatch):
    """Block modes fuse for whole 16x16 tiles only, and not under LOWBIT_BLOCK_FUSION=0; tensor
    scaling always; MXFP8 never. A bad value of the switch is refused, naming it."""
    spec = parse_quantize_spec((B1, E4, None, "both"), jnp.bfloat16)
    assert is_fused(spec, 32, 64) and not is_fused(spec, 24, 64) and not is_fused(spec, 32, 72)
    assert not is_fused(parse_quantize_spec((lowbit.ScalingMode.MXFP8_1D_SCALING,), jnp.bfloat16), 32, 64)
    assert is_fused(parse_quantize_spec((lowbit.ScalingMode.CURRENT_TENSOR_SCALING,), jnp.bfloat16), 24, 72)
    monkeypatch.setenv("LOWBIT_BLOCK_FUSION", "0")
    assert not is_fused(spec, 32, 64) and not fusable(lowbit.Float8BlockScaling(), ("gelu",))
    monkeypatch.setenv("LOWBIT_BLOCK_FUSION", "yes")
    with pytest.raises(ValueError, match="LOWBIT_BLOCK_FUSION"):
        is_fused(spec, 32, 64)


def test_norm_unfused_shapes_match(on_cpu, rng):
    """Rows that are not whole 16-row chunks take the unfused path: the same tensor."""
    x, gamma, beta = _norm_args(rng, 24, 128, jnp.bfloat16, "layernorm")
    got = layernorm_fwd(x, gamma, beta, quantize=(B1, E4, None, "both"))[0]
    want = lowbit.quantize(layernorm(x, gamma, beta), B1, E4, layout="both")
    _assert_same_tensor(got, want)


# ---- the fused layer paths: mlp and split_dense with a norm ----

RECIPE = lowbit.Float8BlockScaling()


def _mlp_fused(x, gamma, beta, k1, b1, k2, b2, acts):
    return mlp(x, k1, b1, k2, b2, acts, recipe=RECIPE, norm=NormInput(gamma, beta, "layernorm", False, 1e-5))[
        0
    ]


def _mlp_composed(x, gamma, beta, k1, b1, k2, b2, acts):
    y = layernorm(x, gamma, beta, epsilon=1e-5)
    h = dense(y, k1, b1, recipe=RECIPE, out_dtype=x.dtype)
    return dense(activation(h, acts), k2, b2, recipe=RECIPE, out_dtype=x.dtype)


def _mlp_operands(rng, M, K, F, N, gated, dtype=jnp.bfloat16):
    W = 2 * F if gated else F
    x = jnp.asarray(rng.standard_normal((2, M // 2, K)), dtype)
    gamma = jnp.asarray(rng.standard_normal(K) * 0.2 + 1.0, jnp.float32)
    beta = jnp.asarray(rng.standard_normal(K) * 0.1, jnp.float32)
    k1 = jnp.asarray(rng.standard_normal((K, W)) / np.sqrt(K), jnp.float32)
    b1 = jnp.asarray(rng.standard_normal((W,)) * 0.1, jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((F, N)) / np.sqrt(F), jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((N,)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, M // 2, N)), jnp.float32)
    return x, gamma, beta, k1, b1, k2, b2, dy


def _value_and_grads(fn, acts):
    def loss(x, gamma, beta, k1, b1, k2, b2, dy):
        return jnp.vdot(fn(x, gamma, beta, k1, b1, k2, b2, acts).astype(jnp.float32), dy)

    return jax.value_and_grad(loss, argnums=tuple(range(7)))


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
def test_mlp_block_fused_equals_composition(device, rng, acts):
    """LayerNorm + mlp under Float8BlockScaling: loss and every gradient (x, gamma, beta, both
    kernels and biases) are the composition's bits; on the GPU bias_1's gradient (the fused
    block dbias, another summation order) within 2^-7 of it (a bf16 sum re-rounded)."""
    assert fusable(RECIPE, acts)
    ops = _mlp_operands(rng, 160, 144, 176, 128, len(acts) == 2)
    got = to_cpu(run_on(device, _value_and_grads(_mlp_fused, acts), *ops))
    want = to_cpu(run_on(device, _value_and_grads(_mlp_composed, acts), *ops))
    got, want = (got[0], list(got[1])), (want[0], list(want[1]))
    if is_gpu(device):  # 1 bf16 ulp (rounding flips), plus float32 order noise near zero sums
        g, w = got[1].pop(4), want[1].pop(4)
        np.testing.assert_allclose(g, w, rtol=2.0**-7, atol=1e-3 * np.abs(w).max())
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    assert np.isfinite(got[0]) and abs(got[0]) > 0


def test_mlp_block_fused_near_float64(device, rng):
    """Output and x's gradient of the fused LayerNorm + GELU MLP near float64 (E4M3 operands,
    block-scaled gradients)."""
    x, gamma, beta, k1, b1, k2, b2, dy = _mlp_operands(rng, 128, 128, 256, 128, False, jnp.float32)

    def f64(x):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        y = (x - mu) / np.sqrt(var + 1e-5) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
        h = y @ np.asarray(k1, np.float64) + np.asarray(b1, np.float64)
        z = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        return z @ np.asarray(k2, np.float64) + np.asarray(b2, np.float64)

    x64 = np.asarray(x, np.float64)
    out = np.asarray(to_cpu(run_on(device, _mlp_fused, x, gamma, beta, k1, b1, k2, b2, acts=("gelu",))))
    want = f64(x64)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 8e-2  # as tests/test_mlp.py

    def loss(x):
        return jnp.vdot(_mlp_fused(x, gamma, beta, k1, b1, k2, b2, ("gelu",)).astype(jnp.float32), dy)

    gx = np.asarray(to_cpu(run_on(device, jax.grad(loss), x)))
    # float64 gradient by central differences along a random direction (the model is smooth)
    d = rng.standard_normal(x.shape)
    eps = 1e-4
    fd = (np.vdot(f64(x64 + eps * d), dy) - np.vdot(f64(x64 - eps * d), dy)) / (2 * eps)
    assert abs(np.vdot(gx, d) - fd) <= 0.1 * abs(fd)


def test_split_dense_block_fused_equals_composition(device, rng):
    """The fused QKV projection with its norm under Float8BlockScaling: outputs and gradients
    are the bits of layernorm followed by split_dense's composition."""
    K, n, F = 128, 3, 64
    x = jnp.asarray(rng.standard_normal((2, 48, K)), jnp.bfloat16)
    gamma = jnp.asarray(rng.standard_normal(K) * 0.2 + 1.0, jnp.float32)
    beta = jnp.asarray(rng.standard_normal(K) * 0.1, jnp.float32)
    k = jnp.asarray(rng.standard_normal((K, n, F)) / np.sqrt(K), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, F)) * 0.1, jnp.float32)
    dys = tuple(jnp.asarray(rng.standard_normal((2, 48, F)), jnp.float32) for _ in range(n))

    def fused(x, gamma, beta, k, b):
        return split_dense(x, k, b, recipe=RECIPE, norm=NormInput(gamma, beta, "layernorm", False, 1e-5))[0]

    def composed(x, gamma, beta, k, b):
        y = layernorm(x, gamma, beta, epsilon=1e-5)
        out = dense(y, k, b, recipe=RECIPE, out_dtype=x.dtype)
        return tuple(out[..., i, :] for i in range(n))

    def grads(fn):
        def loss(x, gamma, beta, k, b, dys):
            return sum(jnp.vdot(o.astype(jnp.float32), d) for o, d in zip(fn(x, gamma, beta, k, b), dys))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))

    got = to_cpu(run_on(device, grads(fused), x, gamma, beta, k, b, dys))
    want = to_cpu(run_on(device, grads(composed), x, gamma, beta, k, b, dys))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


def _quantize_calls(module, variables, x):
    def loss(v, x):
        return module.apply(v, x)[0].astype(jnp.float32).sum()

    with lowbit.autocast(RECIPE):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).as_text()
    return len(re.findall(r"lowbit_quantize\b", text))


def test_layernorm_mlp_block_takes_fused_path(on_cpu, monkeypatch):
    """LayerNormMLP under Float8BlockScaling: 3 quantize calls per step (two kernels and the
    output's gradient: the norm and activation kernels write the others), 6 with
    LOWBIT_BLOCK_FUSION=0 (x, the activation and its gradient quantized separately)."""
    x = jnp.ones((2, 16, 128), jnp.bfloat16)
    m = lf.LayerNormMLP(
        intermediate_dim=256, activations=("gelu",), intermediate_dropout_rate=0.0, dtype=jnp.bfloat16
    )
    with lowbit.autocast(RECIPE):
        v = nn.unbox(m.init(jax.random.PRNGKey(0), x))
    assert _quantize_calls(m, v, x) == 3
    monkeypatch.setenv("LOWBIT_BLOCK_FUSION", "0")
    assert _quantize_calls(m, v, x) == 6
