"""quantize_parts (the concatenation of parts quantized where they lie) and split_dense (a dense
whose n output slots come back as n gradients): both equal their unfused compositions bit for
bit; MultiHeadAttention's fused QKV projection takes them."""

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
from lowbit.ops.dense import dense
from lowbit.ops.fused.dense_split import split_dense
from lowbit.ops.quantize import parts_fusable, quantize_dbias, quantize_parts

SM = lowbit.ScalingMode
RECIPES = {
    "delayed": lowbit.DelayedScaling(amax_history_len=4),
    "current": lowbit.Float8CurrentScaling(),
    "block": lowbit.Float8BlockScaling(),
}


def _bits(tree):
    return [
        np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize == 1 else np.asarray(a) for a in tree
    ]


@pytest.mark.parametrize(
    "mode",
    [SM.CURRENT_TENSOR_SCALING, SM.DELAYED_TENSOR_SCALING, SM.BLOCK_1D_SCALING, SM.BLOCK_2D_SCALING],
    ids=["current", "delayed", "block1d", "block2d"],
)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_quantize_parts_equals_concatenation(device, rng, mode, n, dtype):
    """Block scaling: parts of 192 columns, so 1x128 blocks and 128x128 tiles straddle two parts;
    the block options (power-of-two scales, amax floor) pass through."""
    width = 192 if mode.is_fp8_block else 128
    parts = [jnp.asarray(rng.standard_normal((2, 24, width)) * (i + 1), dtype) for i in range(n)]
    parts[0] = parts[0].at[1, 3, 7].set(300.0)  # the amax sits in one part only
    scale = jnp.float32(0.5) if mode == SM.DELAYED_TENSOR_SCALING else None
    opts = dict(power_2_scale=True, amax_epsilon=1e-3) if mode.is_fp8_block else {}
    assert parts_fusable(parts, mode)

    def fused(*ps):
        return quantize_parts(ps, mode, jnp.float8_e5m2, scale=scale, dbias=True, **opts)

    def whole(*ps):
        return quantize_dbias(
            jnp.concatenate(ps, -1), mode, jnp.float8_e5m2, scale=scale, layout="both", **opts
        )

    got = to_cpu(run_on(device, fused, *parts))
    want = to_cpu(run_on(device, whole, *parts))
    assert got[0].shape == (2, 24, width * n)
    for a, b in zip(
        _bits(jax.tree_util.tree_leaves(got)), _bits(jax.tree_util.tree_leaves(want)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_quantize_parts_falls_back_to_concatenation(on_cpu, rng):
    """Shapes the in-place kernel cannot take (rows not a multiple of 16, parts of 48 columns,
    MXFP8) are concatenated first: the same result."""
    for shape, mode in (((10, 64), SM.CURRENT_TENSOR_SCALING), ((32, 48), SM.CURRENT_TENSOR_SCALING)):
        parts = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3)]
        assert not parts_fusable(parts, mode)
        a, _ = quantize_parts(parts, mode, jnp.float8_e4m3fn)
        b, _ = quantize_dbias(jnp.concatenate(parts, -1), mode, jnp.float8_e4m3fn, layout="both")
        for u, v in zip(
            _bits(jax.tree_util.tree_leaves(a)), _bits(jax.tree_util.tree_leaves(b)), strict=True
        ):
            np.testing.assert_array_equal(u, v)
    parts = [jnp.ones((32, 128), jnp.bfloat16)] * 2
    assert not parts_fusable(parts, SM.MXFP8_1D_SCALING)
    assert not parts_fusable([parts[0], jnp.ones((32, 64), jnp.bfloat16)], SM.CURRENT_TENSOR_SCALING)


def test_quantize_parts_errors(on_cpu):
    CT = SM.CURRENT_TENSOR_SCALING
    with pytest.raises(ValueError, match=r"parts must share every axis but the last.*\(32, 64\), \(16, 64\)"):
        quantize_parts([jnp.ones((32, 64)), jnp.ones((16, 64))], CT)
    with pytest.raises(ValueError, match="at least one array"):
        quantize_parts([], CT)


