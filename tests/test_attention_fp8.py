"""FP8 attention (``fp8_dpa=True``) against float64: the CPU emulation of cuDNN's FP8 kernel
(always) and cuDNN's kernel through lowbit's handler (``gpu`` marker), forward and backward,
under DelayedScaling and Float8CurrentScaling; the DelayedScaling state; the Flax modules.

The bounds (relative Frobenius error against float64). A rounding to a format with ``m``
mantissa bits moves each value by a uniform relative error of at most ``u = 2^-(m+1)``, RMS
``u / sqrt(3)`` (E4M3 ``u = 2^-4``, E5M2 ``u_b = 2^-3``). Taking the roundings as independent and
adding their first-order contributions linearly (an upper bound of their root-sum-square):

* forward ``o = softmax(scale q k^T) v``: q and k move the logits by RMS ``sqrt(2/3) u`` (for
  ``scale = 1/sqrt(d)``, unit-variance inputs), which moves ``o`` by at most that relative to it;
  v, the probabilities and o itself each ``u / sqrt(3)``. Sum ``(sqrt(2/3) + 3 / sqrt(3)) u =
  2.55 u = 0.16``; the bound is ``FWD = 3.2 u = 0.2`` (bf16 inputs and output add ``3 * 2^-9``).
* backward: dq, dk and dv each see do, dp (the softmax input's gradient) and their own
  rounding in the backward format (``3 u_b / sqrt(3)``), and q, k, v, s, o in E4M3 (the logits'
  ``sqrt(2/3) u`` and four ``u / sqrt(3)``): ``1.73 u_b + 3.1 u = 0.41``; the bound is
  ``BWD = 0.45``.

A lower bound checks that FP8 is really in effect: every error exceeds ``u / 8``, while BF16
attention's is below ``2^-7``.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.flax import DotProductAttention, MultiHeadAttention, TransformerLayer
from lowbit.ops.attention import fp8_scales as fs
from lowbit.ops.attention.fp8 import fp8_attention
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

U, U_B = 2.0**-4, 2.0**-3
FWD, BWD = 3.2 * U, 0.45
FLOOR = U / 8

RECIPES = [
    pytest.param(lambda: DelayedScaling(fp8_dpa=True, amax_history_len=4), id="delayed"),
    pytest.param(lambda: Float8CurrentScaling(fp8_dpa=True), id="current"),
]


def _inputs(b=2, s=64, h=4, g=2, d=32, seed=0, dtype=jnp.bfloat16):
    r = np.random.default_rng(seed)
    shapes = ((b, s, h, d), (b, s, g, d), (b, s, g, d), (b, s, h, d))
    return tuple(jnp.asarray(r.standard_normal(x), dtype) for x in shapes)


def _f64(q, k, v, do, causal, keep=None, rate=0.0):
    """float64 output and (dq, dk, dv) of attention with the dropout mask ``keep`` (b, h, sq, sk)."""
    with jax.enable_x64():
        q, k, v, do = (jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (q, k, v, do))
        h, g, d = q.shape[2], k.shape[2], q.shape[3]

        def f(q, k, v):
            kk, vv = jnp.repeat(k, h // g, 2), jnp.repeat(v, h // g, 2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
            if causal:
                s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
            p = jax.nn.softmax(s, -1)
            if keep is not None:
                p = jnp.where(keep, p / (1 - rate), 0.0)
            return jnp.einsum("bhqk,bkhd->bqhd", p, vv)

        o, vjp = jax.vjp(f, q, k, v)
        return np.asarray(o), tuple(np.asarray(x) for x in vjp(do))


def _rel(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _run(recipe, q, k, v, do, state, **kw):
    """(out, (dq, dk, dv), next state) of one FP8 attention step."""
    out, vjp = jax.vjp(
        lambda q, k, v, st: fp8_attention(q, k, v, recipe=recipe, state=st, **kw), q, k, v, state
    )
    dq, dk, dv, nxt = vjp(do.astype(out.dtype))
    return out, (dq, dk, dv), nxt


def _check_errors(out, grads, want_o, want_g):
    errs = [_rel(out, want_o)] + [_rel(g, w) for g, w in zip(grads, want_g)]
    assert FLOOR < errs[0] < FWD, errs
    for e in errs[1:]:
        assert FLOOR < e < BWD, errs
    return errs


def _steady_state(recipe, q, k, v, do, **kw):
    """DelayedScaling: the state after one step on these inputs (scales from their amaxes)."""
    if not isinstance(recipe, DelayedScaling):
        return None
    return _run(recipe, q, k, v, do, fs.init_state(recipe), **kw)[2]


@pytest.mark.parametrize("make", RECIPES)
@pytest.mark.parametrize("causal", [False, True])
def test_emulation_against_float64(make, causal):
    recipe = make()
    q, k, v, do = _inputs()
    kw = dict(causal=causal, implementation="emulate")
    state = _steady_state(recipe, q, k, v, do, **kw)
    out, grads, _ = _run(recipe, q, k, v, do, state, **kw)
    want_o, want_g = _f64(q, k, v, do, causal)
    _check_errors(out, grads, want_o, want_g)


def _common(x, size, seed):
    """``x`` plus ``size`` times a vector shared by every position (per batch, head, channel): the
    component trained keys and values carry."""
    c = np.random.default_rng(seed).standard_normal((1, 1) + x.shape[2:])
    return (x.astype(jnp.float32) + size * c).astype(x.dtype)


@pytest.mark.parametrize("make", RECIPES)
def test_keys_and_values_with_a_common_component_keep_the_bounds(make):
    """A component shared by all keys and values (6 sigma here) leaves exact attention's output
    shifted and its gradients unchanged; FP8 attention must stay within the same bounds. Without
    centering, dS's rounded row sums carry k's common component into dq (3x dq's norm)."""
    recipe = make()
    q, k, v, do = _inputs(seed=11, s=128)
    k, v = _common(k, 6.0, 1), _common(v, 6.0, 2)
    kw = dict(causal=True, implementation="emulate")
    state = _steady_state(recipe, q, k, v, do, **kw)
    out, grads, _ = _run(recipe, q, k, v, do, state, **kw)
    want_o, want_g = _f64(q, k, v, do, True)
    # o's error against o less v's mean (what FP8 carries; the mean itself is exact)
    shift = np.repeat(np.mean(np.asarray(v, np.float64), axis=1, keepdims=True), 2, axis=2)
    _check_errors(np.asarray(out, np.float64) - shift, grads, want_o - shift, want_g)


def _dropout_step(q, k, v, do, rng, rate=0.2):
    """Current scaling's emulated step with dropout, checked against float64 attention with the
    emulation's mask ``bernoulli(rng, 1 - rate, (b, h, sq, sk))``; returns (out, kw)."""
    recipe = Float8CurrentScaling(fp8_dpa=True)
    kw = dict(recipe=recipe, causal=True, implementation="emulate", dropout_rate=rate, rng=rng)
    out, grads, _ = _run(recipe, q, k, v, do, None, **{n: x for n, x in kw.items() if n != "recipe"})
    b, s, h, _ = q.shape
    keep = np.asarray(jax.random.bernoulli(rng, 1 - rate, (b, 2, h // 2, s, s))).reshape(b, h, s, s)
    want_o, want_g = _f64(q, k, v, do, True, keep, rate)
    _check_errors(out, grads, want_o, want_g)
    return out, kw


def test_dropout_with_a_common_key_component_keeps_the_bounds():
    """Under dropout v is not centered (dropped rows do not sum to one), k still is."""
    q, k, v, do = _inputs(seed=12, s=128)
    _dropout_step(q, _common(k, 6.0, 3), v, do, jax.random.PRNGKey(5))


def _float8_round_trips(jaxpr, made=None) -> int:
    """Conversions of a value converted to FP8 in the same jaxpr back to a wider float: XLA's GPU
    pipeline deletes such pairs (simplify-fp-conversions), so an emulation built on them does
    not round on a GPU."""
    made = set() if made is None else made
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            (x,), (y,) = eqn.invars, eqn.outvars
            if jnp.dtype(y.aval.dtype).itemsize == 1 and jnp.issubdtype(y.aval.dtype, jnp.floating):
                made.add(y)
            elif x in made and jnp.issubdtype(y.aval.dtype, jnp.floating):
                count += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _float8_round_trips(inner)
    return count


@pytest.mark.parametrize("make", RECIPES)
def test_emulation_survives_the_gpu_pipeline(make):
    """The emulation decodes its FP8 values by table, never by a convert pair XLA's GPU
    compiler would remove (the old ``astype`` decode left one per rounding: none ran on a GPU)."""
    recipe = make()
    q, k, v, do = _inputs()
    state = fs.init_state(recipe) if isinstance(recipe, DelayedScaling) else None
    step = lambda q, k, v: _run(recipe, q, k, v, do, state, causal=True, implementation="emulate")  # noqa: E731
    assert _float8_round_trips(jax.make_jaxpr(step)(q, k, v).jaxpr) == 0


def test_emulation_dropout_uses_the_key_mask():
    """With dropout the emulation's mask is ``bernoulli(rng, 1 - rate, (b, h, sq, sk))``: against
    float64 attention with that mask, the same bounds hold."""
    q, k, v, do = _inputs(seed=1)
    out, kw = _dropout_step(q, k, v, do, jax.random.PRNGKey(7))
    again = fp8_attention(q, k, v, **kw)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_delayed_s_scale_never_exceeds_the_unnormalized_bound(rate):
    """A non-causal history gives s an amax ~1/3 and a scale ~1334; cuDNN quantizes the
    unnormalized exp(s - m) <= 1 (over the keep rate), so the op must use at most fmax * keep:
    with that state the step equals the step whose s scale is exactly that bound."""
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    q, k, v, do = _inputs(seed=5)
    kw = dict(causal=False, implementation="emulate")
    if rate:
        kw |= dict(dropout_rate=rate, rng=jax.random.PRNGKey(3))
    state = _steady_state(recipe, q, k, v, do, **kw)
    bound = 448.0 * (1.0 - rate)
    big = dict(state, s_scale=jnp.full((1,), 4.0 * bound, jnp.float32))
    exact = dict(state, s_scale=jnp.full((1,), bound, jnp.float32))
    got, want = _run(recipe, q, k, v, do, big, **kw), _run(recipe, q, k, v, do, exact, **kw)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_delayed_state_advances_from_the_amaxes():
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4, margin=1)
    q, k, v, do = _inputs(seed=2)
    state = fs.init_state(recipe)
    _, _, nxt = _run(recipe, q, k, v, do, state, causal=True, implementation="emulate")
    k, v = (x.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), axis=1, keepdims=True) for x in (k, v))
    for role, x, fmax in (("q", q, 448.0), ("k", k, 448.0), ("v", v, 448.0), ("do", do, 57344.0)):
        a = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32))))  # k, v centered
        assert float(nxt[f"{role}_amax_history"][0]) == pytest.approx(a)
        assert float(nxt[f"{role}_scale"][0]) == pytest.approx(fmax / a / 2.0, rel=1e-6)
    # s is the probabilities (at most 1), each history entry is a positive amax
    assert 0 < float(nxt["s_amax_history"][0]) <= 1.0
    for role in fs.ROLES:
        assert float(nxt[f"{role}_amax_history"][0]) > 0 and float(nxt[f"{role}_amax_history"][1]) == 0


