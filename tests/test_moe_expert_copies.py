"""lowbit.ops.fused.expert_copies_jnp: the jnp FP8 expert copies (the ones an optimizer update
writes) are byte for byte lowbit's cast kernel (quantize_experts) under DelayedScaling: every
bfloat16 value, every rounding tie of E4M3 and its neighbours, saturation, NaN, Inf,
float32 subnormals, ragged (G, K, N) padded to 16, float32 / bfloat16 / float16 masters, traced
scales that are not positive and finite; on the CPU and (``gpu``) against the CUDA cast kernel
with XLA's GPU code; bad arguments are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowbit
from lowbit.moe import apply_update_with_fp8_copies, delayed_expert_copies, quantize_experts
from lowbit.recipe import Format

E4M3 = lowbit.DelayedScaling(amax_history_len=4)
HYBRID = lowbit.DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID)  # weights E4M3 in both


def _state(recipe, scales):
    s = lowbit.init_grouped_delayed_state(recipe, len(scales))
    return dict(s, kernel_scale=jnp.asarray(scales, jnp.float32))


def _assert_same(w, recipe, state):
    """Both producers, jitted (the traced path, as in a train step): every array byte-equal."""
    a = jax.jit(lambda w, s: quantize_experts(w, recipe, s))(w, state)
    b = jax.jit(lambda w, s: delayed_expert_copies(w, recipe, s))(w, state)
    assert a.kn == b.kn
    for name in ("row", "row_s", "col", "col_s", "amax"):
        on_gpu = next(iter(getattr(b, name).devices())).platform == "gpu"
        u, v = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert u.shape == v.shape and u.dtype == v.dtype, name
        if name.endswith("_s") and on_gpu:
            # 1 / scale: the cast kernel's division and XLA's GPU code differ by one ulp at times
            # (H200, one expert in three shapes); the FP8 bytes must still be equal.
            np.testing.assert_array_max_ulp(u, v, maxulp=1)
            continue
        bad = np.flatnonzero(u.view(np.uint8) != v.view(np.uint8))
        assert bad.size == 0, (name, bad[:8], u.reshape(-1)[bad[:8] // u.itemsize])
    return a


def _fill(values, G, K, N):
    """(G, K, N) float32 holding ``values`` in every expert (zeros after them)."""
    flat = np.zeros(K * N, np.float32)
    flat[: values.size] = values
    return np.broadcast_to(flat.reshape(K, N), (G, K, N)).copy()


def test_every_bfloat16_value_at_several_scales(device):
    bits = np.arange(1 << 16, dtype=np.uint16)
    v = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    v = v[~np.isinf(v)]  # NaN stays (the amax ignores it); Inf below
    scales = [1.0, 2.0**-7, 3.3, 2.0**40, 1e-30]
    w = _fill(v, len(scales), 241, 273)
    for dtype in (jnp.float32, jnp.bfloat16):
        q = _assert_same(jnp.asarray(w).astype(dtype), E4M3, _state(E4M3, scales))
        assert np.isfinite(np.asarray(q.row_s)).all()
    _assert_same(jnp.asarray(w), HYBRID, _state(HYBRID, scales))


def test_rounding_ties_saturation_and_subnormals(device):
    recipe = E4M3
    q = np.dtype(recipe.q_dtype("kernel"))
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(q).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32: the ties
    top = grid[-1] + (grid[-1] - grid[-2]) / 2  # the tie past the max, then beyond it
    v = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), [top, 2 * top, 3e38]])
    v = np.concatenate([v, -v]).astype(np.float32)
    sub = np.array([1e-45, 1e-40, 1.17e-38, -1e-40, -1e-45], np.float32)  # float32 subnormals
    w = _fill(np.concatenate([v, sub]), 4, 37, 29)
    w[1] = w[1] * np.where(np.abs(w[1]) < 1e37, 16, 1).astype(np.float32)  # scale 1/16: the ties again
    _assert_same(jnp.asarray(w), recipe, _state(recipe, [1.0, 1 / 16, 2.0**100, 0.37]))


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 1, 1), jnp.float32),
        ((3, 20, 37), jnp.bfloat16),
        ((8, 17, 33), jnp.float16),
        ((5, 16, 48), jnp.float32),
    ],
)
def test_ragged_shapes_and_dtypes(device, shape, dtype):
    G = shape[0]
    rng = np.random.default_rng(G)
    mag = 10.0 ** rng.uniform(-6, 4, shape)  # wide enough to saturate at the larger scales
    w = jnp.asarray(rng.choice([-1.0, 1.0], shape) * mag, dtype)
    scales = 2.0 ** rng.uniform(-10, 10, G)
    q = _assert_same(w, E4M3, _state(E4M3, scales))
    assert q.row.shape == (G * -(-shape[1] // 16) * 16, -(-shape[2] // 16) * 16)
    assert q.col.shape == q.row.shape[::-1] and q.kn == shape[1:]


def test_nonfinite_weights_and_traced_bad_scales(device):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 20, 24)).astype(np.float32)
    w[1, 3, 4] = np.inf  # expert 1: amax Inf, decode scales NaN
    w[2, 0, 0], w[2, 5, 5] = np.nan, -np.nan  # expert 2: NaN codes, a finite amax
    w[3, 7, 1] = -np.inf
    q = _assert_same(jnp.asarray(w), E4M3, _state(E4M3, [2.0, 3.0, 4.0, 5.0, 6.0]))
    assert np.isnan(np.asarray(q.row_s)[[1, 3]]).all() and np.isfinite(np.asarray(q.row_s)[[0, 2, 4]]).all()
    # Traced scales of 0, < 0, NaN, Inf encode with 1 in both (the jit sees no values).
    _assert_same(jnp.asarray(w), E4M3, _state(E4M3, [0.0, -2.0, np.nan, np.inf, 8.0]))


def test_update_equals_quantize_experts_of_the_updated_master(device):
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((4, 24, 40)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((4, 24, 40)) * 1e-2, jnp.float32)
    state = _state(E4M3, [100.0, 200.0, 50.0, 448.0])
    new_w, q = jax.jit(lambda w, u, s: apply_update_with_fp8_copies(w, u, E4M3, s))(w, u, state)
    np.testing.assert_array_equal(np.asarray(new_w), np.asarray(w + u))
    ref = quantize_experts(new_w, E4M3, state)
    for name in ("row", "row_s", "col", "col_s", "amax"):
        np.testing.assert_array_equal(
            np.asarray(getattr(q, name)).view(np.uint8), np.asarray(getattr(ref, name)).view(np.uint8)
        )
    wb = w.astype(jnp.bfloat16)  # a bf16 master stays bf16
    assert apply_update_with_fp8_copies(wb, u, E4M3, state)[0].dtype == jnp.bfloat16


def test_bad_arguments_are_named():
    w = jnp.zeros((2, 8, 8), jnp.float32)
    state = lowbit.init_grouped_delayed_state(E4M3, 2)
    with pytest.raises(ValueError, match="recipe must be DelayedScaling.*Float8CurrentScaling"):
        delayed_expert_copies(w, lowbit.Float8CurrentScaling(), None)
    with pytest.raises(ValueError, match=r"w must be \(G, K, N\), got shape \(8, 8\)"):
        delayed_expert_copies(w[0], E4M3, state)
    with pytest.raises(ValueError, match="w must be float32, bfloat16 or float16, got int32"):
        delayed_expert_copies(w.astype(jnp.int32), E4M3, state)
    with pytest.raises(ValueError, match="DelayedScaling needs state="):
        delayed_expert_copies(w, E4M3, None)
    with pytest.raises(ValueError, match=r"state\['x_amax_history'\] must be float32 of shape \(4, 3\)"):
        delayed_expert_copies(jnp.zeros((3, 8, 8)), E4M3, state)
    with pytest.raises(ValueError, match=r"kernel_scale.*must be positive and finite"):
        delayed_expert_copies(w, E4M3, _state(E4M3, [1.0, 0.0]))
    with pytest.raises(ValueError, match=r"update must have w's shape \(2, 8, 8\), got \(2, 8, 9\)"):
        apply_update_with_fp8_copies(w, jnp.zeros((2, 8, 9)), E4M3, state)
    with pytest.raises(ValueError, match="apply_update_with_fp8_copies: recipe must be DelayedScaling"):
        apply_update_with_fp8_copies(w, w, lowbit.Float8BlockScaling(), None)