def _operands(rng, n, bias, M=64, K=48, F=64):
    x = jnp.asarray(rng.standard_normal((2, M // 2, K)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((K, n, F)) / np.sqrt(K), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, F)) * 0.1, jnp.float32) if bias else None
    dys = [jnp.asarray(rng.standard_normal((2, M // 2, F)), jnp.float32) for _ in range(n)]
    return x, k, b, dys


def _loss(fn, recipe):
    """(outputs, gradients of x, kernel, bias and state) of <outputs, dys>. The scalar loss is
    left out: XLA's float32 reduction order differs between one buffer's slices and separate
    buffers on the GPU."""

    def loss(x, k, b, state, dys):
        outs = fn(x, k, b, recipe, state)
        return sum(jnp.vdot(o.astype(jnp.float32), d) for o, d in zip(outs, dys)), outs

    def run(x, k, b, state, dys):
        (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, k, b, state, dys)
        return outs, grads

    return run


def _split(x, k, b, recipe, state):
    return split_dense(x, k, b, recipe=recipe, state=state)


def _sliced(x, k, b, recipe, state):
    y = dense(x, k, b, recipe=recipe, state=state, out_dtype=x.dtype)
    return tuple(y[..., i, :] for i in range(k.shape[1]))


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("bias", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["bias", "nobias"])
def test_split_dense_equals_sliced_dense(device, rng, recipe_name, n, bias):
    """Two steps (DelayedScaling: the second with the first's new state): outputs, gradients of
    x, kernel and bias, and the new state are the bits of dense followed by slicing (on the GPU
    the outputs agree to rounding: the forward's narrower GEMMs may take another algorithm)."""
    recipe = RECIPES[recipe_name]
    # Block scaling: outputs of 128 columns, whole bands of the kernel's 128x128 scales (in place).
    x, k, b, dys = _operands(rng, n, bias, F=128 if recipe_name == "block" else 64)
    state = lowbit.init_delayed_state(recipe) if isinstance(recipe, lowbit.DelayedScaling) else None
    for _ in range(2):
        got = to_cpu(run_on(device, _loss(_split, recipe), x, k, b, state, dys))
        want = to_cpu(run_on(device, _loss(_sliced, recipe), x, k, b, state, dys))
        assert all(np.abs(o).max() > 0 for o in got[0])
        if is_gpu(device):  # cuBLASLt may pick another algorithm for the narrower GEMMs
            for o, w in zip(got[0], want[0], strict=True):
                np.testing.assert_allclose(
                    np.asarray(o, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2
                )
            got, want = got[1], want[1]  # gradients and state do not read the outputs: exact
        for a, c in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(a, c)
        if state is None:
            break
        state = (got if is_gpu(device) else got[1])[3]


def test_split_dense_errors(on_cpu):
    with pytest.raises(ValueError, match=r"kernel \(K, n, F\)"):
        split_dense(jnp.ones((4, 8)), jnp.ones((8, 16)))
    with pytest.raises(ValueError, match=r"bias must have shape \(3, 16\)"):
        split_dense(jnp.ones((4, 8)), jnp.ones((8, 3, 16)), jnp.ones((16,)))


def test_attention_qkv_gradients_quantized_in_parts(on_cpu):
    """MultiHeadAttention's fused QKV projection under tensor scaling: dq, dk and dv go into one
    quantize call as three parts (no concatenation); the parameter tree is TE's."""
    m = lf.MultiHeadAttention(
        head_dim=16, num_attention_heads=4, transpose_batch_sequence=False, attn_mask_type="causal"
    )
    x = jnp.ones((2, 64, 64), jnp.bfloat16)
    recipe = RECIPES["current"]
    with lowbit.autocast(recipe):
        v = nn.unbox(m.init(jax.random.PRNGKey(0), x, x))
        f = jax.jit(jax.grad(lambda v, x: m.apply(v, x, x)[0].astype(jnp.float32).sum(), argnums=(0, 1)))
        text = f.lower(v, x).as_text()
    assert v["params"]["qkv"]["kernel"].shape == (64, 3, 64)
    part = r"tensor<128x64xbf16>"
    calls = re.findall(r"@lowbit_quantize\(.*?\) \{.*?\} : \((.*?)\) ->", text)
    assert any(c.startswith(", ".join([part] * 3)) for c in calls), calls
    # and the forward GEMM writes q, k and v as three results (no slices of one product)
    gemms = re.findall(r"@lowbit_gemm\(.*?\) \{.*?\} : \(.*?\) -> \((.*?)\)", text)
    assert any(g.startswith(", ".join([part] * 3)) for g in gemms), gemms
