"""TransformerLayer and LayerNormMLP field by field against TransformerEngine (TE 2.x): defaults
and order (listed here by hand from TE's source), parameter trees in TE's layout, and each
feature against a float64 plain-jnp reference written here (forward, gradients w.r.t. inputs
and parameters; no recipe and Float8CurrentScaling)."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn, rel

import lowbit
from lowbit import flax as lf
from lowbit.flax import transformer as lf_transformer

B, S, H, HEADS, F = 2, 8, 32, 4, 64
CURRENT = lowbit.Float8CurrentScaling()
# (recipe, output bound, gradient bound): relative errors, as in tests/test_flax_modules.py.
F32 = (None, 1e-5, 1e-5)
FP8 = (CURRENT, 8e-2, 2e-1)
# The whole layer with TE's defaults: unscaled logits (scale_attn_logits=False) sharpen the
# softmax and a ReLU MLP thresholds quantized values, so FP8 input errors grow more (measured up
# to 0.09 forward, 0.21 gradients at these tiny shapes).
LAYER_FP8 = (CURRENT, 1.2e-1, 3e-1)
NO_DROP = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)
RNGS = {"dropout": jax.random.PRNGKey(5)}


def fields_of(cls):
    return [(f.name, f.default) for f in dataclasses.fields(cls) if f.name not in ("parent", "name")]


# ---- defaults and order, by hand from TE's flax/transformer.py and flax/module.py --------------
TE_TRANSFORMER_LAYER = [
    ("hidden_size", 512),
    ("mlp_hidden_size", 2048),
    ("num_attention_heads", 8),
    ("num_gqa_groups", None),
    ("layernorm_type", "layernorm"),
    ("layernorm_epsilon", 1e-6),
    ("zero_centered_gamma", False),
    ("hidden_dropout", 0.1),
    ("hidden_dropout_dims", ()),
    ("attention_dropout", 0.1),
    ("intermediate_dropout", 0.0),
    ("intermediate_dropout_dims", ()),
    ("dropout_rng_name", "dropout"),
    ("mha_kernel_init", None),
    ("mlp_kernel_init", None),
    ("mlp_activations", ("gelu",)),
    ("mlp_activation_params", None),
    ("use_bias", False),
    ("bias_init", nn.initializers.zeros),
    ("apply_residual_connection_post_layernorm", False),
    ("output_layernorm", False),
    ("float32_attention_logits", False),
    ("layer_type", lf.TransformerLayerType.ENCODER),
    ("self_attn_mask_type", "causal"),
    ("self_attn_bias_type", None),
    ("enable_relative_embedding", True),
    ("relative_embedding", None),
    ("enable_rotary_pos_emb", False),
    ("rotary_pos_emb_windows", (1, 10000)),
    ("rotary_pos_emb_group_method", "consecutive"),
    ("low_rank_adaptation_scope", "none"),
    ("low_rank_adaptation_dim", 32),
    ("low_rank_adaptation_alpha", None),
    ("dtype", jnp.float32),
    ("drop_path", 0.0),
    ("fuse_qkv_params", True),
    ("transpose_batch_sequence", False),
    ("enable_sequence_parallel", False),
    ("scale_attn_logits", False),
    ("scaled_query_init", True),
    ("window_size", None),
    ("softmax_type", "vanilla"),
    ("score_mod", None),
    ("score_mod_bprop", None),
]

TE_LAYERNORM_MLP = [
    ("intermediate_dim", 2048),
    ("enable_layernorm", True),
    ("layernorm_type", "layernorm"),
    ("epsilon", 1e-6),
    ("zero_centered_gamma", False),
    ("scale_init", None),
    ("scale_axes", ("embed",)),
    ("ln_bias_init", nn.initializers.zeros),
    ("ln_bias_axes", ("embed",)),
    ("kernel_init", None),
    ("kernel_axes_1", ("embed", "act", "mlp")),
    ("kernel_axes_2", ("mlp", "embed")),
    ("use_bias", False),
    ("bias_init", nn.initializers.zeros),
    ("bias_axes_1", ("act", "mlp")),
    ("bias_axes_2", ("embed",)),
    ("return_layernorm_output", False),
    ("activations", ("gelu",)),
    ("activation_params", None),
    ("intermediate_dropout_rng_name", "dropout"),
    ("intermediate_dropout_rate", 0.0),
    ("intermediate_hidden_dropout_dims", ()),
    ("enable_low_rank_adaptation", False),
    ("low_rank_adaptation_dim", 32),
    ("low_rank_adaptation_alpha", None),
    ("axis", -1),
    ("dtype", jnp.float32),
    ("layernorm_input_axes", None),
    ("dot_1_input_axes", None),
    ("dot_2_input_axes", None),
    ("ffn1_ckpt_name", "ffn1"),
    ("ffn2_ckpt_name", "ffn2"),
    ("transpose_batch_sequence", False),
    ("quantization_checkpoint_name", None),
]


@pytest.mark.parametrize(
    "cls,expected",
    [(lf.TransformerLayer, TE_TRANSFORMER_LAYER), (lf.LayerNormMLP, TE_LAYERNORM_MLP)],
    ids=["TransformerLayer", "LayerNormMLP"],
)
def test_fields_defaults_and_order_are_te(cls, expected):
    assert fields_of(cls) == expected


def test_positional_order_is_te():
    m = lf.TransformerLayer(64, 128, 2)
    assert (m.hidden_size, m.mlp_hidden_size, m.num_attention_heads) == (64, 128, 2)
    assert lf.LayerNormMLP(96).intermediate_dim == 96


def test_transformer_layer_type_exported():
    import lowbit.te.flax as te_flax

    assert te_flax.TransformerLayerType is lf.TransformerLayerType
    assert [t.value for t in lf.TransformerLayerType] == ["encoder", "decoder"]


# ---- references (float64, plain jnp) -----------------------------------------------------------
def _ln(x, p, eps=1e-6, kind="layernorm"):
    g = p["scale"]
    if kind == "rmsnorm":
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * g + p["ln_bias"]


ACTS = {
    "linear": lambda x: x,
    "gelu": lambda x: 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "relu": lambda x: jnp.maximum(x, 0.0),
    "silu": lambda x: x / (1 + jnp.exp(-x)),
    "quick_gelu": lambda x: x / (1 + jnp.exp(-1.702 * x)),
    "squared_relu": lambda x: jnp.maximum(x, 0.0) ** 2,
}


def _mlp_ref(p, x, acts, lora_alpha=None, eps=1e-6, kind="layernorm"):
    """TE's MLP: slot i of the first GEMM through acts[i], slots multiplied (a leading "linear"
    moves to the end); LoRA adds x.A.B*alpha/r per slot."""
    acts = tuple(a.lower() for a in acts)
    if acts[0] == "linear":
        acts = acts[::-1]
    y = _ln(x, p, eps, kind)
    h = jnp.einsum("...k,knf->...nf", y, p["wi_kernel"])
    if "wi_lora_a_kernel" in p:
        r = p["wi_lora_a_kernel"].shape[-1]
        s = 1.0 if lora_alpha is None else lora_alpha / r
        h = h + s * jnp.einsum("...k,knr,nrf->...nf", y, p["wi_lora_a_kernel"], p["wi_lora_b_kernel"])
    if "wi_bias" in p:
        h = h + p["wi_bias"]
    z = 1.0
    for i, a in enumerate(acts):
        z = z * ACTS[a](h[..., i, :])
    out = z @ p["wo_kernel"]
    if "wo_lora_a_kernel" in p:
        r = p["wo_lora_a_kernel"].shape[-1]
        s = 1.0 if lora_alpha is None else lora_alpha / r
        out = out + s * (z @ p["wo_lora_a_kernel"] @ p["wo_lora_b_kernel"])
    if "wo_bias" in p:
        out = out + p["wo_bias"]
    return out, y


def _bucket(q, k, bidirectional, num_buckets=32, max_distance=128):
    """T5's relative position bucket of key position k seen from query position q."""
    rel, base, nb = k - q, 0, num_buckets
    if bidirectional:
        nb //= 2
        base = nb if rel > 0 else 0
        n = abs(rel)
    else:
        n = max(-rel, 0)
    exact = nb // 2
    if n < exact:
        return base + n
    far = exact + int(
        np.float32(math.log(n / exact + float(np.finfo(np.float32).eps)) / math.log(max_distance / exact))
        * (nb - exact)
    )
    return base + min(far, nb - 1)


