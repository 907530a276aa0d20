"""The C++ handlers re-check what Python validates: a dequantize FFI call made directly (past
lowbit's Python checks) with buffers too small for its output is refused by the handler with an
error naming the buffer, instead of reading past the buffer's end."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("on_cpu")

# Each case runs in a subprocess, so an out-of-bounds read that crashes fails the test, not pytest.
PROGRAM = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from lowbit import _native
    from lowbit.quantization.scaling_modes import ScalingMode, dtype_code
    case = {case!r}
    r = c = 2048
    mode = ScalingMode.MXFP8_1D_SCALING if case != "tensor" else ScalingMode.CURRENT_TENSOR_SCALING
    data = jnp.ones((r, c) if case != "data" else (r, c // 2), jnp.float8_e4m3fn)
    n_scales = {{"scale": 1, "data": r * c // 32, "tensor": 0}}[case]
    scale = jnp.full((n_scales,), 127, jnp.uint8) if case != "tensor" else jnp.zeros((0,), jnp.float32)
    try:
        out = _native.ffi_call(
            "dequantize", jax.ShapeDtypeStruct((r, c), jnp.bfloat16), data, scale, _native.EMPTY_F32,
            mode=np.int32(int(mode)), q_dtype=np.int32(dtype_code(np.dtype(jnp.float8_e4m3fn))),
            flags=np.int32(0), rht_sign_mask=np.int32(0))
        jax.block_until_ready(out)
        print("RESULT returned")
    except Exception as e:
        print("ERROR", str(e).splitlines()[0][:300])
    """
)


@pytest.mark.parametrize(
    "case, words",
    [("scale", "scale_inv has 1 elements"), ("data", "data has"), ("tensor", "scale_inv has 0 elements")],
)
def test_dequantize_handler_refuses_short_buffers(case, words):
    p = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(case=case)], capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("ERROR", "RESULT"))]
    assert p.returncode == 0 and lines, f"crashed (rc {p.returncode}): {p.stderr[-2000:]}"
    assert lines[-1].startswith("ERROR") and words in lines[-1], lines[-1]
