"""FP8 GEMM accumulation as TransformerEngine's environment says (TE < 2.10's
NVTE_JAX_FP8_2X_ACC_FPROP / _DGRAD / _WGRAD, TE 2.20's NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION):
the flags each GEMM of dense, the fused MLP and the grouped GEMM is lowered with (fast unless the
environment says split: TE 2.20's default); and the values (the CPU reference ignores the flag:
same results; on the GPU fast and split against float64)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on

import lowbit
from lowbit import abi
from lowbit.ops.accumulation import split_accumulation
from lowbit.ops.dense import dense
from lowbit.ops.fused.mlp import mlp

pytestmark = pytest.mark.usefixtures("on_cpu")
VARS = (
    "NVTE_JAX_FP8_2X_ACC_FPROP",
    "NVTE_JAX_FP8_2X_ACC_DGRAD",
    "NVTE_JAX_FP8_2X_ACC_WGRAD",
    "NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION",
)
EVERY = "NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION"  # TE 2.20: every GEMM, 1 split / 0 fast


def _gemm_flags(fn, *args) -> list[int]:
    text = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args))))).lower(*args).as_text()
    return sorted(int(f) for f in re.findall(r"@lowbit_gemm\(.*?flags = (\d+) : i32", text))


def _dense_loss(x, k):
    return dense(x, k, recipe=lowbit.Float8CurrentScaling()).astype(jnp.float32).sum()


@pytest.fixture
def clean_env(monkeypatch):
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_defaults_are_te_defaults(clean_env):
    """Fast accumulation in every FP8 GEMM: TE 2.20's default (NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION
    unset). lowbit before this followed TE < 2.10 (split in dgrad and wgrad): flags [0, 0, 1]."""
    assert not any(split_accumulation(g) for g in ("FPROP", "DGRAD", "WGRAD"))
    x, k = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 48), jnp.float32)
    assert _gemm_flags(_dense_loss, x, k) == [1, 1, 1]


@pytest.mark.parametrize(
    "env,want",
    [
        ({"NVTE_JAX_FP8_2X_ACC_DGRAD": "1"}, [0, 1, 1]),
        ({"NVTE_JAX_FP8_2X_ACC_DGRAD": "1", "NVTE_JAX_FP8_2X_ACC_WGRAD": "1"}, [0, 0, 1]),
        ({"NVTE_JAX_FP8_2X_ACC_FPROP": "1"}, [0, 1, 1]),
        ({EVERY: "0"}, [1, 1, 1]),
        ({EVERY: "1"}, [0, 0, 0]),
        ({EVERY: "1", "NVTE_JAX_FP8_2X_ACC_WGRAD": "0"}, [0, 0, 1]),  # the per-GEMM switch wins
    ],
)
def test_environment_switches_each_gemm(clean_env, env, want):
    for k, v in env.items():
        clean_env.setenv(k, v)
    x, k = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 48), jnp.float32)
    assert _gemm_flags(_dense_loss, x, k) == want


def test_fused_mlp_follows_the_environment(clean_env):
    x = jnp.ones((32, 64), jnp.bfloat16)
    k1, k2 = jnp.ones((64, 96), jnp.float32), jnp.ones((96, 48), jnp.float32)

    def loss(x, k1, k2):
        return mlp(x, k1, None, k2, None, recipe=lowbit.Float8CurrentScaling()).astype(jnp.float32).sum()

    assert _gemm_flags(loss, x, k1, k2) == [1] * 6
    clean_env.setenv(EVERY, "1")
    assert _gemm_flags(loss, x, k1, k2) == [0] * 6


@pytest.mark.parametrize("name", ["NVTE_JAX_FP8_2X_ACC_WGRAD", EVERY])
def test_bad_value(clean_env, name):
    clean_env.setenv(name, "yes")
    x, k = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 48), jnp.float32)
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'yes'"):
        _dense_loss(x, k)


def test_same_values_on_cpu(clean_env, rng):
    """The CPU GEMM has one accumulation: the switch changes no value there (on the GPU only the
    accumulation inside cuBLASLt differs)."""
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    g = jax.grad(_dense_loss, argnums=(0, 1))
    a = g(x, k)
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_DGRAD", "1")
    b = jax.grad(lambda x, k: _dense_loss(x, k), argnums=(0, 1))(x, k)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.gpu
def test_fast_accumulation_close_on_gpu(gpu_device, clean_env, rng):
    """cuBLASLt's fast accumulation in the gradients' GEMMs (long contractions: 4096 tokens) stays
    within FP8 rounding of the split-accumulation gradients."""
    x = jnp.asarray(rng.standard_normal((4096, 512)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((512, 1024)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4096, 1024)), jnp.float32)

    def grads():
        def loss(x, k):
            return jnp.vdot(dense(x, k, recipe=lowbit.Float8CurrentScaling()).astype(jnp.float32), dy)

        return [np.asarray(g, np.float64) for g in run_on(gpu_device, jax.grad(loss, argnums=(0, 1)), x, k)]

    fast = grads()
    clean_env.setenv(EVERY, "1")
    split = grads()
    for a, b in zip(split, fast):
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2


def _grouped_fast(fn, *args) -> dict[str, bool]:
    """Whether each grouped GEMM of fn's forward and backward is lowered with fast accumulation:
    {"fprop", "dgrad", "wgrad"} (wgrad: the ragged-K call; fprop / dgrad: ragged M, in order)."""
    text = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).as_text()
    calls = re.findall(r"@lowbit_grouped_gemm\(.*", text)
    ragged_m, wgrad = [], []
    for c in calls:
        flags, mode = (int(re.search(rf"{f} = (\d+) : i32", c).group(1)) for f in ("flags", "mode"))
        (wgrad if mode == abi.GROUPED_RAGGED_K else ragged_m).append(bool(flags & abi.GROUPED_FAST_ACCUM))
    assert len(ragged_m) == 2 and len(wgrad) == 1, calls
    return {"fprop": ragged_m[0], "dgrad": ragged_m[1], "wgrad": wgrad[0]}


def _grouped_args():
    x = jnp.ones((64, 32), jnp.bfloat16)
    w = jnp.ones((2, 32, 48), jnp.float32)
    return x, w, jnp.asarray([40, 24], jnp.int32)


@pytest.mark.parametrize("prequantized", [False, True])
@pytest.mark.parametrize(
    "env,want",
    [
        ({}, (True, True, True)),  # TE 2.20: its grouped GEMM accumulates every FP8 GEMM fast
        ({EVERY: "1"}, (False, False, False)),
        ({"NVTE_JAX_FP8_2X_ACC_WGRAD": "1"}, (True, True, False)),
        ({EVERY: "1", "NVTE_JAX_FP8_2X_ACC_DGRAD": "0"}, (False, True, False)),
    ],
)
def test_grouped_gemm_follows_the_environment(clean_env, env, want, prequantized):
    """The grouped GEMM's three FP8 GEMMs (both entry points) read the same switches as dense;
    before, its gradients always asked for split accumulation ({"dgrad": False, "wgrad": False})."""
    from lowbit.moe import grouped_gemm_prequantized, quantize_experts

    for k, v in env.items():
        clean_env.setenv(k, v)
    x, w, gs = _grouped_args()
    recipe = lowbit.Float8CurrentScaling()

    def loss(x, w):
        if prequantized:
            qw = quantize_experts(jax.lax.stop_gradient(w), recipe)
            y = grouped_gemm_prequantized(x, w, qw, gs, recipe=recipe)
        else:
            y = lowbit.grouped_gemm(x, w, gs, recipe=recipe)
        return y.astype(jnp.float32).sum()

    got = _grouped_fast(loss, x, w)
    assert (got["fprop"], got["dgrad"], got["wgrad"]) == want


def test_grouped_fast_accum_false_keeps_the_forward_split(clean_env):
    x, w, gs = _grouped_args()

    def loss(x, w):
        y = lowbit.grouped_gemm(x, w, gs, recipe=lowbit.Float8CurrentScaling(), fast_accum=False)
        return y.astype(jnp.float32).sum()

    assert _grouped_fast(loss, x, w) == {"fprop": False, "dgrad": True, "wgrad": True}


@pytest.mark.gpu
def test_grouped_fast_accumulation_close_on_gpu(gpu_device, clean_env, rng):
    """The grouped GEMM's gradients with fast accumulation (default) are as close to the float64
    gradients as split accumulation's (mid-size experts: groups of 512-1536 rows, the wgrad's K):
    the FP8 rounding of the operands dominates, not the accumulator."""
    x = rng.standard_normal((4096, 512))
    w = rng.standard_normal((4, 512, 1024)) / 16
    dy = rng.standard_normal((4096, 1024))
    sizes = [1024, 1536, 512, 1024]
    gs = jnp.asarray(sizes, jnp.int32)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    ends = np.cumsum(sizes)
    ref_dx = np.concatenate([dy[e - n : e] @ w[g].T for g, (n, e) in enumerate(zip(sizes, ends))])
    ref_dw = np.stack([xb[e - n : e].T @ dy[e - n : e] for n, e in zip(sizes, ends)])

    def errors():
        def loss(x, w):
            y = lowbit.grouped_gemm(x, w, gs, recipe=lowbit.Float8CurrentScaling())
            return jnp.vdot(y.astype(jnp.float32), jnp.asarray(dy, jnp.float32))

        got = run_on(
            gpu_device,
            jax.grad(loss, argnums=(0, 1)),
            jnp.asarray(x, jnp.bfloat16),
            jnp.asarray(w, jnp.float32),
        )
        return [
            np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
            for g, r in zip(got, (ref_dx, ref_dw))
        ]

    fast = errors()
    clean_env.setenv(EVERY, "1")
    split = errors()
    for f, s_ in zip(fast, split):
        assert s_ < 0.1 and f <= 1.1 * s_ + 1e-3, (fast, split)