def _relpos_ref(table, sq, sk, bidirectional):
    idx = np.array([[_bucket(i, j, bidirectional) for j in range(sk)] for i in range(sq)])
    return table[:, idx][None]  # (1, heads, sq, sk)


def _rotary_ref(x, method, windows=(1, 10000)):
    """x (b, s, h, d): position p's pairs rotated by p / timescale."""
    d = x.shape[-1]
    ts = windows[0] * (windows[1] / windows[0]) ** (2 * np.arange(d // 2) / d)
    ang = np.arange(x.shape[1])[:, None] / ts[None, :]  # (s, d/2)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    if method == "alternate":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(x.shape)


def _proj(x, p):
    out = x @ p["kernel"].reshape(p["kernel"].shape[0], -1)
    return out + p["bias"].reshape(-1) if "bias" in p else out


def _mha_ref(p, xq, xkv, c, mask, causal, bias, input_ln, self_attn):
    """One attention block in TE's parameter layout: qkv (H, 3, h*d), or query (H, h*d) and
    kv (H, 2, g*d) (GQA, cross-attention), or query / key / value (fuse_qkv_params=False)."""
    h, g, d = c["heads"], c["groups"], c["head_dim"]
    ln_p = p["qkv"] if "qkv" in p else p["query"]
    y = _ln(xq, ln_p, c["eps"], c["kind"]) if input_ln else xq
    if "qkv" in p:  # (H, 3, h*d): slots q, k, v
        q, k, v = jnp.split(_proj(y, p["qkv"]), 3, -1)
    else:
        q = _proj(y, p["query"])
        if "kv" in p:
            k, v = jnp.split(_proj(y if self_attn else xkv, p["kv"]), 2, -1)
        else:
            kv_in = y if self_attn else xkv
            k, v = _proj(kv_in, p["key"]), _proj(kv_in, p["value"])
    b, sq, sk = xq.shape[0], xq.shape[1], k.shape[1]
    q, k, v = q.reshape(b, sq, h, d), k.reshape(b, sk, g, d), v.reshape(b, sk, g, d)
    if c.get("rotary"):
        q, k = _rotary_ref(q, c["rotary"]), _rotary_ref(k, c["rotary"])
    k, v = jnp.repeat(k, h // g, 2), jnp.repeat(v, h // g, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c["scale"]
    if bias is not None:
        s = s + bias
    out_m = np.zeros((b, 1, sq, sk), bool) if mask is None else np.asarray(mask)
    qi, ki = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if causal:
        out_m = out_m | (ki > qi)
    if c.get("window") is not None:
        left, right = c["window"]
        out_m = (
            out_m | ((ki < qi - left) if left >= 0 else False) | ((ki > qi + right) if right >= 0 else False)
        )
    s = jnp.where(out_m, -jnp.inf, s)
    pr = jax.nn.softmax(s, -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, sq, h * d)
    return _proj(o, p["out"]), y


def layer_ref(p, x, enc, c):
    """TE's TransformerLayer in float64 (dropout off)."""
    if c.get("transpose"):
        x = jnp.swapaxes(x, 0, 1)
        enc = None if enc is None else jnp.swapaxes(enc, 0, 1)
    decoder = c.get("decoder", False)
    bias = None
    if "relpos_bias" in p:
        bias = _relpos_ref(p["relpos_bias"]["rel_embedding"], x.shape[1], x.shape[1], not decoder)
    post = c.get("post_ln_residual", False)
    a, ln = _mha_ref(
        p["self_attention" if decoder else "attention"],
        x,
        x,
        c,
        c.get("mask"),
        c.get("causal", True),
        bias,
        not c.get("output_ln", False),
        True,
    )
    x1 = a + (ln if post else x)
    mlp_in = x1
    if decoder:
        a2, ln2 = _mha_ref(p["encoder_decoder_attention"], x1, enc, c, c["ed_mask"], False, None, True, False)
        mlp_in = a2 + (ln2 if post else x1)
    m, lnm = _mlp_ref(p["mlp"], mlp_in, c["acts"], eps=c["eps"], kind=c["kind"])
    z = m + (lnm if post else mlp_in)
    if c.get("output_ln"):
        z = _ln(z, p["output_layernorm"], c["eps"], c["kind"])
    return jnp.swapaxes(z, 0, 1) if c.get("transpose") else z


def cfg(**kw):
    c = dict(
        heads=HEADS, groups=HEADS, head_dim=H // HEADS, acts=("gelu",), eps=1e-6, kind="layernorm", scale=1.0
    )
    c.update(kw)
    return c


_PERTURB = ("bias", "ln_bias", "wi_bias", "wo_bias", "wi_lora_b_kernel", "wo_lora_b_kernel", "lora_b_kernel")


def check(module, inputs, ref, case, apply_kw=None, n_grad_inputs=None):
    """Forward and gradients (params and the float inputs) of ``module(*inputs, **apply_kw)``
    against ``ref(params, *inputs)`` in float64. Zero-initialised biases / LoRA B are randomised
    first so that every path carries signal."""
    recipe, tol_out, tol_grad = case
    apply_kw = dict(apply_kw or {}, deterministic=True)
    rng = np.random.default_rng(1)
    n = len(inputs) if n_grad_inputs is None else n_grad_inputs
    with lowbit.autocast(recipe):
        v = nn.unbox(module.init({"params": jax.random.PRNGKey(0), **RNGS}, *inputs, **apply_kw))
        v = dict(
            v,
            params=jax.tree_util.tree_map_with_path(
                lambda path, a: (
                    jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype)
                    if getattr(path[-1], "key", "") in _PERTURB
                    else a
                ),
                v["params"],
            ),
        )
        first = module.apply(v, *inputs, rngs=RNGS, **apply_kw)
        first = first[0] if isinstance(first, tuple) else first
        dy = jnp.asarray(rng.standard_normal(first.shape), jnp.float32)

        def loss(params, *xs):
            o = module.apply(dict(v, params=params), *xs, *inputs[n:], rngs=RNGS, **apply_kw)
            o = o[0] if isinstance(o, tuple) else o
            return jnp.vdot(o.astype(jnp.float32), dy)

        out, grads = jax.jit(
            lambda p, *xs: (loss(p, *xs), jax.grad(loss, argnums=tuple(range(n + 1)))(p, *xs))
        )(v["params"], *inputs[:n])
        out = module.apply(v, *inputs, rngs=RNGS, **apply_kw)
    out = out[0] if isinstance(out, tuple) else out
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, np.float64)), t)
        p64, in64 = f64(v["params"]), [f64(a) if a is not None else None for a in inputs]

        def ref_loss(p, *xs):
            return jnp.vdot(ref(p, *xs, *in64[n:]), jnp.asarray(np.asarray(dy, np.float64)))

        r = ref(p64, *in64)
        rgrads = jax.grad(ref_loss, argnums=tuple(range(n + 1)))(p64, *in64[:n])
    assert rel(out, r) < tol_out, f"forward: {rel(out, r)}"
    for i in range(1, n + 1):
        assert rel(grads[i], rgrads[i]) < tol_grad, f"d input {i - 1}: {rel(grads[i], rgrads[i])}"
    ref_flat = dict(jax.tree_util.tree_leaves_with_path(rgrads[0]))
    for path, g in jax.tree_util.tree_leaves_with_path(grads[0]):
        e = rel(g, ref_flat[path])
        assert e < tol_grad, f"d{jax.tree_util.keystr(path)}: {e}"
    return v