def test_current_scales_bound_the_tensors():
    """Float8CurrentScaling: the scales derived from bounds never let a tensor saturate: each
    emulated tensor's amax times its scale stays within its format's maximum."""
    recipe = Float8CurrentScaling(fp8_dpa=True)
    q, k, v, do = _inputs(seed=3)
    delayed = DelayedScaling(fp8_dpa=True, amax_history_len=1)
    nxt = _run(delayed, q, k, v, do, fs.init_state(delayed), causal=True, implementation="emulate")[2]
    k, v = (x.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), axis=1, keepdims=True) for x in (k, v))
    a = {r: jnp.max(jnp.abs(x.astype(jnp.float32))) for r, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    sc = fs.current_output_scales(recipe, a, scale=1 / np.sqrt(32), rate=0.0, sq=64, d=32)
    for role in ("s", "o", "dp", "dq", "dk", "dv"):
        fmax = 448.0 if role in ("s", "o") else 57344.0
        assert float(nxt[f"{role}_amax_history"][0]) * float(sc[role]) <= fmax, role


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MXFP8BlockScaling(fp8_mha=True), "fp8_mha"),
        (lambda: MXFP8BlockScaling(fp8_dpa=True), "fp8_dpa"),
        (lambda: Float8BlockScaling(fp8_dpa=True), "attention"),
    ],
)
def test_unsupported_recipes_are_refused(make, match):
    with pytest.raises(NotImplementedError, match=match):
        make()


