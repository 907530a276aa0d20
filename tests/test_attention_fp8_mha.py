"""The recipes' ``fp8_mha=True`` (issue 26): the fused QKV projection, FP8 attention and the
output projection as one op (lowbit.ops.fused.mha_fp8), FP8 handed across both attention
boundaries, against a float64 reference of the same block and against the fp8_dpa composition
(the same modules with FP8 inside attention only). Emulation on the CPU; on a GPU the attention
is cuDNN's FP8 kernel (``gpu`` marker).

Bounds: the block's error is the sum of the FP8 GEMMs' and the attention's (test_attention_fp8's
FWD / BWD for the attention alone); fp8_mha rounds o, dq, dk, dv once where fp8_dpa rounds them
twice, so its error must stay within 1.25x fp8_dpa's (not above it by more than noise), and both
above a floor that shows FP8 is in effect.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_fp8 import _float8_round_trips

import lowbit
from lowbit.flax import MultiHeadAttention
from lowbit.ops.attention import fp8_scales as fs
from lowbit.ops.fused.dense_norm import NormInput
from lowbit.ops.fused.mha_fp8 import mha_fp8
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = [
    pytest.param(lambda **kw: DelayedScaling(amax_history_len=4, **kw), id="delayed"),
    pytest.param(lambda **kw: Float8CurrentScaling(**kw), id="current"),
]
B, S, HID, H, D = 2, 32, 64, 4, 16


def _params(seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((B, S, HID)), jnp.bfloat16)
    wq = jnp.asarray(r.standard_normal((HID, 3, H * D)) / 8, jnp.float32)
    bq = jnp.asarray(r.standard_normal((3, H * D)) / 10, jnp.float32)
    wo = jnp.asarray(r.standard_normal((H * D, HID)) / 8, jnp.float32)
    gamma = jnp.asarray(1 + r.standard_normal(HID) / 10, jnp.float32)
    dy = jnp.asarray(r.standard_normal((B, S, HID)), jnp.float32)
    return x, wq, bq, wo, gamma, dy


def _f64(x, wq, bq, wo, gamma, dy, causal, keep=None, rate=0.0):
    """float64 output and gradients (x, wq, bq, wo) of LayerNorm -> QKV -> attention -> out,
    with the dropout mask ``keep`` (b, h, sq, sk) when given."""
    with jax.enable_x64():
        args = [jnp.asarray(np.asarray(a, np.float32), jnp.float64) for a in (x, wq, bq, wo, gamma, dy)]

        def f(x, wq, bq, wo):
            mu = x.mean(-1, keepdims=True)
            n = (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * args[4]
            y = jnp.einsum("bsk,kjf->bsjf", n, wq) + bq
            q, k, v = (y[:, :, i].reshape(B, S, H, D) for i in range(3))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
            if causal:
                s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
            p = jax.nn.softmax(s, -1)
            if keep is not None:
                p = jnp.where(keep, p / (1 - rate), 0.0)
            o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, S, H * D)
            return o @ wo

        out, vjp = jax.vjp(f, *args[:4])
        return np.asarray(out), [np.asarray(g) for g in vjp(args[5])]


def _states(recipe):
    if not isinstance(recipe, DelayedScaling):
        return {}
    return dict(
        qkv_state=lowbit.init_delayed_state(recipe),
        out_state=lowbit.init_delayed_state(recipe),
        attention_state=fs.init_state(recipe),
    )


def _mha_step(recipe, x, wq, bq, wo, gamma, dy, causal, states, impl="emulate", **kw):
    f = lambda x, wq, bq, wo, st: mha_fp8(  # noqa: E731
        x, wq, bq, wo, None, recipe=recipe, heads=H, norm=NormInput(gamma), causal=causal,
        scale=1 / np.sqrt(D), implementation=impl, **st, **kw,
    )  # fmt: skip
    out, vjp = jax.vjp(f, x, wq, bq, wo, states)
    *grads, nxt = vjp(dy.astype(out.dtype))
    return out, grads, nxt


def _dpa_step(recipe, x, wq, bq, wo, gamma, dy, causal, states, impl="emulate", **kw):
    """The fp8_dpa composition: split_dense (the fused QKV path), fp8_attention, dense."""
    from lowbit.ops.attention.fp8 import fp8_attention
    from lowbit.ops.fused.dense_split import split_dense

    def f(x, wq, bq, wo, st):
        q, k, v = split_dense(
            x, wq, bq, recipe=recipe, state=st.get("qkv_state"), norm=NormInput(gamma), out_dtype=x.dtype
        )[0]
        q, k, v = (t.reshape(B, S, H, D) for t in (q, k, v))
        o = fp8_attention(
            q, k, v, recipe=recipe, state=st.get("attention_state"), causal=causal, implementation=impl, **kw
        )
        return lowbit.dense(o.reshape(B, S, H * D), wo, recipe=recipe, state=st.get("out_state"))

    out, vjp = jax.vjp(f, x, wq, bq, wo, states)
    *grads, nxt = vjp(dy.astype(out.dtype))
    return out, grads, nxt


def _errs(out, grads, want_o, want_g):
    rel = lambda a, w: float(np.linalg.norm(np.asarray(a, np.float64) - w) / np.linalg.norm(w))  # noqa: E731
    return [rel(out, want_o)] + [rel(g, w) for g, w in zip(grads, want_g)]


def _check_op(make, causal, impl, args=None, keep=None, floor=2.0**-8, **kw):
    """mha_fp8's and fp8_dpa's errors against float64 (``kw``: dropout); returns mha_fp8's
    errors and gradients and the float64 gradients."""
    recipe = make(fp8_mha=True)
    args = _params() if args is None else args
    want_o, want_g = _f64(*args, causal, keep, kw.get("dropout_rate", 0.0))
    errs, got = {}, {}
    for name, step in (("mha", _mha_step), ("dpa", _dpa_step)):
        st = _states(recipe)
        if st:  # DelayedScaling: one step first, so the scales come from these tensors' amaxes
            st = step(recipe, *args, causal, st, impl, **kw)[2]
        out, grads, _ = step(recipe, *args, causal, st, impl, **kw)
        errs[name], got[name] = _errs(out, grads, want_o, want_g), grads
    for m, d in zip(errs["mha"], errs["dpa"]):
        assert floor < m < 0.5, errs  # FP8 in effect, within the FP8 bounds of the block
        assert m < 1.25 * d + 2.0**-8, errs  # never worse than fp8_dpa beyond noise
    return errs["mha"], got["mha"], want_g


@pytest.mark.parametrize("make", RECIPES)
@pytest.mark.parametrize("causal", [False, True])
def test_op_against_float64_and_fp8_dpa(make, causal):
    _check_op(make, causal, "emulate")


def _with_common(args, size, through):
    """``args`` with ``size`` times a vector shared by every position added to k and v (through
    the QKV bias) or to x (then to q, k, v and the QKV input): the component trained keys and
    values carry."""
    x, wq, bq, wo, gamma, dy = args
    r = np.random.default_rng(9)
    if through == "x":
        return (x.astype(jnp.float32) + size * r.standard_normal(HID)).astype(x.dtype), wq, bq, wo, gamma, dy
    return x, wq, bq.at[1:].add(size * r.standard_normal((2, H * D))), wo, gamma, dy


def _rel(a, w):
    return float(np.linalg.norm(np.asarray(a, np.float64) - w) / np.linalg.norm(w))


def _check_common_kv(make, impl):
    """The op's errors with a 6-sigma common k/v component within 1.25x those without it."""
    plain = _check_op(make, True, impl)[0]
    common = _check_op(make, True, impl, _with_common(_params(), 6.0, "bias"))[0]
    for e, e0 in zip(common, plain):
        assert e < 1.25 * e0 + 2.0**-8, (common, plain)