# ---- LayerNormMLP -------------------------------------------------------------------------------
MLP_ACTS = [
    ("relu",),
    ("gelu", "linear"),
    ("linear", "silu"),
    ("relu", "relu"),
    ("linear",),
    ("quick_gelu", "linear"),
    ("squared_relu",),
    ("gelu", "gelu", "linear"),
]


@pytest.mark.parametrize(
    "acts",
    [
        a
        if a in (("relu",), ("gelu", "linear"), ("squared_relu",))
        else pytest.param(a, marks=pytest.mark.slow)
        for a in MLP_ACTS
    ],
    ids=["-".join(a) for a in MLP_ACTS],
)
def test_layernorm_mlp_activations(acts):
    m = lf.LayerNormMLP(intermediate_dim=F, activations=acts, use_bias=True, intermediate_dropout_rate=0.0)
    v = check(m, (randn((B, S, H)),), lambda p, x: _mlp_ref(p, x, acts)[0], F32)
    n_act = len(acts)
    assert v["params"]["wi_kernel"].shape == (H, n_act, F)
    assert v["params"]["wi_bias"].shape == (n_act, F)


# ("relu", "relu") under FP8 has larger input-gradient errors (0.26-0.34 at these shapes, against
# 0.16-0.19 for ("relu",)): the product of two thresholded slots; the f32 test checks its math.
@pytest.mark.parametrize("acts", [("gelu", "linear"), ("gelu", "gelu")], ids=["fused", "jnp"])
def test_layernorm_mlp_activations_fp8(acts):
    m = lf.LayerNormMLP(intermediate_dim=F, activations=acts, use_bias=True, intermediate_dropout_rate=0.0)
    check(m, (randn((B, S, H)),), lambda p, x: _mlp_ref(p, x, acts)[0], FP8)