def test_bad_arguments_name_what_is_wrong():
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match="fp8_format"):
        fp8_attention(q, k, v, recipe=Float8CurrentScaling(fp8_format=Format.E4M3, fp8_dpa=True))
    with pytest.raises(ValueError, match="state"):
        fp8_attention(q, k, v, recipe=DelayedScaling(fp8_dpa=True))
    with pytest.raises(ValueError, match="rng"):
        fp8_attention(q, k, v, recipe=Float8CurrentScaling(fp8_dpa=True), dropout_rate=0.1)
    with pytest.raises(ValueError, match="implementation"):
        fp8_attention(q, k, v, recipe=Float8CurrentScaling(fp8_dpa=True), implementation="xla")
    with pytest.raises(ValueError, match="sq == sk"):
        fp8_attention(q, k[:, :32], v[:, :32], recipe=Float8CurrentScaling(fp8_dpa=True), causal=True)


# --- the Flax modules ----------------------------------------------------------------------
def _module_close(module, args, recipe, key=0):
    """Runs ``module`` under ``recipe`` with fp8_dpa off and on (same parameters; the dense
    layers quantize alike in both): the outputs agree within FWD (relative), differ by more than
    FLOOR / 4 (FP8 attention in effect), and the FP8 run holds the attention state under
    DelayedScaling."""
    with lowbit.autocast(recipe=dataclasses.replace(recipe, fp8_dpa=False), enabled=True):
        variables = module.init(jax.random.PRNGKey(key), *args)
        plain = module.apply(variables, *args)
    with lowbit.autocast(recipe=recipe, enabled=True):
        v8 = module.init(jax.random.PRNGKey(key), *args)
        got = module.apply({**v8, **{c: x for c, x in variables.items() if c == "params"}}, *args)
    plain, got = (x[0] if isinstance(x, tuple) else x for x in (plain, got))
    err = _rel(got, np.asarray(plain, np.float64))
    assert FLOOR / 4 < err < FWD, err
    names = jax.tree_util.tree_map_with_path(
        lambda p, _: jax.tree_util.keystr(p), v8.get("_overwrite_with_gradient", {})
    )
    flat = " ".join(jax.tree_util.tree_leaves(names))
    assert ("s_amax_history" in flat) == isinstance(recipe, DelayedScaling)


