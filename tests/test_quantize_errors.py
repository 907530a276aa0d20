"""Bad inputs raise TypeError / ValueError whose message names the argument and what is expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit

SM = lowbit.ScalingMode
pytestmark = pytest.mark.usefixtures("on_cpu")  # argument checks: device-independent
E4M3, E5M2, E2M1 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn


@pytest.fixture
def x(request):
    import zlib

    rng = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
    return jnp.asarray(rng.standard_normal((64, 64)).astype(np.float32))


def _raises(exc, *words):
    """pytest.raises whose message must contain every word (case-insensitive)."""

    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *a):
            out = self.cm.__exit__(*a)
            msg = str(self.info.value).lower()
            for w in words:
                assert w.lower() in msg, f"message {str(self.info.value)!r} does not mention {w!r}"
            return out

    return _Ctx()


# --- x -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.float8_e4m3fn])
def test_x_dtype(dtype):
    bad = jnp.ones((32, 32), dtype)
    with _raises(TypeError, "x", "float32", "bfloat16", "float16", np.dtype(dtype).name):
        lowbit.quantize(bad, SM.CURRENT_TENSOR_SCALING)
    with _raises(TypeError, "x", "float32"):
        lowbit.quantize_dbias(bad, SM.CURRENT_TENSOR_SCALING)
    with _raises(TypeError, "x", "float32"):
        lowbit.grouped_quantize(bad, jnp.array([32], jnp.int32), SM.CURRENT_TENSOR_SCALING)


def test_x_scalar():
    with _raises(ValueError, "dimension"):
        lowbit.quantize(jnp.float32(1.0), SM.CURRENT_TENSOR_SCALING)


@pytest.mark.parametrize("axis", [3, -4])
def test_flatten_axis_out_of_range(axis):
    with _raises(ValueError, "flatten_axis", str(axis)):
        lowbit.quantize(jnp.ones((2, 4, 32)), SM.CURRENT_TENSOR_SCALING, flatten_axis=axis)


# --- scaling_mode / q_dtype ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [8, -1, "MXFP8", None, 3.5])
def test_bad_scaling_mode(x, mode):
    with _raises(ValueError, "scaling_mode", "MXFP8_1D_SCALING"):
        lowbit.quantize(x, mode)


@pytest.mark.parametrize(
    "mode,q_dtype",
    [
        (SM.MXFP8_1D_SCALING, E2M1),
        (SM.CURRENT_TENSOR_SCALING, E2M1),
        (SM.DELAYED_TENSOR_SCALING, jnp.bfloat16),
        (SM.CURRENT_TENSOR_SCALING, jnp.float8_e8m0fnu),
        (SM.NVFP4_1D_SCALING, E4M3),
        (SM.NVFP4_2D_SCALING, E5M2),
    ],
)
def test_q_dtype_mismatch(x, mode, q_dtype):
    kw = dict(scale=jnp.ones((1,), jnp.float32)) if mode == SM.DELAYED_TENSOR_SCALING else {}
    want = "float4_e2m1fn" if mode in (SM.NVFP4_1D_SCALING, SM.NVFP4_2D_SCALING) else "float8_e4m3fn"
    with _raises(TypeError, "q_dtype", want, np.dtype(q_dtype).name, mode.name):
        lowbit.quantize(x, mode, q_dtype, **kw)


# --- block multiples -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,layout", [((32, 48), "rowwise"), ((32, 100), "both"), ((4, 2, 24), "rowwise")]
)
def test_mxfp8_contraction_axis_multiple_of_32(shape, layout):
    x = jnp.ones(shape, jnp.float32)
    cols = shape[-1]
    with _raises(ValueError, "contraction axis", "32", str(cols), "MXFP8_1D_SCALING"):
        lowbit.quantize(x, SM.MXFP8_1D_SCALING, layout=layout)


def test_mxfp8_colwise_rows_multiple_of_32():
    with _raises(ValueError, "32", "48", "colwise"):
        lowbit.quantize(jnp.ones((48, 64)), SM.MXFP8_1D_SCALING, layout="colwise")
    # rowwise of the same shape is fine
    lowbit.quantize(jnp.ones((48, 64)), SM.MXFP8_1D_SCALING, layout="rowwise")


@pytest.mark.parametrize(
    "mode,shape,layout",
    [
        (SM.NVFP4_1D_SCALING, (16, 24), "rowwise"),
        (SM.NVFP4_1D_SCALING, (24, 32), "colwise"),
        (SM.NVFP4_2D_SCALING, (8, 32), "rowwise"),
        (SM.NVFP4_2D_SCALING, (32, 40), "both"),
    ],
)
def test_nvfp4_multiple_of_16(mode, shape, layout):
    with _raises(ValueError, "16", mode.name):
        lowbit.quantize(jnp.ones(shape), mode, layout=layout)


def test_flatten_axis_changes_the_contraction_axis():
    x = jnp.ones((64, 2, 24))
    with _raises(ValueError, "contraction axis", "32", "48"):
        lowbit.quantize(x, SM.MXFP8_1D_SCALING, flatten_axis=1)
    lowbit.quantize(jnp.ones((2, 24, 64)), SM.MXFP8_1D_SCALING, flatten_axis=2)


# --- scale ----------------------------------------------------------------------------------------
def test_delayed_needs_scale(x):
    with _raises(ValueError, "scale", "DELAYED_TENSOR_SCALING", "float32"):
        lowbit.quantize(x, SM.DELAYED_TENSOR_SCALING)


@pytest.mark.parametrize(
    "scale", [jnp.ones((2,), jnp.float32), jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.bfloat16)]
)
def test_delayed_bad_scale(x, scale):
    with _raises(TypeError, "scale", "float32"):
        lowbit.quantize(x, SM.DELAYED_TENSOR_SCALING, scale=scale)


@pytest.mark.parametrize("mode", [SM.CURRENT_TENSOR_SCALING, SM.MXFP8_1D_SCALING, SM.NVFP4_1D_SCALING])
def test_scale_only_for_delayed(x, mode):
    with _raises(ValueError, "scale", "DELAYED_TENSOR_SCALING"):
        lowbit.quantize(x, mode, scale=jnp.ones((1,), jnp.float32))


# --- rng_key / rht ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode", [SM.DELAYED_TENSOR_SCALING, SM.CURRENT_TENSOR_SCALING, SM.MXFP8_1D_SCALING, SM.NO_SCALING]
)
def test_rng_key_with_fp8_mode(x, mode):
    kw = dict(scale=jnp.ones((1,), jnp.float32)) if mode == SM.DELAYED_TENSOR_SCALING else {}
    with _raises(ValueError, "rng_key", "NVFP4", mode.name):
        lowbit.quantize(x, mode, rng_key=jax.random.key(0), **kw)


@pytest.mark.parametrize("mode", [SM.NVFP4_2D_SCALING, SM.MXFP8_1D_SCALING, SM.CURRENT_TENSOR_SCALING])
def test_rht_needs_nvfp4_1d(x, mode):
    with _raises(ValueError, "rht", "NVFP4_1D_SCALING", mode.name):
        lowbit.quantize(x, mode, rht=True, layout="both")


# --- layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["row", "COLWISE", "", None, "rowwise+colwise"])
def test_bad_layout(x, layout):
    with _raises(ValueError, "layout", "rowwise", "colwise", "both"):
        lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, layout=layout)


# --- dequantize ------------------------------------------------------------------------------------
def test_dequantize_errors(x):
    qt = lowbit.quantize(x, SM.CURRENT_TENSOR_SCALING, layout="rowwise")
    with _raises(TypeError, "qt", "ScaledTensor"):
        lowbit.dequantize(x)
    with _raises(ValueError, "layout", "rowwise", "colwise"):
        lowbit.dequantize(qt, "both")
    with _raises(ValueError, "colwise"):
        lowbit.dequantize(qt, "colwise")
    with _raises(TypeError, "dtype", "float32"):
        lowbit.dequantize(qt, dtype=jnp.int32)


# --- grouped ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes",
    [
        jnp.array([32, 32], jnp.float32),
        jnp.array([32, 32], jnp.uint32),
        jnp.array([32, 32], jnp.int16),
        jnp.array([[32, 32]], jnp.int32),
    ],
    ids=["float32", "uint32", "int16", "2d"],
)
def test_group_sizes_dtype(x, sizes):
    with _raises(TypeError, "group_sizes", "int32", "(G,)"):
        lowbit.grouped_quantize(x, sizes, SM.CURRENT_TENSOR_SCALING)


def test_grouped_errors(x):
    gs = jnp.array([32, 32], jnp.int32)
    with _raises(ValueError, "x", "2-D"):
        lowbit.grouped_quantize(x.reshape(4, 16, 64), gs, SM.CURRENT_TENSOR_SCALING)
    with _raises(ValueError, "group_sizes", "at least one"):
        lowbit.grouped_quantize(x, jnp.zeros((0,), jnp.int32), SM.CURRENT_TENSOR_SCALING)
    with _raises(ValueError, "NVFP4_1D_SCALING"):
        lowbit.grouped_quantize(x, gs, SM.NVFP4_1D_SCALING)
    with _raises(ValueError, "MXFP8", "rowwise"):
        lowbit.grouped_quantize(x, gs, SM.MXFP8_1D_SCALING, layout="both")
    with _raises(ValueError, "contraction axis", "32", "48"):
        lowbit.grouped_quantize(jnp.ones((64, 48)), gs, SM.MXFP8_1D_SCALING)
    with _raises(ValueError, "scale", "(G,)"):
        lowbit.grouped_quantize(x, gs, SM.DELAYED_TENSOR_SCALING)
    with _raises(TypeError, "scale", "float32", "(2,)"):
        lowbit.grouped_quantize(x, gs, SM.DELAYED_TENSOR_SCALING, scale=jnp.ones((1,), jnp.float32))
    with _raises(ValueError, "layout"):
        lowbit.grouped_quantize(x, gs, SM.CURRENT_TENSOR_SCALING, layout="cols")
    with _raises(ValueError, "scaling_mode"):
        lowbit.grouped_quantize(x, gs, 42)
    with _raises(TypeError, "q_dtype"):
        lowbit.grouped_quantize(x, gs, SM.CURRENT_TENSOR_SCALING, E2M1)


def test_errors_inside_jit(x):
    """Argument checks fire at trace time under jit too."""
    with _raises(ValueError, "contraction axis", "32"):
        jax.jit(lambda a: lowbit.quantize(a, SM.MXFP8_1D_SCALING))(jnp.ones((32, 48)))
    with _raises(ValueError, "rng_key"):
        jax.jit(lambda a, k: lowbit.quantize(a, SM.MXFP8_1D_SCALING, rng_key=k))(x, jax.random.key(1))