def test_which_activations_stay_fused():
    from lowbit.flax.modules import fused_mlp_activation, normalize_mlp_activations

    fused = [("gelu",), ("silu", "linear"), ("linear", "relu"), ("quick_gelu", "linear"), ("squared_relu",)]
    unfused = [("relu", "relu"), ("gelu", "gelu", "linear"), ("tanh",), (jnp.tanh,)]
    assert all(fused_mlp_activation(normalize_mlp_activations(a)) for a in fused)
    assert not any(fused_mlp_activation(normalize_mlp_activations(a)) for a in unfused)


@pytest.mark.parametrize("case", [F32, pytest.param(FP8, marks=pytest.mark.slow)], ids=["f32", "current"])
def test_layernorm_mlp_lora(case):
    m = lf.LayerNormMLP(
        intermediate_dim=F,
        activations=("silu", "linear"),
        intermediate_dropout_rate=0.0,
        enable_low_rank_adaptation=True,
        low_rank_adaptation_dim=4,
        low_rank_adaptation_alpha=8.0,
    )
    v = check(m, (randn((B, S, H)),), lambda p, x: _mlp_ref(p, x, ("silu", "linear"), 8.0)[0], case)
    shapes = jax.tree_util.tree_map(jnp.shape, v["params"])
    assert shapes["wi_lora_a_kernel"] == (H, 2, 4) and shapes["wi_lora_b_kernel"] == (2, 4, F)
    assert shapes["wo_lora_a_kernel"] == (F, 4) and shapes["wo_lora_b_kernel"] == (4, H)


def test_layernorm_mlp_returns_layernorm_output_and_ckpt_names():
    x = randn((B, S, H))
    m = lf.LayerNormMLP(
        intermediate_dim=F,
        return_layernorm_output=True,
        intermediate_dropout_rate=0.0,
        ffn1_ckpt_name="a1",
        ffn2_ckpt_name="a2",
    )
    v = m.init(jax.random.PRNGKey(0), x)
    out, ln = m.apply(v, x)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), nn.unbox(v)["params"])
    np.testing.assert_allclose(ln, _ln(np.asarray(x, np.float64), p), rtol=1e-5, atol=1e-5)
    assert (
        lf.LayerNormMLP(intermediate_dim=F).apply(v, x, deterministic=True)[1] is None  # TE 2.10's default
    )
    jaxpr = str(jax.make_jaxpr(lambda x: m.apply(v, x, deterministic=True))(x))
    assert "name=a1" in jaxpr and "name=a2" in jaxpr


# ---- TransformerLayer ---------------------------------------------------------------------------
def _layer(**kw):
    base = dict(hidden_size=H, mlp_hidden_size=F, num_attention_heads=HEADS, **NO_DROP)
    base.update(kw)
    return lf.TransformerLayer(**base)


