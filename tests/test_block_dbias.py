"""The activation gradient with its bias gradient under FP8 block scaling, fused: the block cast
sums dbias per 128-row tile and a second kernel adds the tiles (csrc/kernels/cuda/block_cast.cuh).
Its FP8 copies equal lowbit.quantize of the unfused gradient bit for bit; its dbias is a float32
sum of that gradient in another fixed order, so it is held to the float32 accumulation-order
bound (stated at :func:`assert_dbias_within_order_bound`) against a float64 sum, to an
independent float64 reference of the activation, and to bit equality between two runs.
``LOWBIT_BLOCK_DBIAS_FUSION=0`` keeps the unfused path (kernel, then quantize_dbias)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_gpu, run_on, to_cpu
from test_activation import ref_backward, tol
from test_block_fusion import SPEC_IDS, SPECS, _assert_same_tensor, _bits

import lowbit
from lowbit import flax as lf
from lowbit.ops.activation import dact_dbias

B1 = lowbit.ScalingMode.BLOCK_1D_SCALING
E4 = jnp.float8_e4m3fn


def assert_dbias_within_order_bound(db, dx):
    """``db`` is a float32 sum of ``dx``'s rows in some order, rounded once to db's dtype.

    Bound (first order in u = 2^-24; recursive, tree or blocked summation alike): a float32 sum
    of n terms is within ``(n - 1) u sum|x_i|`` of the exact sum s; rounding it once to the
    output dtype adds ``u_out |result|`` (u_out = 2^-8 bf16, 2^-11 f16, 2^-24 f32). Checked as
    ``|db - s| <= 1.01 (acc + u_out (|s| + acc)) + the dtype's smallest subnormal`` with
    ``acc = (n - 1) u sum|x_i|`` and s the float64 sum of the (already rounded) dx."""
    dx64 = np.asarray(dx, np.float64).reshape(-1, dx.shape[-1])
    n = dx64.shape[0]
    exact = dx64.sum(0)
    fi = jnp.finfo(db.dtype)
    u_out = 2.0 ** -(fi.nmant + 1)
    acc = max(n - 1, 0) * 2.0**-24 * np.abs(dx64).sum(0)
    bound = 1.01 * (acc + u_out * (np.abs(exact) + acc)) + float(fi.smallest_subnormal)
    err = np.abs(np.asarray(db, np.float64) - exact)
    bad = err > bound
    assert not bad.any(), (
        f"dbias: {bad.sum()} of {bad.size} columns outside the float32 order bound; first at "
        f"{np.argmax(bad)}: err {err[bad][0]:.3g} > {bound[bad][0]:.3g}"
    )


def _operands(rng, R, H, gated, dtype):
    W = 2 * H if gated else H
    x = jnp.asarray(rng.standard_normal((R, W)) * 2, dtype)
    dy = jnp.asarray(rng.standard_normal((R, H)) + 0.3, dtype)  # nonzero mean: sums grow with R
    return x, dy


@pytest.fixture(autouse=True)
def _dbias_fusion_default(monkeypatch):
    """Every test starts from the default (unset) switch."""
    monkeypatch.delenv("LOWBIT_BLOCK_DBIAS_FUSION", raising=False)


def test_dbias_fusion_is_the_default(on_cpu, rng):
    """Unset, the block recipe's activation gradient with dbias is one kernel (it was opt-in
    until its GPU check ran: then a second `quantize` call summed dbias)."""
    x, dy = _operands(rng, 64, 128, False, jnp.bfloat16)
    assert _ffi_names(_fused(("gelu",), (B1, E4, None, "both")), dy, x).count("quantize") == 0


def _fused(acts, spec_t):
    return lambda dy, x: dact_dbias(dy, x, acts, quantize=spec_t, with_dbias=True)


def _ffi_names(fn, *args):
    """The lowbit FFI targets of fn's HLO, traced afresh (the switches are read at trace time)."""
    return re.findall(r"lowbit_(\w+)", jax.jit(lambda *a: fn(*a)).lower(*args).as_text())


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_fused_block_dbias_near_float64(device, rng, acts, spec, dtype):
    """One kernel call (no quantize): dbias within the order bound of the float64 sum of the
    unfused gradient and near an independent float64 dact; the copies equal quantize(dx).
    272 rows: two whole 128-row tiles and a partial one; 144 columns: a partial 128 tile."""
    mode, q, layout, pow2, eps = spec
    gated = len(acts) == 2
    x, dy = _operands(rng, 272, 144, gated, dtype)
    spec_t = (mode, q, None, layout, pow2, eps)
    names = _ffi_names(_fused(acts, spec_t), dy, x)
    assert names.count("act_bwd") == 1 and "quantize" not in names, names

    got_q, db = to_cpu(run_on(device, _fused(acts, spec_t), dy, x))
    dx = to_cpu(run_on(device, lambda dy, x: dact_dbias(dy, x, acts)[0], dy, x))
    qkw = dict(layout=layout, power_2_scale=pow2, amax_epsilon=eps)
    want_q = run_on(device, lambda dx: lowbit.quantize(dx, mode, q, **qkw), dx)
    _assert_same_tensor(got_q, want_q)
    assert db.dtype == np.dtype(dtype) and db.shape == (x.shape[1],)
    assert_dbias_within_order_bound(db, dx)
    # Independent reference: float64 dact summed; each dx element is within test_activation's
    # 2 tol (its rounding, the kernels' approximate exp) of it, so the sum within 2 tol sum|dx|.
    ref = ref_backward(dy, x, acts[0], gated)
    err = np.abs(np.asarray(db, np.float64) - ref.sum(0))
    assert np.all(err <= 2 * tol(dtype) * np.abs(ref).sum(0) + 1e-6), err.max()


