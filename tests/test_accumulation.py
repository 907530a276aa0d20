"""FP8 GEMM accumulation as TransformerEngine's environment says (TE < 2.10's
NVTE_JAX_FP8_2X_ACC_FPROP / _DGRAD / _WGRAD, TE 2.20's NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION):
the flags each GEMM of dense and of the fused MLP is lowered with; and the values (the CPU
reference ignores the flag: same results)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on

import lowbit
from lowbit.ops.dense import dense, split_accumulation
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
    """Fast accumulation in the forward GEMM, split in dgrad and wgrad (TE < 2.10's defaults;
    TE 2.20's fast everywhere is its switch's 0, tested below)."""
    assert not split_accumulation("FPROP") and split_accumulation("DGRAD") and split_accumulation("WGRAD")
    x, k = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 48), jnp.float32)
    assert _gemm_flags(_dense_loss, x, k) == [0, 0, 1]


@pytest.mark.parametrize(
    "env,want",
    [
        ({"NVTE_JAX_FP8_2X_ACC_DGRAD": "0"}, [0, 1, 1]),
        ({"NVTE_JAX_FP8_2X_ACC_DGRAD": "0", "NVTE_JAX_FP8_2X_ACC_WGRAD": "0"}, [1, 1, 1]),
        ({"NVTE_JAX_FP8_2X_ACC_FPROP": "1"}, [0, 0, 0]),
        ({EVERY: "0"}, [1, 1, 1]),
        ({EVERY: "1"}, [0, 0, 0]),
        ({EVERY: "0", "NVTE_JAX_FP8_2X_ACC_WGRAD": "1"}, [0, 1, 1]),  # the per-GEMM switch wins
    ],
)
def test_environment_switches_each_gemm(clean_env, env, want):
    for k, v in env.items():
        clean_env.setenv(k, v)
    x, k = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 48), jnp.float32)
    assert _gemm_flags(_dense_loss, x, k) == want


def test_fused_mlp_follows_the_environment(clean_env):
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_DGRAD", "0")
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_WGRAD", "0")
    x = jnp.ones((32, 64), jnp.bfloat16)
    k1, k2 = jnp.ones((64, 96), jnp.float32), jnp.ones((96, 48), jnp.float32)

    def loss(x, k1, k2):
        return mlp(x, k1, None, k2, None, recipe=lowbit.Float8CurrentScaling()).astype(jnp.float32).sum()

    assert _gemm_flags(loss, x, k1, k2) == [1] * 6


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
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_DGRAD", "0")
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

    split = grads()
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_DGRAD", "0")
    clean_env.setenv("NVTE_JAX_FP8_2X_ACC_WGRAD", "0")
    fast = grads()
    for a, b in zip(split, fast):
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2
