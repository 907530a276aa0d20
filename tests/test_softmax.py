"""lowbit.softmax (scaled, scaled + masked, scaled + causal): forward and gradients against a
float64 NumPy reference written here; masks (broadcast, fully masked rows -> zeros); errors.
Each ``device`` test runs on the CPU and (marked ``gpu``) on the first CUDA device, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on, to_cpu
from test_norm import assert_close, f64, make

import lowbit

F32, BF16 = jnp.float32, jnp.bfloat16


def ref_softmax(x, scale, keep):
    """float64 softmax over the kept entries (keep: bool broadcastable to x); zero rows where
    nothing is kept."""
    v = np.where(keep, f64(x) * scale, -np.inf)
    m = v.max(-1, keepdims=True)
    e = np.where(keep & np.isfinite(m), np.exp(v - np.where(np.isfinite(m), m, 0.0)), 0.0)
    s = e.sum(-1, keepdims=True)
    return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def ref_vjp(y, dy, scale):
    """float64 softmax VJP from the saved output y (the backward's input, in x's dtype)."""
    y, dy = f64(y), f64(dy)
    return scale * y * (dy - (dy * y).sum(-1, keepdims=True))


def tol(dtype):
    return 2e-5 if np.dtype(dtype) == np.float32 else 2.0**-7


def check(device, rng, x, dtype, scale, keep, **kw):
    dy = make(rng, x.shape, dtype, 0.0, 1.0)

    def fn(x, dy, mask):
        y, vjp = jax.vjp(lambda x: lowbit.softmax(x, scale, mask=mask, **kw), x)
        return y, vjp(dy)[0]

    mask = kw.pop("mask", None)
    y, dx = to_cpu(run_on(device, fn, x, dy, mask))
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    assert_close(y, ref_softmax(x, scale, keep), tol(dtype), floor=1e-3, what="y")
    assert_close(dx, ref_vjp(y, dy, scale), 2 * tol(dtype), floor=2e-2, what="dx")
    return y, dx


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 8, 16), (5, 33), (40,)])
def test_scaled(device, rng, dtype, shape):
    x = make(rng, shape, dtype, 0.0, 3.0)
    check(device, rng, x, dtype, 0.7, np.ones(shape, bool), softmax_type="scaled")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mask_shape", [(2, 1, 12, 24), (12, 24), (2, 3, 1, 24)])
def test_masked(device, rng, dtype, mask_shape):
    shape = (2, 3, 12, 24)
    x = make(rng, shape, dtype, 0.0, 3.0)
    mask = rng.random(mask_shape) < 0.4
    if len(mask_shape) == 4 and mask_shape[2] > 1:
        mask[..., 0, :] = True  # fully masked query rows
    y, dx = check(
        device,
        rng,
        x,
        dtype,
        0.5,
        ~np.broadcast_to(mask, shape),
        softmax_type="scaled_masked",
        mask=jnp.asarray(mask),
    )
    masked = np.broadcast_to(mask, shape)
    assert np.all(y[masked] == 0) and np.all(dx[masked] == 0)
    if len(mask_shape) == 4 and mask_shape[2] > 1:
        assert np.all(y[..., 0, :] == 0) and not np.isnan(y).any()


def test_integer_mask_and_all_masked(rng):
    x = make(rng, (1, 2, 4, 8), F32)
    y = lowbit.softmax(x, 1.0, mask=jnp.ones((1, 1, 4, 8), jnp.int32), softmax_type="scaled_masked")
    assert np.all(np.asarray(y) == 0)
    g = jax.grad(
        lambda x: lowbit.softmax(x, 1.0, mask=jnp.ones((4, 8), bool), softmax_type="scaled_masked").sum()
    )(x)
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (5, 7, 7)])
def test_causal(device, rng, dtype, shape):
    x = make(rng, shape, dtype, 0.0, 3.0)
    S = shape[-1]
    keep = np.broadcast_to(np.tril(np.ones((S, S), bool)), shape)
    y, _ = check(device, rng, x, dtype, 0.125, keep, softmax_type="scaled_upper_triang_masked")
    assert np.all(y[..., 0, 1:] == 0) and np.allclose(y[..., 0, 0], 1.0)


def test_matches_jax_softmax(rng):
    x = make(rng, (3, 4, 16, 16), F32)
    np.testing.assert_allclose(
        np.asarray(lowbit.softmax(x, 0.3)), np.asarray(jax.nn.softmax(0.3 * x)), rtol=1e-5, atol=1e-7
    )


def test_errors(rng):
    x = make(rng, (2, 3, 8, 8), F32)
    with pytest.raises(ValueError, match="mask"):
        lowbit.softmax(x, 1.0, mask=jnp.ones((2, 3, 8, 5), bool), softmax_type="scaled_masked")
    with pytest.raises(ValueError, match="mask"):
        lowbit.softmax(x, 1.0, softmax_type="scaled_masked")
    with pytest.raises(ValueError, match="mask"):
        lowbit.softmax(x, 1.0, mask=jnp.ones((8, 8), bool))
    with pytest.raises(TypeError, match="mask"):
        lowbit.softmax(x, 1.0, mask=jnp.ones((8, 8), jnp.float32), softmax_type="scaled_masked")
    with pytest.raises(ValueError, match="Sq, Sk"):  # (non-square is TE's top-left fallback)
        lowbit.softmax(make(rng, (6,), F32), 1.0, softmax_type="scaled_upper_triang_masked")
    with pytest.raises(ValueError, match="softmax_type"):
        lowbit.softmax(x, 1.0, softmax_type="causal")
    with pytest.raises(TypeError, match="x"):
        lowbit.softmax(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(TypeError, match="scale_factor"):
        jax.jit(lambda x, s: lowbit.softmax(x, s))(x, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sk", [512, 3000])
def test_gpu_long_rows(gpu_device, rng, dtype, sk):
    shape = (2, 2, 16, sk)
    x = make(rng, shape, dtype, 0.0, 3.0)
    mask = rng.random((2, 1, 16, sk)) < 0.3
    check(
        gpu_device,
        rng,
        x,
        dtype,
        0.2,
        ~np.broadcast_to(mask, shape),
        softmax_type="scaled_masked",
        mask=jnp.asarray(mask),
    )


# --- NaN / Inf rows (tracker issue 11, point 3) ----------------------------------------------
# lowbit treats -inf entries as masked out. Then it is jax.nn.softmax with where= (kept and not
# -inf): NaN (or +inf) among those makes all of them NaN, the others stay 0, and a row with none
# left is zeros. jax.nn.softmax without where= differs only where -inf meets NaN: an all -inf row
# (0/0 = NaN there) and -inf entries of a NaN row.


def special_rows(rng, sk, dtype):
    nan, inf = np.nan, np.inf
    x = np.array(make(rng, (8, sk), F32, 0.0, 2.0))
    x[0, :] = nan  # all NaN
    x[1, 3] = nan  # one NaN
    x[2, :] = -inf  # all -inf -> zeros (documented choice)
    x[3, 5] = -inf  # one -inf: weight 0
    x[4, 1] = inf  # +inf: inf - inf = NaN row, as jax
    x[5, :] = -inf
    x[5, 7] = nan  # NaN among -inf: NaN, the -inf entries 0
    return jnp.asarray(x, dtype)


def expected(x, scale, keep):
    """jax.nn.softmax in float32 with where= the kept entries that are not -inf; 0 elsewhere."""
    x32 = jnp.asarray(x, F32) * scale
    keep = keep & (np.asarray(x32) != -np.inf)
    y = np.asarray(jax.nn.softmax(x32, axis=-1, where=jnp.asarray(keep)))
    return np.where(keep, y, 0.0)


def check_special(device, x, scale, keep, dtype, **kw):
    mask = kw.pop("mask", None)

    def fn(x, mask):
        y, vjp = jax.vjp(lambda x: lowbit.softmax(x, scale, mask=mask, **kw), x)
        return y, vjp(jnp.ones_like(y))[0]

    y, dx = to_cpu(run_on(device, fn, x, mask))
    y, dx = y.astype(np.float64), dx.astype(np.float64)
    want = expected(x, scale, keep)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))  # NaN exactly where jax has NaN
    ok = ~np.isnan(want)
    np.testing.assert_allclose(y[ok], want[ok], rtol=tol(dtype) * 4, atol=1e-6)
    # backward: NaN on the kept entries of a NaN row, finite everywhere else
    nan_row = np.isnan(want).any(-1, keepdims=True)
    assert np.all(np.isnan(dx[nan_row & keep & ~(np.asarray(x, np.float32) == -np.inf)]))
    assert np.all(np.isfinite(dx[~np.broadcast_to(nan_row, dx.shape)]))
    return y, dx


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sk", [16, 300])  # GPU: one-warp-per-row kernel and the generic one
def test_nan_inf_rows_scaled(device, rng, dtype, sk):
    x = special_rows(rng, sk, dtype)
    y, _ = check_special(device, x, 0.5, np.ones(x.shape, bool), dtype, softmax_type="scaled")
    assert np.all(np.isnan(y[0])) and np.all(np.isnan(y[1])) and np.all(y[2] == 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sk", [16, 300])
def test_nan_inf_rows_masked(device, rng, dtype, sk):
    x = np.array(special_rows(rng, sk, F32)).reshape(1, 1, 8, sk)
    mask = rng.random((1, 1, 8, sk)) < 0.3
    mask[..., 6, :] = True  # fully masked row
    x[..., 6, :] = np.nan  # ... of NaNs: still zeros (jax where= gives 0)
    mask[..., 7, :] = False
    mask[..., 7, 2] = True
    x[..., 7, 2] = np.nan  # a masked-out NaN is ignored
    mask[..., 1, 3] = False  # row 1's NaN is kept
    x = jnp.asarray(x, dtype)
    y, _ = check_special(device, x, 0.5, ~mask, dtype, softmax_type="scaled_masked", mask=jnp.asarray(mask))
    assert np.all(y[..., 6, :] == 0) and np.all(np.isfinite(y[..., 7, :]))
    assert np.all(np.isnan(y[..., 1, :][~mask[..., 1, :]])) and np.all(y[..., 1, :][mask[..., 1, :]] == 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("s", [16, 40])
def test_nan_causal(device, rng, dtype, s):
    x = np.array(make(rng, (2, s, s), F32, 0.0, 2.0))
    x[0, :, 0] = np.nan  # query 0 sees only this key: NaN row; every row sees key 0
    x[1, 3, 5] = np.nan  # above the diagonal for query 3: masked out, harmless
    x = jnp.asarray(x, dtype)
    keep = np.broadcast_to(np.tril(np.ones((s, s), bool)), x.shape)
    y, _ = check_special(device, x, 0.125, keep, dtype, softmax_type="scaled_upper_triang_masked")
    assert np.isnan(y[0, 0, 0]) and np.all(y[0, 0, 1:] == 0) and np.all(np.isfinite(y[1]))


def test_nan_scale_factor(rng):
    # scale_factor=nan makes every entry NaN: NaN rows (or a ValueError from argument checks).
    x = make(rng, (4, 16), F32)
    try:
        y = lowbit.softmax(x, float("nan"))
    except ValueError:
        return
    assert np.all(np.isnan(np.asarray(y)))
