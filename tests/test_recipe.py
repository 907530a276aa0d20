"""Recipes: TransformerEngine defaults, hashability, immutability, validation, modes per role."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit import recipe as R

SM = lowbit.ScalingMode
pytestmark = pytest.mark.usefixtures("on_cpu")  # argument checks: device-independent
ALL = [R.DelayedScaling, R.Float8CurrentScaling, R.MXFP8BlockScaling, R.NVFP4BlockScaling]


def test_delayed_defaults():
    r = R.DelayedScaling()
    assert r.margin == 0
    assert r.fp8_format is R.Format.HYBRID
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.stateful
    assert r.scaling_mode("x") == SM.DELAYED_TENSOR_SCALING
    assert np.dtype(r.q_dtype("x")) == np.dtype(jnp.float8_e4m3fn)
    assert np.dtype(r.q_dtype("kernel")) == np.dtype(jnp.float8_e4m3fn)
    assert np.dtype(r.q_dtype("grad")) == np.dtype(jnp.float8_e5m2)


def test_other_defaults():
    c = R.Float8CurrentScaling()
    assert c.fp8_format is R.Format.HYBRID and not c.stateful
    assert c.scaling_mode("grad") == SM.CURRENT_TENSOR_SCALING
    assert np.dtype(c.q_dtype("grad")) == np.dtype(jnp.float8_e5m2)
    m = R.MXFP8BlockScaling()
    assert m.fp8_format is R.Format.E4M3
    assert all(m.scaling_mode(role) == SM.MXFP8_1D_SCALING for role in ("x", "kernel", "grad"))
    assert all(np.dtype(m.q_dtype(role)) == np.dtype(jnp.float8_e4m3fn) for role in ("x", "kernel", "grad"))
    n = R.NVFP4BlockScaling()
    assert (n.disable_rht, n.disable_stochastic_rounding, n.disable_2d_quantization) == (False, False, False)
    assert n.scaling_mode("kernel") == SM.NVFP4_2D_SCALING
    assert n.scaling_mode("x") == SM.NVFP4_1D_SCALING and n.scaling_mode("grad") == SM.NVFP4_1D_SCALING
    assert R.NVFP4BlockScaling(disable_2d_quantization=True).scaling_mode("kernel") == SM.NVFP4_1D_SCALING
    assert np.dtype(n.q_dtype("x")) == np.dtype(jnp.float4_e2m1fn)


@pytest.mark.parametrize(
    "fmt,fwd,bwd",
    [
        (R.Format.E4M3, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
        (R.Format.E5M2, jnp.float8_e5m2, jnp.float8_e5m2),
        (R.Format.HYBRID, jnp.float8_e4m3fn, jnp.float8_e5m2),
    ],
)
def test_formats(fmt, fwd, bwd):
    assert np.dtype(fmt.fwd_dtype) == np.dtype(fwd) and np.dtype(fmt.bwd_dtype) == np.dtype(bwd)
    # MXFP8 decodes before its GEMM, so every format runs there; per-tensor GEMMs refuse E5M2.
    r = R.MXFP8BlockScaling(fp8_format=fmt)
    assert np.dtype(r.q_dtype("x")) == np.dtype(fwd) and np.dtype(r.q_dtype("grad")) == np.dtype(bwd)
    if fmt is not R.Format.E5M2:
        r = R.Float8CurrentScaling(fp8_format=fmt)
        assert np.dtype(r.q_dtype("x")) == np.dtype(fwd) and np.dtype(r.q_dtype("grad")) == np.dtype(bwd)


@pytest.mark.parametrize("cls", [R.DelayedScaling, R.Float8CurrentScaling], ids=lambda c: c.__name__)
def test_per_tensor_e5m2_refused_when_built(cls):
    # No GEMM could run it (E5M2 x E5M2): refused here, not at the first GEMM.
    with pytest.raises(ValueError, match="fp8_format=Format.E5M2") as e:
        cls(fp8_format=R.Format.E5M2)
    assert "HYBRID" in str(e.value)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_hashable_and_equal(cls):
    a, b = cls(), cls()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    # usable as a static argument of jit
    g = jax.jit(lambda x, r: x * 2, static_argnums=1)
    assert float(g(jnp.float32(1), a)) == 2.0
    assert float(g(jnp.float32(2), b)) == 4.0


def test_distinct_recipes_hash_differently():
    assert R.DelayedScaling(margin=1) != R.DelayedScaling()
    assert R.DelayedScaling(amax_compute_algo="most_recent") != R.DelayedScaling()
    assert R.NVFP4BlockScaling(disable_rht=True) != R.NVFP4BlockScaling()
    s = {
        R.DelayedScaling(),
        R.DelayedScaling(margin=1),
        R.Float8CurrentScaling(),
        R.MXFP8BlockScaling(),
        R.NVFP4BlockScaling(),
        R.NVFP4BlockScaling(disable_rht=True),
    }
    assert len(s) == 6


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (R.DelayedScaling, "margin", 2),
        (R.DelayedScaling, "amax_history_len", 16),
        (R.Float8CurrentScaling, "fp8_format", R.Format.E4M3),
        (R.MXFP8BlockScaling, "fp8_format", R.Format.E5M2),
        (R.NVFP4BlockScaling, "disable_rht", True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_immutable(cls, field, value):
    r = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(r, field, value)
    r2 = dataclasses.replace(r, **{field: value})  # the way to change one
    assert getattr(r2, field) == value and getattr(r, field) != value


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        (dict(margin=-1), ValueError, ("margin",)),
        (dict(margin=1.5), ValueError, ("margin",)),
        (dict(amax_history_len=0), ValueError, ("amax_history_len",)),
        (dict(amax_history_len=2.0), ValueError, ("amax_history_len",)),
        (dict(amax_compute_algo="mean"), ValueError, ("amax_compute_algo", "max", "most_recent")),
        (dict(fp8_format="HYBRID"), TypeError, ("fp8_format", "Format")),
        (dict(fp8_format=jnp.float8_e4m3fn), TypeError, ("fp8_format",)),
    ],
)
def test_delayed_validation(kwargs, exc, words):
    with pytest.raises(exc) as e:
        R.DelayedScaling(**kwargs)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("cls", [R.Float8CurrentScaling, R.MXFP8BlockScaling])
def test_format_validation(cls):
    with pytest.raises(TypeError, match="fp8_format"):
        cls(fp8_format="E4M3")


@pytest.mark.parametrize("field", ["disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_nvfp4_validation(field, value):
    with pytest.raises(TypeError, match=field):
        R.NVFP4BlockScaling(**{field: value})


def test_exported():
    assert lowbit.DelayedScaling is R.DelayedScaling
    assert lowbit.Format is R.Format
    for cls in ALL:
        assert isinstance(cls(), R.Recipe)