@pytest.mark.parametrize("make", RECIPES)
def test_dot_product_attention_module(make):
    q, k, v, _ = _inputs(dtype=jnp.float32)
    dpa = DotProductAttention(head_dim=32, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="causal")
    _module_close(dpa, (q, k, v), make())


@pytest.mark.parametrize("make", RECIPES)
def test_multi_head_attention_and_layer(make):
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 32, 64)), jnp.float32)
    mha = MultiHeadAttention(
        head_dim=16, num_attention_heads=4, attn_mask_type="causal", scale_attn_logits=True
    )
    _module_close(mha, (x,), make())
    layer = TransformerLayer(
        hidden_size=64,
        mlp_hidden_size=128,
        num_attention_heads=4,
        enable_relative_embedding=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    _module_close(layer, (x,), make())


def test_unsupported_call_falls_back_with_a_warning():
    q, k, v, _ = _inputs(dtype=jnp.float32)
    dpa = DotProductAttention(head_dim=32, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="causal")
    bias = jnp.zeros((1, 4, 64, 64), jnp.float32)
    variables = dpa.init(jax.random.PRNGKey(0), q, k, v, None, bias)
    want = dpa.apply(variables, q, k, v, None, bias)
    with lowbit.autocast(recipe=Float8CurrentScaling(fp8_dpa=True), enabled=True):
        with pytest.warns(UserWarning, match="bias"):
            got = dpa.apply(variables, q, k, v, None, bias)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_module_state_updates_through_the_gradient():
    """DelayedScaling: the gradient of the module's _overwrite_with_gradient collection is the
    next state (the histories hold this step's amaxes)."""
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    q, k, v, _ = _inputs(dtype=jnp.float32)
    dpa = DotProductAttention(head_dim=32, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="causal")
    with lowbit.autocast(recipe=recipe, enabled=True):
        variables = dpa.init(jax.random.PRNGKey(0), q, k, v)
        state = variables["_overwrite_with_gradient"]
        grads = jax.grad(lambda st: jnp.sum(dpa.apply({"_overwrite_with_gradient": st}, q, k, v) ** 2))(state)
    assert float(grads["q_amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(q))))
    assert float(grads["q_scale"][0]) == pytest.approx(448.0 / float(jnp.max(jnp.abs(q))), rel=1e-6)
    assert float(grads["dq_amax_history"][0]) > 0


# --- GPU: cuDNN's FP8 kernel through lowbit's handler --------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("make", RECIPES)
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_fp8_against_float64_and_bf16(make, causal, gpu_device):
    from lowbit.ops._ffi import attention as ffi
    from lowbit.ops.fused_attention import fused_attention

    ok, reason = ffi.cudnn_status()
    if not ok:
        pytest.fail(f"cuDNN attention not usable on this GPU machine: {reason}")
    recipe = make()
    q, k, v, do = _inputs(b=2, s=256, h=4, g=2, d=128)
    kw = dict(causal=causal, implementation="cudnn")
    state = _steady_state(recipe, q, k, v, do, **kw)
    out, grads, nxt = _run(recipe, q, k, v, do, state, **kw)
    want_o, want_g = _f64(q, k, v, do, causal)
    errs = _check_errors(out, grads, want_o, want_g)
    # BF16 cuDNN attention is far closer to float64; FP8 stays within the bound of it too.
    bf16_o, vjp = jax.vjp(
        lambda q, k, v: fused_attention(q, k, v, causal=causal, implementation="cudnn"), q, k, v
    )
    bf16_g = vjp(do)
    assert _rel(bf16_o, want_o) < 2.0**-7
    assert _rel(out, np.asarray(bf16_o, np.float64)) < FWD
    for g, w in zip(grads, bf16_g):
        assert _rel(g, np.asarray(w, np.float64)) < BWD
    emu = _run(recipe, q, k, v, do, state, causal=causal, implementation="emulate")
    assert _rel(emu[0], np.asarray(out, np.float64)) < FWD, errs
    if nxt is not None:  # the kernels' amaxes reached the state: positive and finite
        for role in fs.ROLES:
            h = float(nxt[f"{role}_amax_history"][0])
            assert np.isfinite(h) and h > 0, role
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod = DotProductAttention(
            head_dim=128, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="causal"
        )
        with lowbit.autocast(recipe=recipe, enabled=True):
            variables = mod.init(jax.random.PRNGKey(0), q, k, v)
            assert _rel(mod.apply(variables, q, k, v), _f64(q, k, v, do, True)[0]) < FWD


def test_cudnn_head_dim_rule_names_128():
    """cuDNN's FP8 attention backward takes head_dim 128 only (cuDNN 9.19, H200): any other
    head_dim is refused before the kernel, naming the dimension (the old rule, a multiple of 16
    up to 256, let head_dim 16 reach cuDNN's backward, which failed at run time)."""
    from lowbit.ops.attention.fp8 import fp8_head_dim_unsupported

    assert fp8_head_dim_unsupported(128) is None
    for d in (16, 64, 96, 256):
        why = fp8_head_dim_unsupported(d)
        assert why is not None and f"head_dim {d}" in why and "128" in why


@pytest.mark.gpu
@pytest.mark.parametrize("make", RECIPES)
def test_gpu_head_dim_64_takes_the_emulation_not_the_kernel(make, gpu_device):
    """On a GPU, head_dim 64 (which cuDNN's FP8 backward refuses) trains through the emulation
    instead of failing at run time; implementation="cudnn" says why it cannot."""
    recipe = make()
    q, k, v, do = _inputs(b=1, s=128, h=2, g=2, d=64)
    state = _steady_state(recipe, q, k, v, do, causal=True)
    out, grads, _ = _run(recipe, q, k, v, do, state, causal=True)
    _check_errors(out, grads, *_f64(q, k, v, do, True))
    with pytest.raises(ValueError, match="head_dim 64"):
        _run(recipe, q, k, v, do, state, causal=True, implementation="cudnn")


def test_cudnn_fp8_attention_on_hopper_logs_its_measured_cost_once(monkeypatch, caplog):
    """Where FP8 attention takes cuDNN's kernels on an sm_90 device the user is told, once per
    process, that it measured slower than BF16 attention and less stable (a log record: tests
    that turn warnings into errors keep working); not on other devices, not twice."""
    import logging

    from lowbit.ops.attention import fp8 as att

    q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
    monkeypatch.setattr(att, "cudnn_fp8_available", lambda q, k: None)
    monkeypatch.setattr(att, "_warned", [])
    kw = dict(recipe=DelayedScaling(fp8_dpa=True), causal=True, scale=None, dropout_rate=0.0, rng=None)
    with caplog.at_level(logging.WARNING, logger="lowbit"):
        monkeypatch.setattr(att, "_sm_major", lambda: 10)
        assert att.config(q, q, implementation=None, **kw).cudnn
        assert not [r for r in caplog.records if "Hopper" in r.getMessage()]
        monkeypatch.setattr(att, "_sm_major", lambda: 9)
        for _ in range(2):
            assert att.config(q, q, implementation=None, **kw).cudnn
        hits = [r for r in caplog.records if "Hopper" in r.getMessage()]
        assert len(hits) == 1 and "0.89-0.94x" in hits[0].getMessage()
        assert "fp8_dpa=False" in hits[0].getMessage()
