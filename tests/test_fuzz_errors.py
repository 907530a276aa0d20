"""Malformed calls to every public op raise TypeError/ValueError/NotImplementedError naming the
argument: no crash, no hang, no silent result (issue 11).

One subprocess per op (this file as a script, see tests/subproc.py) loops over that op's cases;
all of them start at once so the whole file takes about as long as the slowest op.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import subproc  # noqa: E402


def _setup():
    import jax.numpy as jnp
    import numpy as np

    import lowbit

    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32))
    return jnp, lowbit, lowbit.ScalingMode, x


def _short(v) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{type(v).__name__}[{v.dtype} {tuple(v.shape)}]"
    return repr(v)[:40].replace("\n", " ")


def _swap(base: dict, cases: list, call) -> list:
    """(name, thunk, words) for each (arg, bad value[, words]) substituted into the valid kwargs."""
    out = []
    for i, case in enumerate(cases):
        arg, bad = case[0], case[1]
        words = case[2] if len(case) > 2 else (arg,)
        kw = dict(base, **({arg: bad} if arg else {}))
        extra = case[3] if len(case) > 3 else {}
        kw.update(extra)
        out.append((f"{i}:{arg}={_short(bad)}", lambda kw=kw: call(**kw), words))
    return out


def _quantize_cases(dbias=False):
    jnp, lowbit, SM, x = _setup()
    fn = lowbit.quantize_dbias if dbias else lowbit.quantize
    D, MX, NV = SM.DELAYED_TENSOR_SCALING, SM.MXFP8_1D_SCALING, SM.NVFP4_1D_SCALING
    cases = [
        ("x", jnp.ones((32, 64), jnp.int32)),
        ("x", jnp.ones((32, 64), bool)),
        ("x", jnp.ones((32, 64), jnp.float8_e4m3fn)),
        ("x", "abc"),
        ("x", None),
        ("x", jnp.float32(1)),
        ("x", jnp.ones((32, 48)), ("x", "32"), dict(scaling_mode=MX)),
        ("x", jnp.ones((8, 64)), ("x", "16"), dict(scaling_mode=NV, layout="both")),
        ("scaling_mode", 99),
        ("scaling_mode", "MXFP8"),
        ("scaling_mode", None),
        ("scaling_mode", -1),
        ("q_dtype", jnp.int8),
        ("q_dtype", jnp.float32),
        ("q_dtype", jnp.float4_e2m1fn),
        ("q_dtype", "fp8"),
        ("q_dtype", jnp.float8_e4m3fn, ("q_dtype",), dict(scaling_mode=NV)),
        ("scale", jnp.float32(1.0), ("scale", "DELAYED")),
        ("scale", None, ("scale", "required"), dict(scaling_mode=D)),
        ("scale", jnp.ones((2,), jnp.float32), ("scale", "float32"), dict(scaling_mode=D)),
        ("scale", jnp.ones((1,), jnp.int32), ("scale", "float32"), dict(scaling_mode=D)),
        ("scale", "s", ("scale",), dict(scaling_mode=D)),
        ("scale", jnp.float32(0), ("scale", "positive"), dict(scaling_mode=D)),
        ("scale", jnp.float32(float("nan")), ("scale", "finite"), dict(scaling_mode=D)),
        ("layout", "row"),
        ("layout", None),
        ("layout", 3),
        ("layout", "ROWWISE"),
        ("flatten_axis", 2),
        ("flatten_axis", -3),
        ("flatten_axis", 1.5),
        ("flatten_axis", "a"),
        ("flatten_axis", None),
        ("rng_key", jnp.zeros((2,), jnp.uint32)),
        ("rht", True),
        ("rht", True, ("rht",), dict(scaling_mode=MX)),
        ("rht_sign_mask", "m", ("rht_sign_mask",), dict(scaling_mode=NV, rht=True, layout="colwise")),
    ]
    return _swap(dict(x=x, scaling_mode=SM.CURRENT_TENSOR_SCALING), cases, fn)


def _dequantize_cases():
    jnp, lowbit, SM, x = _setup()
    q = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING)
    cases = [
        ("qt", x),
        ("qt", None),
        ("qt", (q.data, q.scale_inv)),
        ("layout", "both"),
        ("layout", "x"),
        ("layout", None),
        ("layout", "colwise", ("colwise",)),
        ("dtype", jnp.int8),
        ("dtype", jnp.float8_e4m3fn),
        ("dtype", "abc"),
    ]
    return _swap(dict(qt=q), cases, lowbit.dequantize)


def _grouped_quantize_cases():
    jnp, lowbit, SM, x = _setup()
    gs = jnp.array([10, 22], jnp.int32)
    D, MX = SM.DELAYED_TENSOR_SCALING, SM.MXFP8_1D_SCALING
    cases = [
        ("x", jnp.ones((2, 16, 64)), ("x", "2-D")),
        ("x", jnp.ones((32, 64), jnp.int32)),
        ("x", None),
        ("x", jnp.ones((32, 48)), ("x", "32"), dict(scaling_mode=MX)),
        ("group_sizes", gs.astype(jnp.float32)),
        ("group_sizes", gs.reshape(1, 2)),
        ("group_sizes", jnp.zeros((0,), jnp.int32)),
        ("group_sizes", None),
        ("group_sizes", "a"),
        ("scaling_mode", SM.NVFP4_1D_SCALING),
        ("scaling_mode", 42),
        ("scaling_mode", SM.NO_SCALING),
        ("q_dtype", jnp.float4_e2m1fn),
        ("q_dtype", jnp.int8),
        ("layout", "both", ("layout", "rowwise"), dict(scaling_mode=MX)),
        ("layout", "diag"),
        ("scale", None, ("scale",), dict(scaling_mode=D)),
        ("scale", jnp.ones((3,), jnp.float32), ("scale", "(2,)"), dict(scaling_mode=D)),
        ("scale", jnp.array([1.0, float("inf")], jnp.float32), ("scale", "finite"), dict(scaling_mode=D)),
        ("scale", jnp.ones((2,), jnp.float32), ("scale",)),
    ]
    return _swap(
        dict(x=x, group_sizes=gs, scaling_mode=SM.CURRENT_TENSOR_SCALING), cases, lowbit.grouped_quantize
    )


def _grouped_dequantize_cases():
    jnp, lowbit, SM, x = _setup()
    gs = jnp.array([10, 22], jnp.int32)
    q = lowbit.grouped_quantize(x, gs, SM.CURRENT_TENSOR_SCALING)
    cases = [
        ("qt", x),
        ("qt", None),
        ("qt", lowbit.quantize(x.reshape(2, 16, 64), SM.CURRENT_TENSOR_SCALING), ("qt.shape", "2-D")),
        ("group_sizes", jnp.array([10, 10, 12], jnp.int32), ("group_sizes", "3", "2")),
        ("group_sizes", jnp.array([32], jnp.int32), ("group_sizes", "1")),
        ("group_sizes", gs.astype(jnp.float32)),
        ("group_sizes", gs.reshape(2, 1)),
        ("group_sizes", "ab"),
        ("layout", "colwise", ("colwise",)),
        ("layout", "both"),
        ("dtype", jnp.int32),
    ]
    return _swap(dict(qt=q, group_sizes=gs), cases, lowbit.grouped_dequantize)


def _gemm_cases():
    jnp, lowbit, SM, x = _setup()
    xb = x.astype(jnp.bfloat16)
    q4 = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, layout="both")
    q5 = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, jnp.float8_e5m2)
    mx = lowbit.quantize(x, SM.MXFP8_1D_SCALING)
    nv = lowbit.quantize(x, SM.NVFP4_1D_SCALING)
    cases = [
        ("a", x, ("a", "bfloat16")),
        ("a", jnp.ones((32, 64), jnp.int8), ("a", "bfloat16")),
        ("a", None),
        ("a", "abc"),
        ("a", jnp.bfloat16(1), ("a", "dimension")),
        ("a", xb[:, :32], ("K=32", "K=64")),
        ("a", q4, ("per-tensor", "bf16")),
        ("a", q5, ("a", "b", "e5m2"), dict(b=q5)),
        ("a", mx, ("a", "b", "format"), dict(b=nv)),
        ("a", nv, ("b", "BF16")),
        ("bias", jnp.zeros((3,), jnp.bfloat16), ("bias", "N=32")),
        ("bias", jnp.zeros((32,), jnp.int32), ("bias", "bfloat16")),
        ("bias", "b"),
        ("a_layout", "rowwise", ("a_layout",)),
        ("a_layout", "diag", ("a_layout",), dict(a=q4, b=q4)),
        ("b_layout", "colwise", ("colwise",), dict(a=q4, b=q5)),
        ("out_dtype", jnp.float16),
        ("out_dtype", jnp.int32),
        ("out_dtype", "x"),
    ]
    return _swap(dict(a=xb, b=xb), cases, lowbit.gemm)


def _dense_cases():
    jnp, lowbit, SM, x = _setup()
    k = jnp.ones((64, 32), jnp.float32)
    cur, dl = lowbit.Float8CurrentScaling(), lowbit.DelayedScaling(amax_history_len=4)
    st = lowbit.init_delayed_state(dl)
    cases = [
        ("x", x.astype(jnp.int32), ("x", "float32")),
        ("x", jnp.float32(1), ("x", "rank-0")),
        ("x", None),
        ("x", "x"),
        ("x", x[:, :48], ("x axis", "48", "64")),
        ("kernel", k.astype(jnp.int8), ("kernel", "float32")),
        ("kernel", jnp.float32(1), ("kernel", "rank-0")),
        ("kernel", jnp.ones((64,)), ("kernel",)),
        ("kernel", None),
        ("bias", jnp.zeros((5,)), ("bias", "(32,)")),
        ("bias", jnp.zeros((32,), jnp.int32), ("bias",)),
        ("recipe", "fp8", ("recipe",)),
        ("recipe", 3, ("recipe",)),
        ("contracting_dims", ((0,), (0,)), ("trailing",)),
        ("contracting_dims", ((5,), (0,)), ("contracting_dims",)),
        ("contracting_dims", "ab", ("contracting_dims",)),
        ("contracting_dims", ((1, 1), (0, 1)), ("contracting_dims",)),
        ("contracting_dims", ((), ()), ("contracting_dims",)),
        ("state", st, ("state", "DelayedScaling")),
        ("state", None, ("state", "DelayedScaling"), dict(recipe=dl)),
        ("state", {"x_scale": st["x_scale"]}, ("state", "missing"), dict(recipe=dl)),
        ("state", dict(st, x_scale=jnp.ones((2,))), ("x_scale", "(1,)"), dict(recipe=dl)),
        ("state", dict(st, grad_scale=jnp.zeros((1,))), ("grad_scale", "positive"), dict(recipe=dl)),
        ("out_dtype", jnp.int32),
        ("out_dtype", jnp.float8_e4m3fn),
        ("recipe", lowbit.MXFP8BlockScaling(), ("K=48", "32"), dict(x=x[:, :48], kernel=k[:48])),
    ]
    return _swap(dict(x=x, kernel=k, recipe=cur), cases, lowbit.dense)


def _grouped_gemm_cases():
    jnp, lowbit, SM, x = _setup()
    w = jnp.ones((2, 64, 16), jnp.float32)
    gs = jnp.array([10, 22], jnp.int32)
    dl = lowbit.DelayedScaling(amax_history_len=4)
    cases = [
        ("lhs", x[None], ("lhs", "2-D")),
        ("lhs", x.astype(jnp.int32), ("lhs",)),
        ("lhs", None),
        ("lhs", x[:, :48], ("K=48", "K=64")),
        ("rhs", w[0], ("rhs", "3-D")),
        ("rhs", w.astype(jnp.float16), ("rhs",)),
        ("rhs", "w"),
        ("rhs", w[:0], ("rhs", "group")),
        ("group_sizes", gs.astype(jnp.float32)),
        ("group_sizes", jnp.array([32], jnp.int32)),
        ("group_sizes", gs.reshape(1, 2)),
        ("group_sizes", None),
        ("recipe", lowbit.MXFP8BlockScaling(), ("recipe",)),
        ("recipe", "fp8", ("recipe",)),
        ("state", lowbit.init_grouped_delayed_state(dl, 2), ("state",)),
        ("state", None, ("state", "DelayedScaling"), dict(recipe=dl)),
        ("state", lowbit.init_delayed_state(dl), ("state", "(4, 2)"), dict(recipe=dl)),
        ("preferred_element_type", jnp.int32),
        ("preferred_element_type", jnp.float8_e4m3fn),
    ]
    return _swap(dict(lhs=x, rhs=w, group_sizes=gs), cases, lowbit.grouped_gemm)


def _layernorm_cases():
    jnp, lowbit, SM, x = _setup()
    g, b = jnp.ones((64,)), jnp.zeros((64,))
    D = SM.DELAYED_TENSOR_SCALING
    cases = [
        ("x", x.astype(jnp.int32)),
        ("x", jnp.float32(1), ("x",)),
        ("x", None),
        ("x", jnp.ones((4, 0)), ("x",)),
        ("gamma", jnp.ones((32,)), ("gamma", "(64,)")),
        ("gamma", jnp.ones((64,), jnp.int32)),
        ("gamma", None),
        ("beta", jnp.zeros((3,)), ("beta", "(64,)")),
        ("beta", b, ("beta", "rmsnorm"), dict(norm_type="rmsnorm")),
        ("norm_type", "batchnorm"),
        ("norm_type", None),
        ("zero_centered_gamma", "yes"),
        ("zero_centered_gamma", 1),
        ("epsilon", -1.0),
        ("epsilon", "e"),
        ("epsilon", float("nan")),
        ("quantize", "fp8"),
        ("quantize", (SM.CURRENT_TENSOR_SCALING, jnp.int8, None), ("q_dtype",)),
        ("quantize", (D, jnp.float8_e4m3fn, None), ("scale",)),
        ("quantize", (D, jnp.float8_e4m3fn, jnp.float32(float("inf"))), ("scale", "finite")),
        ("quantize", (99, jnp.float8_e4m3fn, None), ("scaling_mode",)),
        ("quantize", (SM.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn, None, "diag"), ("layout",)),
    ]
    return _swap(dict(x=x, gamma=g, beta=b), cases, lowbit.layernorm)


def _activation_cases():
    jnp, lowbit, SM, x = _setup()
    cases = [
        ("x", x.astype(jnp.int32)),
        ("x", jnp.float32(1), ("x", "dimension")),
        ("x", None),
        ("x", x[:, :63], ("x", "even"), dict(activations=("silu", "linear"))),
        ("activations", "foo", ("activation",)),
        ("activations", ("gelu", "gelu"), ("activations",)),
        ("activations", 3, ("activations",)),
        ("activations", (), ("activations",)),
        ("activations", ("linear", "silu"), ("activation",)),
        ("activations", None, ("activations",)),
        ("quantize", "fp8"),
        ("quantize", (SM.CURRENT_TENSOR_SCALING, jnp.int8, None), ("q_dtype",)),
        ("quantize", (SM.DELAYED_TENSOR_SCALING, jnp.float8_e4m3fn, jnp.float32(0)), ("scale", "positive")),
        ("quantize", (SM.MXFP8_1D_SCALING, None, None), ("x", "32"), dict(x=x[:, :48])),
    ]
    return _swap(dict(x=x), cases, lowbit.activation)


def _softmax_cases():
    jnp, lowbit, SM, x = _setup()
    x4 = x.reshape(1, 1, 32, 64)
    cases = [
        ("x", x.astype(jnp.int32)),
        ("x", jnp.float32(1), ("x", "dimension")),
        ("x", None),
        ("scale_factor", "a"),
        ("scale_factor", jnp.float32(2.0)),
        ("scale_factor", float("inf")),
        ("scale_factor", float("nan")),
        ("scale_factor", True),
        ("scale_factor", None),
        ("mask", jnp.zeros((1, 1, 32, 64), bool), ("mask", "scaled_masked")),
        ("mask", jnp.zeros((1, 1, 3, 64), bool), ("mask", "broadcast"), dict(softmax_type="scaled_masked")),
        (
            "mask",
            jnp.zeros((1, 1, 32, 64), jnp.float32),
            ("mask", "boolean"),
            dict(softmax_type="scaled_masked"),
        ),
        ("mask", None, ("mask", "required"), dict(softmax_type="scaled_masked")),
        (
            "x",
            jnp.ones((1, 1, 1, 32, 64)),
            ("x", "rank"),
            dict(softmax_type="scaled_masked", mask=jnp.zeros((32, 64), bool)),
        ),
        ("softmax_type", "causal"),
        ("softmax_type", None),
        # (the causal type on non-square x is TransformerEngine's top-left fallback, not an error)
    ]
    return _swap(dict(x=x4), cases, lowbit.softmax)


CASES = {
    "quantize": _quantize_cases,
    "quantize_dbias": lambda: _quantize_cases(dbias=True),
    "dequantize": _dequantize_cases,
    "grouped_quantize": _grouped_quantize_cases,
    "grouped_dequantize": _grouped_dequantize_cases,
    "gemm": _gemm_cases,
    "dense": _dense_cases,
    "grouped_gemm": _grouped_gemm_cases,
    "layernorm": _layernorm_cases,
    "activation": _activation_cases,
    "softmax": _softmax_cases,
}


@pytest.fixture(scope="module")
def workers():
    return {g: subproc.start(__file__, g) for g in CASES}


@pytest.mark.parametrize("op", list(CASES))
def test_malformed_calls_raise_clear_errors(workers, op):
    subproc.finish(workers[op], timeout=120)


if __name__ == "__main__":
    subproc.main(CASES)