def test_dbias_fusion_switch(on_cpu, rng, monkeypatch):
    """LOWBIT_BLOCK_DBIAS_FUSION=0: the kernel, then quantize_dbias (the same results on the CPU);
    a bad value is refused, naming the variable."""
    x, dy = _operands(rng, 64, 128, False, jnp.bfloat16)
    fn = _fused(("gelu",), (B1, E4, None, "both"))
    got = fn(dy, x)
    monkeypatch.setenv("LOWBIT_BLOCK_DBIAS_FUSION", "0")
    assert _ffi_names(fn, dy, x).count("quantize") == 1
    want = fn(dy, x)
    _assert_same_tensor(got[0], want[0])
    np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))
    monkeypatch.setenv("LOWBIT_BLOCK_DBIAS_FUSION", "off")
    with pytest.raises(ValueError, match="LOWBIT_BLOCK_DBIAS_FUSION"):
        fn(dy, x)


def test_layernorm_mlp_block_backward_with_bias_is_fused(on_cpu, monkeypatch):
    """LayerNormMLP with biases under Float8BlockScaling: the activation gradient and its dbias
    come from the one act_bwd call (3 quantize calls: two kernels and the output's gradient; the
    old unfused backward had 4), 4 again with LOWBIT_BLOCK_DBIAS_FUSION=0."""
    x = jnp.ones((2, 16, 128), jnp.bfloat16)
    m = lf.LayerNormMLP(
        intermediate_dim=256,
        activations=("gelu",),
        intermediate_dropout_rate=0.0,
        use_bias=True,
        dtype=jnp.bfloat16,
    )
    recipe = lowbit.Float8BlockScaling()
    with lowbit.autocast(recipe):
        v = nn.unbox(m.init(jax.random.PRNGKey(0), x))

    def loss(variables, x):
        return m.apply(variables, x)[0].astype(jnp.float32).sum()

    def names():
        with lowbit.autocast(recipe):
            return _ffi_names(jax.grad(loss, argnums=(0, 1)), v, x)

    got = names()
    assert got.count("quantize") == 3 and got.count("act_bwd") == 1, got
    assert got.count("act_fwd") == 1 and got.count("norm_fwd") == 1
    monkeypatch.setenv("LOWBIT_BLOCK_DBIAS_FUSION", "0")
    assert names().count("quantize") == 4


@pytest.mark.gpu
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("spec", SPECS[:3], ids=SPEC_IDS[:3])
def test_gpu_fused_vs_unfused(gpu_device, rng, acts, spec):
    """On the GPU at a larger shape (1040 x 2048: 9 row tiles, the last partial): the fused
    copies equal the unfused path's (kernel, then quantize_dbias) bit for bit, both dbias are
    within the order bound of the float64 sum of dx, and two fused runs give the same bits."""
    assert is_gpu(gpu_device)
    mode, q, layout, pow2, eps = spec
    gated = len(acts) == 2
    x, dy = _operands(rng, 1040, 1024 if gated else 2048, gated, jnp.bfloat16)
    spec_t = (mode, q, None, layout, pow2, eps)
    qkw = dict(layout=layout, power_2_scale=pow2, amax_epsilon=eps)

    def unfused(dy, x):
        dx = dact_dbias(dy, x, acts)[0]
        return lowbit.quantize_dbias(dx, mode, q, **qkw), dx

    got_q, got_db = to_cpu(run_on(gpu_device, _fused(acts, spec_t), dy, x))
    again_q, again_db = to_cpu(run_on(gpu_device, _fused(acts, spec_t), dy, x))
    (want_q, want_db), dx = to_cpu(run_on(gpu_device, unfused, dy, x))
    _assert_same_tensor(got_q, want_q)
    _assert_same_tensor(again_q, got_q)
    np.testing.assert_array_equal(_bits(again_db), _bits(got_db))
    assert_dbias_within_order_bound(got_db, dx)
    assert_dbias_within_order_bound(want_db, dx)