@pytest.mark.parametrize("make", RECIPES)
def test_common_key_value_component_keeps_the_bounds(make):
    """A component shared by all keys and values (6 sigma, through the QKV bias) shifts exact
    attention's output and leaves its gradients unchanged: the op's output and gradients (dx,
    dw_qkv, db_qkv, dw_out) stay within the bounds they have without it. Without centering k
    and v before their quantization, dS's rounded row sums carry k's component into dq (dx 2.6x
    its norm off)."""
    _check_common_kv(make, "emulate")


@pytest.mark.parametrize("make", RECIPES)
def test_common_input_component_keeps_the_gradient_sums(make):
    """A component shared by every position of x (6 sigma) reaches q, k, v and the QKV input.
    The centering's rank-one gradient terms carry k's exact zero sum over the sequence and v's
    exact sum_s(do) into dx (its per-batch mean: 0.3x dx's error with the term, 0.9x without)
    and into dw_qkv (sum_s x times them: v's block 0.1x its error without the common component
    with the term, 0.7x without; k's block 2x with, 4.5x without). db_qkv's error falls below
    the FP8 floor: the common component dominates its norm."""
    _, (_, dw0, *_), want0 = _check_op(make, True, "emulate")
    errs, (dx, dw, *_), want = _check_op(make, True, "emulate", _with_common(_params(), 6.0, "x"), floor=0.0)
    assert _rel(np.asarray(dx, np.float64).mean(1), want[0].mean(1)) < 0.5 * errs[1], errs
    for i, bound in ((1, 3.0), (2, 0.3)):  # dw_qkv's k and v blocks against their plain errors
        err, err0 = _rel(dw[:, i], want[1][:, i]), _rel(dw0[:, i], want0[1][:, i])
        assert err < bound * err0, (i, err, err0)