@pytest.mark.parametrize(
    "case", [F32, pytest.param(LAYER_FP8, marks=pytest.mark.slow)], ids=["f32", "current"]
)
def test_encoder_with_te_defaults(case):
    """TE's defaults: relative position bias, unscaled logits (scale_attn_logits=False), causal
    self-attention, GELU MLP (TE >= 2.10; ReLU before)."""
    v = check(_layer(), (randn((B, S, H)),), lambda p, x: layer_ref(p, x, None, cfg()), case)
    assert v["params"]["relpos_bias"]["rel_embedding"].shape == (HEADS, 32)


@pytest.mark.parametrize(
    "case", [F32, pytest.param(LAYER_FP8, marks=pytest.mark.slow)], ids=["f32", "current"]
)
def test_decoder_with_cross_attention(case):
    enc = randn((B, 6, H), 3)
    ed_mask = np.zeros((B, 1, S, 6), bool)
    ed_mask[1, :, :, 4:] = True  # encoder positions 4.. of sample 1 are padding
    m = _layer(layer_type=lf.TransformerLayerType.DECODER, mlp_activations=("gelu", "linear"))
    c = cfg(decoder=True, ed_mask=ed_mask, acts=("gelu", "linear"))
    v = check(
        m,
        (randn((B, S, H)), enc),
        lambda p, x, e: layer_ref(p, x, e, c),
        case,
        apply_kw={"encoder_decoder_mask": jnp.asarray(ed_mask)},
    )
    assert set(v["params"]) == {"self_attention", "encoder_decoder_attention", "mlp", "relpos_bias"}


