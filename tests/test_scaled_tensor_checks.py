"""Tampered ScaledTensors: every op that takes one refuses it at trace time with an error naming
the field, instead of letting a kernel read past a buffer (issue 11, point 1).

The cases run in subprocesses (this file as a script, see tests/subproc.py): on old code some
of them crash the process.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import subproc  # noqa: E402


def _rep(qt, **kw):
    return dataclasses.replace(qt, **kw)


def _tensor_variants(jnp, lowbit, SM):
    x = jnp.linspace(-3, 3, 64 * 48, dtype=jnp.float32).reshape(64, 48)
    qt = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, layout="both")
    row = lowbit.quantize(x, SM.DELAYED_TENSOR_SCALING, scale=jnp.float32(2.0))
    return [
        ("scale_inv_2", _rep(qt, scale_inv=jnp.ones((2,), jnp.float32)), "rowwise", ("scale_inv", "(1,)")),
        (
            "scale_inv_bf16",
            _rep(qt, scale_inv=qt.scale_inv.astype(jnp.bfloat16)),
            "rowwise",
            ("scale_inv", "float32"),
        ),
        ("scale_inv_none", _rep(qt, scale_inv=None), "rowwise", ("scale_inv", "None")),
        ("data_e5m2", _rep(qt, data=qt.data.astype(jnp.float8_e5m2)), "rowwise", ("data", "float8_e4m3fn")),
        ("data_flat", _rep(qt, data=qt.data.reshape(-1)), "rowwise", ("data", "(64, 48)")),
        ("swapped", _rep(qt, data=qt.colwise_data, colwise_data=qt.data), "rowwise", ("data", "(64, 48)")),
        ("no_colwise", row, "colwise", ("colwise_data", "colwise")),
        (
            "cw_scale_small",
            _rep(qt, colwise_scale_inv=jnp.ones((0,), jnp.float32)),
            "colwise",
            ("colwise_scale_inv", "(1,)"),
        ),
        ("shape_lies", _rep(qt, shape=(64, 64)), "rowwise", ("data", "(64, 64)")),
        ("flatten_axis", _rep(qt, flatten_axis=5), "rowwise", ("flatten_axis",)),
        ("q_dtype_int8", _rep(qt, q_dtype=jnp.dtype("int8")), "rowwise", ("q_dtype",)),
    ]


def _mxfp8_variants(jnp, lowbit, SM):
    big = lowbit.quantize(jnp.ones((2048, 2048), jnp.float32), SM.MXFP8_1D_SCALING)
    x = jnp.linspace(-3, 3, 64 * 96, dtype=jnp.float32).reshape(64, 96)
    qt = lowbit.quantize(x, SM.MXFP8_1D_SCALING, layout="both")
    return [
        (
            "big_scale_1",
            _rep(big, scale_inv=big.scale_inv.reshape(-1)[:1]),
            "rowwise",
            ("scale_inv", "(2048, 64)", "float8_e8m0fnu"),
        ),
        (
            "scale_f32",
            _rep(qt, scale_inv=qt.scale_inv.astype(jnp.float32)),
            "rowwise",
            ("scale_inv", "float8_e8m0fnu"),
        ),
        ("scale_T", _rep(qt, scale_inv=qt.scale_inv.reshape(3, 64)), "rowwise", ("scale_inv", "(64, 3)")),
        ("scale_cw_for_row", _rep(qt, scale_inv=qt.colwise_scale_inv), "rowwise", ("scale_inv", "(64, 3)")),
        (
            "cw_scale_row",
            _rep(qt, colwise_scale_inv=qt.scale_inv),
            "colwise",
            ("colwise_scale_inv", "(96, 2)"),
        ),
        ("swapped", _rep(qt, data=qt.colwise_data, colwise_data=qt.data), "colwise", ("colwise_data",)),
        ("no_colwise", _rep(qt, colwise_data=None, colwise_scale_inv=None), "colwise", ("colwise_data",)),
        ("data_bf16", _rep(qt, data=qt.data.astype(jnp.bfloat16)), "rowwise", ("data", "float8_e4m3fn")),
    ]


def _nvfp4_variants(jnp, lowbit, SM):
    x = jnp.linspace(-3, 3, 32 * 64, dtype=jnp.float32).reshape(32, 64)
    qt = lowbit.quantize(x, SM.NVFP4_1D_SCALING, layout="both")
    return [
        ("gsi_none", _rep(qt, global_scale_inv=None), "rowwise", ("global_scale_inv", "(2,)")),
        (
            "gsi_1",
            _rep(qt, global_scale_inv=qt.global_scale_inv[:1]),
            "colwise",
            ("global_scale_inv", "(2,)"),
        ),
        (
            "scale_e8m0",
            _rep(qt, scale_inv=qt.scale_inv.astype(jnp.float8_e8m0fnu)),
            "rowwise",
            ("scale_inv", "float8_e4m3fn"),
        ),
        ("scale_small", _rep(qt, scale_inv=qt.scale_inv[:1]), "rowwise", ("scale_inv", "(32, 4)")),
        ("data_packed", _rep(qt, data=jnp.zeros((32, 32), jnp.uint8)), "rowwise", ("data", "float4_e2m1fn")),
        ("mode_mxfp8", _rep(qt, scaling_mode=SM.MXFP8_1D_SCALING), "rowwise", ("q_dtype",)),
    ]


def _op_cases(op_name, call):
    """Every tampered variant through one op: call(qt, layout) -> result."""

    def build():
        import jax.numpy as jnp

        import lowbit

        SM = lowbit.ScalingMode
        out = []
        for family in (_tensor_variants, _mxfp8_variants, _nvfp4_variants):
            for name, qt, layout, words in family(jnp, lowbit, SM):
                out.append(
                    (
                        f"{op_name}/{family.__name__[1:-9]}/{name}",
                        lambda qt=qt, layout=layout: call(qt, layout),
                        words,
                    )
                )
        return out

    return build


def _dequantize(qt, layout):
    import lowbit

    return lowbit.dequantize(qt, layout)


def _dequantize_jit(qt, layout):
    import jax

    import lowbit

    return jax.jit(lambda q: lowbit.dequantize(q, layout))(qt)


def _gemm(qt, layout):
    import jax.numpy as jnp

    import lowbit

    k = qt.cols if layout == "rowwise" else qt.rows
    return lowbit.gemm(
        jnp.ones((16, k), jnp.bfloat16) if qt.scaling_mode == 0 else qt, qt, a_layout=layout, b_layout=layout
    )


def _grouped_cases():
    import jax.numpy as jnp

    import lowbit

    SM = lowbit.ScalingMode
    x = jnp.linspace(-3, 3, 64 * 32, dtype=jnp.float32).reshape(64, 32)
    gs = jnp.array([20, 44], jnp.int32)
    qt = lowbit.grouped_quantize(x, gs, SM.CURRENT_TENSOR_SCALING, layout="both")
    mx = lowbit.grouped_quantize(x, gs, SM.MXFP8_1D_SCALING)
    gd = lowbit.grouped_dequantize
    return [
        ("g3_for_2", lambda: gd(qt, jnp.array([20, 20, 24], jnp.int32)), ("group_sizes", "3", "2")),
        ("scale_1", lambda: gd(_rep(qt, scale_inv=qt.scale_inv[:1]), gs), ("group_sizes", "scale_inv")),
        ("scale_2d", lambda: gd(_rep(qt, scale_inv=qt.scale_inv.reshape(1, 2)), gs), ("scale_inv", "(2,)")),
        (
            "cw_scale_none",
            lambda: gd(_rep(qt, colwise_scale_inv=None), gs, "colwise"),
            ("colwise_scale_inv",),
        ),
        ("no_colwise", lambda: gd(_rep(qt, colwise_data=None), gs, "colwise"), ("colwise_data",)),
        ("data_T", lambda: gd(_rep(qt, data=qt.colwise_data), gs), ("data", "(64, 32)")),
        ("gs_2d", lambda: gd(qt, gs.reshape(1, 2)), ("group_sizes",)),
        ("gs_float", lambda: gd(qt, gs.astype(jnp.float32)), ("group_sizes",)),
        (
            "mx_scale_1",
            lambda: gd(_rep(mx, scale_inv=mx.scale_inv.reshape(-1)[:1]), gs),
            ("scale_inv", "(64, 1)"),
        ),
        ("mx_colwise", lambda: gd(mx, gs, "colwise"), ("colwise_data",)),
        ("shape_3d", lambda: gd(_rep(qt, shape=(2, 32, 32)), gs), ("shape", "2-D")),
        ("nvfp4", lambda: gd(lowbit.quantize(x, SM.NVFP4_1D_SCALING), gs), ("scaling_mode",)),
    ]


CASES = {
    "dequantize": _op_cases("dequantize", _dequantize),
    "dequantize_jit": _op_cases("dequantize_jit", _dequantize_jit),
    "gemm": _op_cases("gemm", _gemm),
    "grouped_dequantize": _grouped_cases,
}


@pytest.fixture(scope="module")
def workers():
    # All groups at once: the subprocesses start in parallel and each test waits on its own.
    return {g: subproc.start(__file__, g) for g in CASES}


@pytest.mark.parametrize("group", list(CASES))
def test_tampered_scaled_tensor_is_refused(workers, group):
    subproc.finish(workers[group], timeout=180)


if __name__ == "__main__":
    subproc.main(CASES)