@pytest.mark.gpu
@pytest.mark.parametrize("make", RECIPES)
def test_common_key_value_component_on_cudnn(gpu_device, make, monkeypatch):
    """The centering on the op's cuDNN path: with a 6-sigma common k/v component, the same
    bounds as without it (shapes cuDNN's FP8 backward takes)."""
    for name, value in dict(S=64, HID=256, H=2, D=128).items():
        monkeypatch.setitem(globals(), name, value)
    _check_common_kv(make, "cudnn")


@pytest.mark.parametrize("make", RECIPES)
def test_dropout_against_float64_and_fp8_dpa(make):
    """Under dropout v is not centered (dropped rows do not sum to one), k still is: with a
    common component in k and v, against float64 attention with the emulation's mask
    ``bernoulli(rng, 1 - rate, (b, h, 1, sq, sk))``, within fp8_dpa's errors."""
    rng, rate = jax.random.PRNGKey(5), 0.2
    keep = np.asarray(jax.random.bernoulli(rng, 1 - rate, (B, H, 1, S, S)))[:, :, 0]
    _check_op(make, True, "emulate", _with_common(_params(), 6.0, "bias"), keep, dropout_rate=rate, rng=rng)


@pytest.mark.gpu
@pytest.mark.parametrize("make", RECIPES)
@pytest.mark.parametrize("causal", [False, True])
def test_op_on_cudnn_against_float64_and_fp8_dpa(gpu_device, make, causal, monkeypatch):
    """The op's cuDNN path (o8 from the kernel's residuals, dQ/dK/dV re-encoded) on the GPU,
    held to the same bounds as the emulation; "cudnn" raises where the kernel cannot run, so
    the shapes are ones cuDNN's FP8 backward takes (head_dim 128)."""
    for name, value in dict(S=64, HID=256, H=2, D=128).items():
        monkeypatch.setitem(globals(), name, value)
    _check_op(make, causal, "cudnn")


@pytest.mark.parametrize("make", RECIPES)
def test_emulation_survives_the_gpu_pipeline(make):
    """No value converted to FP8 in the step is converted back to a wider float (XLA's GPU
    pipeline deletes such pairs: the value would not be rounded there), as in fp8_attention."""
    recipe = make(fp8_mha=True)
    args = _params()
    step = lambda *a: _mha_step(recipe, *a, True, _states(recipe))[:2]  # noqa: E731
    assert _float8_round_trips(jax.make_jaxpr(step)(*args).jaxpr) == 0