@pytest.mark.parametrize(
    "kw,ref_kw",
    [
        (dict(output_layernorm=True), dict(output_ln=True)),
        pytest.param(
            dict(apply_residual_connection_post_layernorm=True),
            dict(post_ln_residual=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(apply_residual_connection_post_layernorm=True, output_layernorm=True),
            dict(post_ln_residual=True, output_ln=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(scale_attn_logits=True, enable_relative_embedding=False),
            dict(scale=1 / math.sqrt(H // HEADS)),
            marks=pytest.mark.slow,
        ),
        # heads of hidden_size/heads dims, input width 32
        pytest.param(dict(hidden_size=16), dict(head_dim=4), marks=pytest.mark.slow),
        pytest.param(dict(transpose_batch_sequence=True), dict(transpose=True), marks=pytest.mark.slow),
        pytest.param(dict(self_attn_mask_type="no_mask"), dict(causal=False), marks=pytest.mark.slow),
        (dict(layernorm_type="rmsnorm", layernorm_epsilon=1e-5), dict(kind="rmsnorm", eps=1e-5)),
        pytest.param(
            dict(mlp_activations=("squared_relu",)), dict(acts=("squared_relu",)), marks=pytest.mark.slow
        ),
    ],
    ids=[
        "output_layernorm",
        "post_ln_residual",
        "post_ln_residual+output_layernorm",
        "scale_attn_logits",
        "hidden_size",
        "transpose_batch_sequence",
        "no_mask",
        "rmsnorm",
        "squared_relu",
    ],
)
def test_layer_fields(kw, ref_kw):
    c = cfg(**ref_kw)
    m = _layer(**kw)
    x = randn((S, B, H)) if kw.get("transpose_batch_sequence") else randn((B, S, H))
    ref = lambda p, x: layer_ref(p, x, None, c)
    v = check(m, (x,), ref, F32)
    if kw.get("output_layernorm"):
        assert set(v["params"]["attention"]["qkv" if "qkv" in v["params"]["attention"] else "query"]) <= {
            "kernel",
            "bias",
        }, "output_layernorm=True: the self-attention has no input norm (TE moves it to the output)"
        assert {"scale", "ln_bias"} <= set(v["params"]["mlp"]) and "output_layernorm" in v["params"]


@pytest.mark.slow
def test_padding_causal_and_gqa_f32():
    mask = np.zeros((B, 1, S, S), bool)
    mask[1, :, :, 6:] = True
    m = _layer(num_gqa_groups=2, self_attn_mask_type="padding_causal", enable_relative_embedding=False)
    c = cfg(groups=2, mask=mask)
    check(
        m,
        (randn((B, S, H)),),
        lambda p, x: layer_ref(p, x, None, c),
        F32,
        apply_kw={"attention_mask": jnp.asarray(mask)},
    )
    # TransformerEngine also spells it 'causal_padding'
    m2 = _layer(num_gqa_groups=2, self_attn_mask_type="causal_padding", enable_relative_embedding=False)
    check(
        m2,
        (randn((B, S, H)),),
        lambda p, x: layer_ref(p, x, None, c),
        F32,
        apply_kw={"attention_mask": jnp.asarray(mask)},
    )


def test_lora_scope_mlp_and_all():
    m = _layer(low_rank_adaptation_scope="mlp", low_rank_adaptation_dim=4, low_rank_adaptation_alpha=2.0)
    v = m.init(jax.random.PRNGKey(0), randn((B, S, H)), deterministic=True)
    assert "wi_lora_a_kernel" in v["params"]["mlp"] and "wo_lora_b_kernel" in v["params"]["mlp"]
    assert "lora_a_kernel" not in str(jax.tree_util.tree_structure(v["params"]["attention"]))
    v = _layer(low_rank_adaptation_scope="all", low_rank_adaptation_dim=4).init(
        jax.random.PRNGKey(0), randn((B, S, H)), deterministic=True
    )
    assert "lora_a_kernel" in str(jax.tree_util.tree_structure(v["params"]["attention"]))
    assert lf_transformer.lora_scope("exclude_mlp") == (True, True, False)
    assert lf_transformer.lora_scope(None) == (False, False, False)


def test_relative_position_biases_buckets():
    """The default relative embedding's buckets (exact and logarithmic) against T5's rule."""
    assert lf_transformer.RelativePositionBiases is lf.RelativePositionBiases
    rel = lf.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=2)
    for bidirectional in (True, False):
        v = rel.init(jax.random.PRNGKey(0), 160, 160, bidirectional)
        out = rel.apply(v, 160, 160, bidirectional)
        table = np.asarray(nn.unbox(v)["params"]["rel_embedding"])
        np.testing.assert_array_equal(out, _relpos_ref(table, 160, 160, bidirectional))


def test_drop_path_drops_whole_samples():
    """drop_path: each sample's residual branch is kept or dropped as a whole."""
    m = _layer(drop_path=0.5, enable_relative_embedding=False)
    x = randn((16, S, H))
    v = m.init(jax.random.PRNGKey(0), x, deterministic=True)
    y = m.apply(v, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
    kept = m.apply(v, x, deterministic=True)
    same_as_input = np.all(np.asarray(y) == np.asarray(x), axis=(1, 2))
    assert same_as_input.any() and not same_as_input.all()  # some samples lost both branches
    # a sample that kept both branches is the deterministic output rescaled per branch, never mixed
    assert np.asarray(y).shape == np.asarray(kept).shape


def test_mha_fields_passed_under_te_names(monkeypatch):
    """The layer hands each attention block TransformerEngine's MultiHeadAttention fields, mapped
    as TE's TransformerLayer maps them (recorded from lowbit's MultiHeadAttention, which has
    them all), and decode to the self-attention only."""
    seen = {}

    class Recording(lf.MultiHeadAttention):
        def __call__(
            self, inputs_q, inputs_kv=None, mask=None, bias=None, *, decode=False, deterministic=False
        ):
            seen[self.name] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            seen[self.name]["decode"] = decode
            return inputs_q, inputs_q

    monkeypatch.setattr(lf_transformer, "MultiHeadAttention", Recording)
    kinit, binit = nn.initializers.normal(0.3), nn.initializers.constant(0.1)
    m = _layer(
        layer_type="decoder",
        num_gqa_groups=2,
        float32_attention_logits=True,
        scale_attn_logits=True,
        scaled_query_init=False,
        output_layernorm=True,
        apply_residual_connection_post_layernorm=False,
        self_attn_mask_type="causal_padding",
        self_attn_bias_type="post_scale_bias",
        enable_rotary_pos_emb=True,
        rotary_pos_emb_windows=(2, 500),
        rotary_pos_emb_group_method="alternate",
        low_rank_adaptation_scope="qkv_proj",
        low_rank_adaptation_dim=8,
        low_rank_adaptation_alpha=4.0,
        fuse_qkv_params=False,
        transpose_batch_sequence=True,
        enable_sequence_parallel=True,
        window_size=(3, 0),
        use_bias=True,
        bias_init=binit,
        mha_kernel_init=kinit,
        layernorm_type="rmsnorm",
        layernorm_epsilon=1e-5,
        zero_centered_gamma=True,
        attention_dropout=0.2,
        dropout_rng_name="drop",
        dtype=jnp.bfloat16,
    )
    x = randn((S, B, H))
    m.init({"params": jax.random.PRNGKey(0), "drop": jax.random.PRNGKey(1)}, x, x, deterministic=True)
    sa, ca = seen["self_attention"], seen["encoder_decoder_attention"]
    for f in (sa, ca):
        assert f["head_dim"] == H // HEADS and f["num_attention_heads"] == HEADS and f["num_gqa_groups"] == 2
        assert (
            f["float32_logits"] is True and f["scale_attn_logits"] is True and f["scaled_query_init"] is False
        )
        assert f["transpose_batch_sequence"] is True and f["enable_sequence_parallel"] is True
        assert f["enable_rotary_pos_emb"] is True and f["rotary_pos_emb_windows"] == (2, 500)
        assert f["rotary_pos_emb_group_method"] == "alternate" and f["window_size"] == (3, 0)
        assert f["low_rank_adaptation_scope"] == "qkv_proj" and f["low_rank_adaptation_dim"] == 8
        assert f["low_rank_adaptation_alpha"] == 4.0 and f["fuse_qkv_params"] is False
        assert f["use_bias"] is True and f["bias_init"] is binit and f["kernel_init"] is kinit
        assert f["layernorm_type"] == "rmsnorm" and f["layernorm_epsilon"] == 1e-5
        assert f["zero_centered_gamma"] is True and f["dtype"] == jnp.bfloat16
        assert f["attention_dropout"] == 0.2 and f["dropout_rng_name"] == "drop"
        assert f["return_layernorm_output"] is False
    assert sa["input_layernorm"] is False and sa["attn_mask_type"] == "causal_padding"
    assert sa["attn_bias_type"] == "post_scale_bias"
    assert (
        ca["input_layernorm"] is True
        and ca["attn_mask_type"] == "padding"
        and ca["attn_bias_type"] == "no_bias"
    )
    assert sa["decode"] is False and ca["decode"] is False
    m.init({"params": jax.random.PRNGKey(0), "drop": jax.random.PRNGKey(1)}, x, x, decode=True)
    assert seen["self_attention"]["decode"] is True and seen["encoder_decoder_attention"]["decode"] is False


@pytest.mark.parametrize("tbs", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "kw",
    [{}, pytest.param(dict(num_gqa_groups=2, mlp_activations=("gelu", "linear")), marks=pytest.mark.slow)],
    ids=["relpos", "gqa"],
)
def test_decoder_decode_steps_equal_full_forward(tbs, kw):
    """decode=True (TE's signature): the init call with max_decode_length sizes the cache; one
    position per call after that gives the full causal decoder's rows, relative position bias
    (built for max_decode_length positions, the row of the cache position) included. (Not with
    rotary embeddings or window_size: TE gives both to the cross-attention too, which is called
    without decode, so each step's query sits at position 0 there.)"""
    L, Se = 6, 5
    m = _layer(layer_type="decoder", transpose_batch_sequence=tbs, **kw)
    x, enc = randn((B, L, H), 1), randn((B, Se, H), 2)
    ed = np.zeros((B, 1, L, Se), bool)
    ed[1, :, :, 3:] = True
    if tbs:
        x, enc = jnp.swapaxes(x, 0, 1), jnp.swapaxes(enc, 0, 1)
    call = dict(encoder_decoder_mask=jnp.asarray(ed), deterministic=True)
    v = m.init(jax.random.PRNGKey(0), x, enc, decode=True, max_decode_length=L, **call)
    params, cache = v["params"], v["cache"]
    full = m.apply({"params": params}, x, enc, **call)
    step = jax.jit(
        lambda c, xt, t: m.apply(
            {"params": params, "cache": c},
            xt,
            enc,
            encoder_decoder_mask=jnp.asarray(ed[:, :, :1]),
            deterministic=True,
            decode=True,
            max_decode_length=L,
            mutable=["cache"],
        )
    )
    outs = []
    for t in range(L):
        o, mut = step(cache, x[t : t + 1] if tbs else x[:, t : t + 1], t)
        cache = mut["cache"]
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=0 if tbs else 1), full, rtol=2e-5, atol=2e-5)
    assert int(cache["self_attention"]["cache_index"]) == L


# ---- parameter trees in TE's layout -------------------------------------------------------------
def _tree(v):
    return jax.tree_util.tree_map(lambda a: tuple(a.shape), nn.unbox(v)["params"])


def _mlp_tree(n_act=1, bias=False):
    t = {"scale": (H,), "ln_bias": (H,), "wi_kernel": (H, n_act, F), "wo_kernel": (F, H)}
    if bias:
        t.update(wi_bias=(n_act, F), wo_bias=(H,))
    return t


def test_param_tree_outside_attention_is_te():
    x = randn((B, S, H))
    v = _layer(mlp_activations=("silu", "linear"), use_bias=True).init(
        jax.random.PRNGKey(0), x, deterministic=True
    )
    t = _tree(v)
    assert set(t) == {"attention", "mlp", "relpos_bias"}
    assert t["mlp"] == _mlp_tree(2, bias=True) and t["relpos_bias"] == {"rel_embedding": (HEADS, 32)}
    v = _layer(output_layernorm=True, enable_relative_embedding=False).init(
        jax.random.PRNGKey(0), x, deterministic=True
    )
    t = _tree(v)
    assert set(t) == {"attention", "mlp", "output_layernorm"}
    assert t["output_layernorm"] == {"scale": (H,), "ln_bias": (H,)}


def test_param_tree_te_layout():
    """Encoder, decoder (cross-attention), GQA and a gated MLP: the whole tree, by hand from TE's
    MultiHeadAttention (fused qkv (H, 3, h*d); GQA and cross-attention: query + kv (H, 2, g*d))."""
    hd = H  # heads * head_dim
    x = randn((B, S, H))
    ln = {"scale": (H,), "ln_bias": (H,)}
    enc = _tree(_layer().init(jax.random.PRNGKey(0), x, deterministic=True))
    assert enc == {
        "attention": {"qkv": {**ln, "kernel": (H, 3, hd)}, "out": {"kernel": (hd, H)}},
        "mlp": _mlp_tree(),
        "relpos_bias": {"rel_embedding": (HEADS, 32)},
    }
    dec = _tree(
        _layer(layer_type="decoder").init(
            jax.random.PRNGKey(0),
            x,
            x,
            encoder_decoder_mask=jnp.zeros((B, 1, S, S), bool),
            deterministic=True,
        )
    )
    assert dec == {
        "self_attention": {"qkv": {**ln, "kernel": (H, 3, hd)}, "out": {"kernel": (hd, H)}},
        "encoder_decoder_attention": {
            "query": {**ln, "kernel": (H, hd)},
            "kv": {"kernel": (H, 2, hd)},
            "out": {"kernel": (hd, H)},
        },
        "mlp": _mlp_tree(),
        "relpos_bias": {"rel_embedding": (HEADS, 32)},
    }
    gqa = _tree(
        _layer(num_gqa_groups=2, mlp_activations=("gelu", "linear"), use_bias=True).init(
            jax.random.PRNGKey(0), x, deterministic=True
        )
    )
    g = 2 * (H // HEADS)
    assert gqa == {
        "attention": {
            "query": {**ln, "kernel": (H, hd), "bias": (hd,)},
            "kv": {"kernel": (H, 2, g), "bias": (2, g)},
            "out": {"kernel": (hd, H), "bias": (H,)},
        },
        "mlp": _mlp_tree(2, bias=True),
        "relpos_bias": {"rel_embedding": (HEADS, 32)},
    }


@pytest.mark.slow
def test_sliding_window_and_rotary():
    for kw, ref_kw in [
        (dict(window_size=(2, 0)), dict(window=(2, 0))),
        (dict(enable_rotary_pos_emb=True), dict(rotary="consecutive")),
        (dict(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate"), dict(rotary="alternate")),
    ]:
        m = _layer(enable_relative_embedding=False, **kw)
        c = cfg(**ref_kw)
        check(m, (randn((B, S, H)),), lambda p, x, c=c: layer_ref(p, x, None, c), F32)


def test_scaled_query_init():
    """scaled_query_init=True (TE's default) divides the query kernel's init by sqrt(head_dim)."""
    x = randn((B, S, H))
    k = {}
    for scaled in (True, False):
        v = nn.unbox(_layer(scaled_query_init=scaled).init(jax.random.PRNGKey(0), x, deterministic=True))
        k[scaled] = np.asarray(v["params"]["attention"]["qkv"]["kernel"])[:, 0]
    np.testing.assert_allclose(k[True] * math.sqrt(H // HEADS), k[False], rtol=1e-5)


# ---- errors naming the field --------------------------------------------------------------------
def test_errors_name_the_field():
    x = randn((B, S, H))
    init = lambda m, *a, **kw: m.init(jax.random.PRNGKey(0), *a, deterministic=True, **kw)
    with pytest.raises(ValueError, match="decode=True needs layer_type=TransformerLayerType.DECODER"):
        init(_layer(), x, decode=True)
    with pytest.raises(NotImplementedError, match="mlp_activation_params"):
        init(_layer(mlp_activation_params={"limit": 7.0}), x)
    with pytest.raises(ValueError, match="layer_type must be TransformerLayerType"):
        init(_layer(layer_type="encdec"), x)
    with pytest.raises(ValueError, match="encoded is required"):
        init(_layer(layer_type=lf.TransformerLayerType.DECODER), x)
    with pytest.raises(ValueError, match="low_rank_adaptation_scope must be one of"):
        init(_layer(low_rank_adaptation_scope="qkv"), x)
    with pytest.raises(ValueError, match=r"drop_path must be in \[0, 1\)"):
        init(_layer(drop_path=1.0), x)
    with pytest.raises(ValueError, match="inputs must be 3-D"):
        init(_layer(), x[0])
    with pytest.raises(NotImplementedError, match="activation_params"):
        init(lf.LayerNormMLP(intermediate_dim=F, activation_params={"limit": 7.0}), x)
    with pytest.raises(NotImplementedError, match="axis must be -1"):
        init(lf.LayerNormMLP(intermediate_dim=F, axis=-2), x)
    with pytest.raises(ValueError, match="unknown activation 'gleu'"):
        init(lf.LayerNormMLP(intermediate_dim=F, activations=("gleu",)), x)
    with pytest.raises(NotImplementedError, match="clamped"):
        init(lf.LayerNormMLP(intermediate_dim=F, activations=("clamped_silu", "clamped_linear")), x)


def test_layernorm_mlp_input_axes_are_constraints_only():
    """layernorm_input_axes / dot_*_input_axes constrain sharding only: same output without a mesh."""
    x = randn((B, S, H))
    axes = dict(
        layernorm_input_axes=("batch", "seq", "embed"),
        dot_1_input_axes=("batch", "seq", "embed"),
        dot_2_input_axes=("batch", "seq", "mlp"),
        transpose_batch_sequence=True,  # per-token math: no effect
    )
    plain = lf.LayerNormMLP(intermediate_dim=F, intermediate_dropout_rate=0.0)
    v = plain.init(jax.random.PRNGKey(0), x)
    out = lf.LayerNormMLP(intermediate_dim=F, intermediate_dropout_rate=0.0, **axes).apply(v, x)[0]
    np.testing.assert_array_equal(out, plain.apply(v, x)[0])
