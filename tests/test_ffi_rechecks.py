"""The C++ handlers re-check what Python validates: a dequantize FFI call made directly (past
lowbit's Python checks) with buffers too small for its output is refused by the handler with an
error naming the buffer, instead of reading past the buffer's end. Each case runs in a
subprocess (tests/subproc.py), so an out-of-bounds read that crashes fails the test, not pytest."""

from __future__ import annotations

import subproc


def _dequantize_cases():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lowbit import _native
    from lowbit.quantization.scaling_modes import ScalingMode, dtype_code

    r = c = 2048

    def call(data, scale, mode):
        return _native.ffi_call(
            "dequantize",
            jax.ShapeDtypeStruct((r, c), jnp.bfloat16),
            data,
            scale,
            _native.EMPTY_F32,
            mode=np.int32(int(mode)),
            q_dtype=np.int32(dtype_code(np.dtype(jnp.float8_e4m3fn))),
            flags=np.int32(0),
            rht_sign_mask=np.int32(0),
        )

    codes = jnp.ones((r, c), jnp.float8_e4m3fn)
    mx = ScalingMode.MXFP8_1D_SCALING
    return [
        ("mxfp8_one_scale", lambda: call(codes, jnp.full((1,), 127, jnp.uint8), mx), ("scale_inv has 1",)),
        (
            "mxfp8_half_data",
            lambda: call(codes[:, : c // 2], jnp.full((r * c // 32,), 127, jnp.uint8), mx),
            ("data has",),
        ),
        (
            "tensor_no_scale",
            lambda: call(codes, jnp.zeros((0,), jnp.float32), ScalingMode.CURRENT_TENSOR_SCALING),
            ("scale_inv has 0",),
        ),
    ]


CASES = {"dequantize": _dequantize_cases}


def test_dequantize_handler_refuses_short_buffers():
    subproc.run(__file__, "dequantize", timeout=300)


if __name__ == "__main__":
    import jax

    subproc.main(CASES, ok_errors=(jax.errors.JaxRuntimeError,))