def test_delayed_states_advance():
    recipe = DelayedScaling(amax_history_len=4, fp8_mha=True)
    args = _params()
    _, _, nxt = _mha_step(recipe, *args, True, _states(recipe))
    x, *_ = args
    assert float(nxt["attention_state"]["dq_amax_history"][0]) > 0
    assert float(nxt["attention_state"]["o_amax_history"][0]) > 0
    # the handed-over roles record the handed tensor's amax
    assert float(nxt["out_state"]["x_amax_history"][0]) == float(nxt["attention_state"]["o_amax_history"][0])
    assert float(nxt["qkv_state"]["grad_amax_history"][0]) == max(
        float(nxt["attention_state"][f"{r}_amax_history"][0]) for r in ("dq", "dk", "dv")
    )


def test_bad_arguments_name_what_is_wrong():
    x, wq, bq, wo, gamma, _ = _params()
    r = Float8CurrentScaling(fp8_mha=True)
    with pytest.raises(ValueError, match="w_qkv"):
        mha_fp8(x, wq[:, :2], bq, wo, None, recipe=r, heads=H, scale=1.0)
    with pytest.raises(ValueError, match="w_out"):
        mha_fp8(x, wq, bq, wo[:8], None, recipe=r, heads=H, scale=1.0)
    with pytest.raises(ValueError, match="b_qkv"):
        mha_fp8(x, wq, bq[:2], wo, None, recipe=r, heads=H, scale=1.0)
    with pytest.raises(ValueError, match="rng"):
        mha_fp8(x, wq, bq, wo, None, recipe=r, heads=H, scale=1.0, dropout_rate=0.1)
    with pytest.raises(NotImplementedError, match="fp8_mha"):
        MXFP8BlockScaling(fp8_mha=True)


def _mha_module(**kw):
    return MultiHeadAttention(head_dim=D, num_attention_heads=H, attn_mask_type="causal", **kw)


@pytest.mark.parametrize("make", RECIPES)
def test_module_matches_fp8_dpa_and_keeps_the_tree(make):
    """Same parameters under fp8_dpa and fp8_mha: outputs and gradients close, the fp8_mha path
    taken (no fallback warning), the same params and dense states."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, S, HID)), jnp.float32)
    mha = _mha_module()
    out = {}
    for flag in ("fp8_dpa", "fp8_mha"):
        recipe = make(**{flag: True})
        with lowbit.autocast(recipe=recipe, enabled=True), warnings.catch_warnings():
            warnings.simplefilter("error")
            v = mha.init(jax.random.PRNGKey(0), x)

            def loss(p, x, v=v):
                y = mha.apply({**v, "params": p}, x)[0]
                return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

            (_, y), g = jax.value_and_grad(loss, has_aux=True)(v["params"], x)
        out[flag] = (y, g, v)
    (y_d, g_d, v_d), (y_m, g_m, v_m) = out["fp8_dpa"], out["fp8_mha"]
    assert jax.tree.structure(v_d["params"]) == jax.tree.structure(v_m["params"])
    for a, b in zip(jax.tree.leaves((y_d, g_d)), jax.tree.leaves((y_m, g_m))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 0.25 * np.linalg.norm(a)
    if isinstance(make(), DelayedScaling):
        ow = v_m["_overwrite_with_gradient"]
        assert "s_amax_history" in ow and "grad_amax_history" in ow["qkv"]["dense_op"]


def test_module_falls_back_with_a_warning():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, S, HID)), jnp.float32)
    mha = _mha_module(enable_rotary_pos_emb=True)
    with lowbit.autocast(recipe=Float8CurrentScaling(fp8_mha=True), enabled=True):
        with pytest.warns(UserWarning, match="rotary"):
            v = mha.init(jax.random.PRNGKey(0), x)
    assert dataclasses.is_dataclass(Float8CurrentScaling(fp8_mha=True))
    assert "qkv" in v["params"]
