"""DotProductAttention / MultiHeadAttention / RelativePositionBiases / rotary embeddings with
TransformerEngine's fields: every feature against a float64 plain-jnp reference written here
(forward and gradients, without a recipe and under FP8 recipes), TE's parameter layout (names,
shapes, logical axes) written out by hand from TE's transformer.py, TE's field order and defaults,
the causal softmax fallback for Sq != Sk, cuDNN's dropout path (GPU), and clear errors."""

from __future__ import annotations

import dataclasses
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn, rel
from test_flax_modules import RECIPES, _ln, check_module

import lowbit
import lowbit.te.flax as te_flax
from lowbit.flax.attention import DotProductAttention, MultiHeadAttention, attention_reference
from lowbit.flax.positions import RelativePositionBiases, rotary_pos_emb
from lowbit.te.softmax import SoftmaxFusionType
from lowbit.te.softmax import softmax as te_softmax

B, H, D = 2, 4, 8  # batch, heads, head_dim (tiny: CPU runs stay fast)
# (name, recipe, input dtype, relative-error bound of outputs, of gradients)
CASES = [
    ("f32", None, jnp.float32, 1e-5, 1e-5),
    ("bf16", None, jnp.bfloat16, 3e-2, 5e-2),
    ("delayed", RECIPES["delayed"], jnp.float32, 1e-1, 2.5e-1),
    ("current", RECIPES["current"], jnp.float32, 1e-1, 2.5e-1),
]
CASE_IDS = [c[0] for c in CASES]


# ---- float64 references ----------------------------------------------------------------------
def ref_mask(mask_type, window, sq, sk, padding=None):
    """True = masked out, (b|1, 1, sq, sk); built from the definitions, row by row."""
    out = np.zeros((1, 1, sq, sk), bool)
    for i in range(sq):
        ii = i + (sk - sq if "bottom_right" in mask_type else 0)
        for j in range(sk):
            m = "causal" in mask_type and j > ii
            if window is not None:
                left, right = window
                m = m or (left >= 0 and j < ii - left) or (right >= 0 and j > ii + right)
            out[0, 0, i, j] = m
    if padding is not None:
        out = out | np.asarray(padding)
    return out


def ref_attention(q, k, v, masked, bias=None, bias_type="no_bias", scale=None):
    """q (b,sq,h,d), k/v (b,sk,g,d), float64; masked True = out."""
    h, g = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias_type == "pre_scale_bias":
        s = (s + bias) * scale
    elif bias_type == "post_scale_bias":
        s = s * scale + bias
    else:
        s = s * scale
    if masked is not None:
        s = jnp.where(masked, -jnp.inf, s)
    p = jax.nn.softmax(s, -1)
    if masked is not None:
        p = jnp.where(masked, 0.0, p)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.nan_to_num(p), v)


def ref_rotary(x, windows, seq_axis, method):
    """Rotation of coordinate pairs by position / timescale_i, pairs (2i, 2i+1) or (i, i+d/2)."""
    d = x.shape[-1]
    half = d // 2
    lo, hi = windows
    ts = np.array([lo * (hi / lo) ** (2 * i / d) for i in range(half)])
    pos = np.arange(x.shape[seq_axis])
    ang = pos[:, None] / ts[None, :]
    shape = [1] * x.ndim
    shape[seq_axis], shape[-1] = len(pos), half
    c, s = jnp.asarray(np.cos(ang).reshape(shape)), jnp.asarray(np.sin(ang).reshape(shape))
    if method == "consecutive":
        a, b = x[..., 0::2], x[..., 1::2]
        ra, rb = a * c - b * s, a * s + b * c
        return jnp.stack([ra, rb], -1).reshape(x.shape)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, a * s + b * c], -1)


def ref_lora(a, x, alpha=None):
    """TE's adapter of one projection, one per slot of a fused kernel: ``x . A_s . B_s * alpha/r``
    (A (hidden, [n,] r), B ([n,] r, f)); 0 without one."""
    if "lora_a_kernel" not in a:
        return 0.0
    la, lb = a["lora_a_kernel"], a["lora_b_kernel"]
    s = 1.0 if alpha is None else alpha / la.shape[-1]
    if la.ndim == 3:
        return s * jnp.einsum("bsh,hnr,nrf->bsnf", x, la, lb)
    return s * (x @ la @ lb)


def ref_mha(p, xq, xkv, cfg, masked, bias=None):
    """TE's MultiHeadAttention in float64 from the params (batch-first inputs)."""
    h, g, d = cfg["h"], cfg["g"], D
    alpha = cfg.get("lora_alpha")
    self_attn = xkv is None
    if "qkv" in p:
        a = p["qkv"]
        y = _ln(xq, a["scale"], a["ln_bias"])
        qkv = jnp.einsum("bsh,hnf->bsnf", y, a["kernel"]) + (a["bias"] if "bias" in a else 0)
        qkv = qkv + ref_lora(a, y, alpha)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        a = p["query"]
        y = _ln(xq, a["scale"], a["ln_bias"])
        q = y @ a["kernel"] + (a["bias"] if "bias" in a else 0) + ref_lora(a, y, alpha)
        src = y if self_attn else xkv
        if "kv" in p:
            kv = jnp.einsum("bsh,hnf->bsnf", src, p["kv"]["kernel"]) + (
                p["kv"]["bias"] if "bias" in p["kv"] else 0
            )
            kv = kv + ref_lora(p["kv"], src, alpha)
            k, v = kv[..., 0, :], kv[..., 1, :]
        else:
            k = src @ p["key"]["kernel"] + (p["key"]["bias"] if "bias" in p["key"] else 0)
            v = src @ p["value"]["kernel"] + (p["value"]["bias"] if "bias" in p["value"] else 0)
            k, v = k + ref_lora(p["key"], src, alpha), v + ref_lora(p["value"], src, alpha)
    q = q.reshape(q.shape[:2] + (h, d))
    k, v = k.reshape(k.shape[:2] + (g, d)), v.reshape(v.shape[:2] + (g, d))
    if cfg.get("rotary"):
        q = ref_rotary(q, (1, 10000), 1, cfg["rotary"])
        k = ref_rotary(k, (1, 10000), 1, cfg["rotary"])
    scale = 1 / math.sqrt(d) if cfg.get("scale_attn_logits") else 1.0
    o = ref_attention(q, k, v, masked, bias, "post_scale_bias" if bias is not None else "no_bias", scale)
    o = o.reshape(o.shape[:2] + (h * d,))
    out = o @ p["out"]["kernel"] + (p["out"]["bias"] if "bias" in p["out"] else 0)
    return out + ref_lora(p["out"], o, alpha)


def _grad_check(f_mod, f_ref, args, dy, tol_out, tol_grad):
    out, grads = jax.jit(
        lambda *a: (f_mod(*a), jax.grad(lambda *a: jnp.vdot(f_mod(*a), dy), range(len(a)))(*a))
    )(*args)
    with jax.enable_x64(True):
        a64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        dy64 = jnp.asarray(np.asarray(dy, np.float64))
        r = f_ref(*a64)
        rg = jax.grad(lambda *a: jnp.vdot(f_ref(*a), dy64), range(len(a64)))(*a64)
    assert rel(out, r) < tol_out, f"forward {rel(out, r)}"
    for i, (g, gr) in enumerate(zip(grads, rg)):
        assert rel(g, gr) < tol_grad, f"grad {i}: {rel(g, gr)}"


# ---- DotProductAttention ----------------------------------------------------------------------
MASK_TYPES = [
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
]


@pytest.mark.parametrize("mask_type", MASK_TYPES)
@pytest.mark.parametrize(
    "window",
    [
        None,
        pytest.param((2, 0), marks=pytest.mark.slow),
        pytest.param((1, 2), marks=pytest.mark.slow),
        pytest.param((-1, 1), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("sq,sk", [(8, 8), (6, 10)])
def test_dpa_masks_and_windows(mask_type, window, sq, sk):
    g = 2
    q, k, v = randn((B, sq, H, D), 1), randn((B, sk, g, D), 2), randn((B, sk, g, D), 3)
    pad = np.zeros((B, 1, sq, sk), bool)
    pad[1, :, :, sk - 3 :] = True  # batch 1: the last 3 keys are padding
    padding = mask_type.startswith("padding")
    masked = ref_mask(mask_type, window, sq, sk, pad if padding else None)
    # rows with a key left; a row with every key masked out has an unspecified output
    live = np.broadcast_to(~masked.all(-1, keepdims=True), (B, 1, sq, 1)).transpose(0, 2, 1, 3)
    assert live.mean() > 0.6
    dy = randn((B, sq, H, D), 4)
    m = DotProductAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        attn_mask_type=mask_type,
        window_size=window,
        transpose_batch_sequence=False,
    )
    mask = jnp.asarray(pad) if padding else None
    _grad_check(
        lambda q, k, v: m.apply({}, q, k, v, mask) * live,
        lambda q, k, v: ref_attention(q, k, v, jnp.asarray(masked)) * live,
        (q, k, v),
        dy,
        1e-5,
        1e-5,
    )


def test_dpa_default_is_batch_first_as_te_2_10():
    """TE >= 2.10: transpose_batch_sequence None -> False. A default module given TE-default
    (batch, seq, heads, dim) inputs attends over the sequence (old default True: over the batch)."""
    m = DotProductAttention(head_dim=D, num_attention_heads=H)
    assert m.transpose_batch_sequence is False
    q, k, v = randn((B, 8, H, D), 1), randn((B, 8, H, D), 2), randn((B, 8, H, D), 3)
    out = m.apply({}, q, k, v)
    with jax.enable_x64(True):
        ref = ref_attention(
            *(jnp.asarray(np.asarray(t, np.float64)) for t in (q, k, v)),
            jnp.asarray(ref_mask("causal", None, 8, 8)),
        )
    assert out.shape == (B, 8, H, D) and rel(out, ref) < 1e-5


def test_dpa_transpose_batch_sequence_and_gqa():
    q, k, v = randn((B, 8, H, D), 1), randn((B, 8, 1, D), 2), randn((B, 8, 1, D), 3)
    m = DotProductAttention(
        head_dim=D, num_attention_heads=H, num_gqa_groups=1, transpose_batch_sequence=True
    )
    sw = lambda t: jnp.swapaxes(t, 0, 1)  # noqa: E731
    out = m.apply({}, sw(q), sw(k), sw(v))  # (seq, batch, ...) in and out
    with jax.enable_x64(True):
        ref = ref_attention(
            *(jnp.asarray(np.asarray(t, np.float64)) for t in (q, k, v)),
            jnp.asarray(ref_mask("causal", None, 8, 8)),
        )
    assert rel(sw(out), ref) < 1e-5


@pytest.mark.parametrize("bias_type", [None, "no_bias", "pre_scale_bias", "post_scale_bias"])
def test_dpa_bias_types(bias_type):
    q, k, v = randn((B, 8, H, D), 1), randn((B, 8, H, D), 2), randn((B, 8, H, D), 3)
    bias = randn((1, H, 8, 8), 5)
    use_bias = bias_type not in ("no_bias",)
    m = DotProductAttention(
        head_dim=D,
        num_attention_heads=H,
        attn_mask_type="no_mask",
        attn_bias_type=bias_type,
        scale_factor=0.5,
        transpose_batch_sequence=False,
    )
    kind = "post_scale_bias" if bias_type is None else bias_type
    _grad_check(
        lambda q, k, v, b: m.apply({}, q, k, v, None, b if use_bias else None),
        lambda q, k, v, b: ref_attention(q, k, v, None, b, kind, 0.5),
        (q, k, v, bias),
        randn((B, 8, H, D), 4),
        1e-5,
        1e-5,
    )


def test_dpa_qkv_layouts():
    q, k, v = randn((B, 8, H, D), 1), randn((B, 8, H, D), 2), randn((B, 8, H, D), 3)
    kw = dict(head_dim=D, num_attention_heads=H, transpose_batch_sequence=False)
    ref = DotProductAttention(**kw).apply({}, q, k, v)
    packed = DotProductAttention(**kw, qkv_layout="bs3hd").apply({}, jnp.stack([q, k, v], 2), None, None)
    kvp = DotProductAttention(**kw, qkv_layout="BSHD_BS2HD").apply({}, q, jnp.stack([k, v], 2), None)
    np.testing.assert_allclose(packed, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kvp, ref, rtol=1e-6, atol=1e-6)
    # the sequence-descriptor argument takes the mask; ``mask=`` too (TE's deprecated keyword)
    pad = jnp.zeros((B, 1, 8, 8), bool).at[1, :, :, 5:].set(True)
    mp = DotProductAttention(**kw, attn_mask_type="padding")
    np.testing.assert_array_equal(mp.apply({}, q, k, v, pad), mp.apply({}, q, k, v, mask=pad))
    assert rel(mp.apply({}, q, k, v, pad), ref) > 1e-3


@pytest.mark.slow
def test_dpa_dropout_reference_path_and_rng():
    """CPU: logits -> softmax -> dropout from dropout_rng_name's stream -> values."""
    b, s, g, rate = 2, 8, 2, 0.3
    q, k, v = randn((b, s, H, D), 1), randn((b, s, g, D), 2), randn((b, s, g, D), 3)
    key = jax.random.PRNGKey(9)
    masked = jnp.asarray(ref_mask("causal", None, s, s))
    out = attention_reference(q, k, v, masked, None, "no_bias", 1 / math.sqrt(D), rate, key)
    keep = jax.random.bernoulli(key, 1 - rate, (b, H, s, s))
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(np.asarray(t, np.float64)) for t in (q, k, v))
        kk, vv = jnp.repeat(k64, 2, 2), jnp.repeat(v64, 2, 2)
        sc = jnp.where(masked, -jnp.inf, jnp.einsum("bqhd,bkhd->bhqk", q64, kk) / math.sqrt(D))
        p = jax.nn.softmax(sc, -1)
        ref = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(jnp.asarray(keep), p / (1 - rate), 0), vv)
    assert rel(out, ref) < 1e-5
    m = DotProductAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        attention_dropout=rate,
        dropout_rng_name="attn_rng",
        transpose_batch_sequence=False,
    )
    o_det = m.apply({}, q, k, v, deterministic=True)
    o1 = m.apply({}, q, k, v, rngs={"attn_rng": jax.random.PRNGKey(1)})
    o2 = m.apply({}, q, k, v, rngs={"attn_rng": jax.random.PRNGKey(2)})
    assert rel(o1, o_det) > 1e-2 and rel(o1, o2) > 1e-2
    np.testing.assert_array_equal(o1, m.apply({}, q, k, v, rngs={"attn_rng": jax.random.PRNGKey(1)}))
    # unbiased: the mean over many keys approaches the deterministic output
    keys = jax.random.split(jax.random.PRNGKey(3), 400)
    mean = jax.jit(jax.vmap(lambda kk: m.apply({}, q, k, v, rngs={"attn_rng": kk})))(keys).mean(0)
    assert rel(mean, o_det) < 0.08
    with pytest.raises(Exception, match="attn_rng"):
        m.apply({}, q, k, v)  # dropout needs the named stream


@pytest.mark.gpu
def test_dpa_dropout_cudnn_fused(gpu_device):
    """GPU: with dropout, bf16 attention stays on cuDNN's fused kernel; rate 0 equals the
    no-dropout path; the mean over executions approaches it; ~rate of the probabilities drop;
    gradients are finite."""
    from lowbit.flax.attention import cudnn_attention_dropout

    b, s, d, rate = 2, 64, 64, 0.1
    q, k, v = (randn((b, s, H, d), i).astype(jnp.bfloat16) for i in (1, 2, 3))
    kw = dict(head_dim=d, num_attention_heads=H, transpose_batch_sequence=False, attn_mask_type="causal")
    det = DotProductAttention(**kw)
    o_det = jax.jit(lambda q, k, v: det.apply({}, q, k, v))(q, k, v)
    tri = jnp.asarray(ref_mask("causal", None, s, s))
    o0 = jax.jit(
        lambda q, k, v: cudnn_attention_dropout(q, k, v, tri, None, "no_bias", d**-0.5, 0.0, 7, True)
    )(q, k, v)
    assert rel(np.asarray(o0, np.float32), np.asarray(o_det, np.float32)) < 1e-2
    m = DotProductAttention(**kw, attention_dropout=rate, implementation="cudnn")
    f = jax.jit(lambda q, k, v, r: m.apply({}, q, k, v, rngs={"dropout": r}))
    txt = f.lower(q, k, v, jax.random.PRNGKey(0)).as_text()  # cuDNN's custom call, with dropout
    assert "SoftmaxDropout" in txt and "__cudnn$fmha" in txt, "dropout left cuDNN's fused attention"
    outs = np.stack([np.asarray(f(q, k, v, jax.random.PRNGKey(i)), np.float32) for i in range(200)])
    assert rel(outs[0], o_det) > 1e-2  # dropout happened
    assert rel(outs[0], outs[1]) > 1e-2  # a new mask per execution
    assert rel(outs.mean(0), np.asarray(o_det, np.float32)) < 0.05
    # fraction dropped: q = k = 0 gives uniform probabilities; value = identity reads them out
    z = jnp.zeros((b, s, H, s), jnp.bfloat16)
    eye = jnp.broadcast_to(jnp.eye(s, dtype=jnp.bfloat16)[None, :, None, :], (b, s, H, s))
    mn = DotProductAttention(
        head_dim=s,
        num_attention_heads=H,
        transpose_batch_sequence=False,
        attn_mask_type="no_mask",
        attention_dropout=rate,
    )
    p = np.asarray(
        jax.jit(lambda z, e: mn.apply({}, z, z, e, rngs={"dropout": jax.random.PRNGKey(0)}))(z, eye),
        np.float32,
    )
    frac = float((p == 0).mean())
    assert abs(frac - rate) < 0.02, frac
    np.testing.assert_allclose(p[p != 0], 1 / (s * (1 - rate)), rtol=2e-2)
    g = jax.jit(
        jax.grad(
            lambda q: jnp.sum(
                m.apply({}, q, k, v, rngs={"dropout": jax.random.PRNGKey(0)}).astype(jnp.float32)
            )
        )
    )(q)
    assert np.isfinite(np.asarray(g, np.float32)).all()


# ---- softmax: causal with Sq != Sk --------------------------------------------------------------
@pytest.mark.parametrize("sq,sk", [(6, 10), (10, 6)])
def test_softmax_causal_fallback_non_square(sq, sk):
    x = randn((2, 3, sq, sk), 1)
    tri = ref_mask("causal", None, sq, sk)  # top-left, TransformerEngine's fallback

    def ref(x):
        p = jax.nn.softmax(jnp.where(tri, -jnp.inf, x * 0.7), -1)
        return jnp.where(tri, 0.0, p)

    _grad_check(
        lambda x: lowbit.softmax(x, 0.7, softmax_type="scaled_upper_triang_masked"),
        ref,
        (x,),
        randn(x.shape, 2),
        1e-5,
        1e-5,
    )
    y = te_softmax(x, None, 0.7, SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED)
    y2 = lowbit.flax.Softmax(scale_factor=0.7, softmax_fusion_type="scaled_upper_triang_masked").apply({}, x)
    with jax.enable_x64(True):
        r = ref(jnp.asarray(np.asarray(x, np.float64)))
    assert rel(y, r) < 1e-5 and rel(y2, r) < 1e-5


# ---- rotary and relative positions ------------------------------------------------------------
@pytest.mark.parametrize("method", ["consecutive", "alternate"])
@pytest.mark.parametrize("tbs", [False, True])
def test_rotary_pos_emb(method, tbs):
    x = randn((2, 7, 3, 8), 1)  # (b, s, h, d) or (s, b, h, d)
    _grad_check(
        lambda x: rotary_pos_emb(x, (1, 10000), tbs, method),
        lambda x: ref_rotary(x, (1, 10000), 0 if tbs else 1, method),
        (x,),
        randn(x.shape, 2),
        1e-5,
        1e-5,
    )
    other = "alternate" if method == "consecutive" else "consecutive"
    assert rel(rotary_pos_emb(x, (1, 10000), tbs, method), rotary_pos_emb(x, (1, 10000), tbs, other)) > 1e-2


def ref_bucket(n, num_buckets, max_distance, bidirectional):
    """T5's relative position bucket of n = query - key, scalar Python."""
    m, ret = num_buckets, 0
    if bidirectional:
        m //= 2
        ret += m if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = m // 2
    if n < exact:
        return ret + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (m - exact))
    return ret + min(large, m - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_biases(bidirectional):
    nb, md, q, k = 32, 128, 40, 300
    m = RelativePositionBiases(num_buckets=nb, max_distance=md, num_attention_heads=H)
    v = m.init(jax.random.PRNGKey(0), q, k, bidirectional)
    spec = nn.get_partition_spec(v)["params"]["rel_embedding"]
    assert spec == jax.sharding.PartitionSpec("heads", "relpos_buckets")
    table = nn.unbox(v)["params"]["rel_embedding"]
    assert table.shape == (H, nb)
    bucket = np.array([[ref_bucket(i - j, nb, md, bidirectional) for j in range(k)] for i in range(q)])
    out = m.apply(v, q, k, bidirectional)
    assert out.shape == (1, H, q, k)
    np.testing.assert_allclose(out[0], np.asarray(table)[:, bucket], rtol=1e-6)
    w = randn((1, H, q, k), 3)
    g = jax.grad(lambda t: jnp.vdot(m.apply({"params": {"rel_embedding": t}}, q, k, bidirectional), w))(table)
    ref = np.zeros((H, nb))
    np.add.at(ref.T, bucket.ravel(), np.asarray(w[0]).reshape(H, -1).T)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
    assert te_flax.RelativePositionBiases is RelativePositionBiases


# ---- MultiHeadAttention: TE's parameter layout ------------------------------------------------
W_FSDP, W_JOINED, W_TP, W_NO = "nvte_w_fsdp", "nvte_w_joined", "nvte_w_tp", "nvte_w_no_shard"
P = jax.sharding.PartitionSpec


def _ln_params(hidden):
    return {"scale": ((hidden,), P(W_NO)), "ln_bias": ((hidden,), P(W_NO))}


def expected_tree(hidden, h, g, d, self_attn, fuse, use_bias):
    """TE's transformer.py MultiHeadAttention params: name -> (shape, logical axes)."""
    t = {}
    if fuse and self_attn and g == h:
        t["qkv"] = {**_ln_params(hidden), "kernel": ((hidden, 3, h * d), P(W_FSDP, W_JOINED, W_TP))}
        if use_bias:
            t["qkv"]["bias"] = ((3, h * d), P(W_JOINED, W_TP))
    else:
        t["query"] = {**_ln_params(hidden), "kernel": ((hidden, h * d), P(W_FSDP, W_TP))}
        if use_bias:
            t["query"]["bias"] = ((h * d,), P(W_TP))
        if fuse:
            t["kv"] = {"kernel": ((hidden, 2, g * d), P(W_FSDP, W_JOINED, W_TP))}
            if use_bias:
                t["kv"]["bias"] = ((2, g * d), P(W_JOINED, W_TP))
        else:
            for n in ("key", "value"):
                t[n] = {"kernel": ((hidden, g * d), P(W_FSDP, W_TP))}
                if use_bias:
                    t[n]["bias"] = ((g * d,), P(W_TP))
    t["out"] = {"kernel": ((h * d, hidden), P(W_TP, W_FSDP))}
    if use_bias:
        t["out"]["bias"] = ((hidden,), P(W_NO))
    return t


@pytest.mark.parametrize("g", [4, 2, 1])
@pytest.mark.parametrize("self_attn", [True, False])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("use_bias", [False, True])
def test_mha_param_tree_matches_te(g, self_attn, fuse, use_bias):
    hidden = 32
    m = MultiHeadAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        fuse_qkv_params=fuse,
        use_bias=use_bias,
        transpose_batch_sequence=False,
        attn_mask_type="no_mask",
    )
    x = randn((B, 8, hidden), 1)
    kv = x if self_attn else randn((B, 5, hidden), 2)
    v = m.init(jax.random.PRNGKey(0), x, kv, deterministic=True)
    got = jax.tree_util.tree_map(lambda a: a.shape, nn.unbox(v["params"]))
    spec = nn.get_partition_spec(v)["params"]
    want = expected_tree(hidden, H, g, D, self_attn, fuse, use_bias)
    assert got == {k: {n: s for n, (s, _) in p.items()} for k, p in want.items()}
    assert spec == {k: {n: a for n, (_, a) in p.items()} for k, p in want.items()}


def test_mha_initialisation_as_te():
    """kernel_init default variance_scaling(1, fan_in, normal) per projection slot; the query
    slot divided by sqrt(head_dim) (scaled_query_init)."""
    hidden, d = 64, 16
    x = randn((2, 4, hidden), 1)
    for sqi in (True, False):
        m = MultiHeadAttention(
            head_dim=d, num_attention_heads=4, transpose_batch_sequence=False, scaled_query_init=sqi
        )
        k = nn.unbox(m.init(jax.random.PRNGKey(0), x, x, deterministic=True))["params"]["qkv"]["kernel"]
        std = np.asarray(k).std(axis=(0, 2))  # per slot q, k, v
        want_q = 1 / math.sqrt(hidden) / (math.sqrt(d) if sqi else 1)
        np.testing.assert_allclose(std, [want_q, 1 / math.sqrt(hidden), 1 / math.sqrt(hidden)], rtol=0.1)


def test_mha_lora_scope_output_proj():
    m = MultiHeadAttention(
        head_dim=D,
        num_attention_heads=H,
        transpose_batch_sequence=False,
        low_rank_adaptation_scope="output_proj",
        low_rank_adaptation_dim=4,
    )
    x = randn((B, 8, 32), 1)
    p = nn.unbox(m.init(jax.random.PRNGKey(0), x, x, deterministic=True))["params"]
    assert p["out"]["lora_a_kernel"].shape == (H * D, 4) and p["out"]["lora_b_kernel"].shape == (4, 32)
    assert "lora_a_kernel" not in p["qkv"]


# ---- MultiHeadAttention: forward and gradients vs float64 -------------------------------------
MHA_CONFIGS = {
    # self-attention, fused qkv, rotary (consecutive pairs), causal
    "mha_rotary": dict(h=H, g=H, fuse=True, self=True, rotary="consecutive", mask_type="causal"),
    # GQA self-attention: query + kv, rotary (alternate), padding_causal + sliding window
    "gqa_window": dict(
        h=H, g=2, fuse=True, self=True, rotary="alternate", mask_type="padding_causal", window=(3, 0)
    ),
    # cross-attention (sk != sq), unfused key/value, padding, scaled logits, a post-scale bias;
    # no projection biases (the key bias's gradient is exactly zero: relative errors are noise)
    "cross": dict(
        h=H,
        g=2,
        fuse=False,
        self=False,
        mask_type="padding",
        scale_attn_logits=True,
        bias=True,
        use_bias=False,
    ),
}


@pytest.mark.parametrize(
    "cfg_name", [pytest.param(c, marks=pytest.mark.slow) if c == "cross" else c for c in MHA_CONFIGS]
)
@pytest.mark.parametrize(
    "name,recipe,dtype,tol_out,tol_grad",
    [c if c[0] == "f32" else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
    ids=CASE_IDS,
)
def test_mha_against_reference(cfg_name, name, recipe, dtype, tol_out, tol_grad):
    cfg = MHA_CONFIGS[cfg_name]
    if not cfg["self"] and dtype != jnp.float32:
        pytest.skip(
            "check_module initialises with float32 inputs_q; inputs_kv must have its dtype (as in TE)"
        )
    hidden, sq = 32, 8
    sk = sq if cfg["self"] else 6
    m = MultiHeadAttention(
        head_dim=D,
        num_attention_heads=cfg["h"],
        num_gqa_groups=cfg["g"],
        fuse_qkv_params=cfg["fuse"],
        use_bias=cfg.get("use_bias", True),
        attn_mask_type=cfg["mask_type"],
        window_size=cfg.get("window"),
        enable_rotary_pos_emb="rotary" in cfg,
        rotary_pos_emb_group_method=cfg.get("rotary", "consecutive"),
        scale_attn_logits=cfg.get("scale_attn_logits", False),
        transpose_batch_sequence=False,
    )
    x = randn((B, sq, hidden), 1)
    kv = None if cfg["self"] else randn((B, sk, hidden), 2).astype(dtype)
    pad = np.zeros((B, 1, sq, sk), bool)
    pad[1, :, :, sk - 2 :] = True
    masked = ref_mask(
        cfg["mask_type"], cfg.get("window"), sq, sk, pad if "padding" in cfg["mask_type"] else None
    )
    bias = randn((1, H, sq, sk), 7) if cfg.get("bias") else None
    extra = (kv, jnp.asarray(pad), bias)

    def ref(p, x):
        kv64 = None if kv is None else jnp.asarray(np.asarray(kv, np.float64))
        b64 = None if bias is None else jnp.asarray(np.asarray(bias, np.float64))
        return ref_mha(p, x, kv64, cfg, jnp.asarray(masked), b64)

    check_module(
        m, x, ref, recipe, dtype, tol_out, tol_grad, extra_args=extra, apply_kw={"deterministic": True}
    )


def test_mha_transpose_batch_sequence():
    """transpose_batch_sequence=True (TE's default before 2.10; now None -> False):
    (seq, batch, hidden) in and out, the same math as batch-first."""
    assert MultiHeadAttention(head_dim=D, num_attention_heads=H).transpose_batch_sequence is False
    kw = dict(head_dim=D, num_attention_heads=H, num_gqa_groups=2, enable_rotary_pos_emb=True)
    x = randn((B, 8, 32), 1)
    mb = MultiHeadAttention(**kw)
    ms = MultiHeadAttention(**kw, transpose_batch_sequence=True)
    v = mb.init(jax.random.PRNGKey(0), x, x, deterministic=True)
    yb, lnb = mb.apply(v, x, x, deterministic=True)
    xs = jnp.swapaxes(x, 0, 1)
    ys, lns = ms.apply(v, xs, xs, deterministic=True)
    np.testing.assert_allclose(jnp.swapaxes(ys, 0, 1), yb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.swapaxes(lns, 0, 1), lnb, rtol=1e-6, atol=1e-6)


def test_mha_encoder_decoder_attention_as_transformer_layer_calls_it():
    """TE's TransformerLayer decoder: cross-attention with TE's keywords, inputs_kv = encoded."""
    x, enc = randn((B, 8, 32), 1), randn((B, 5, 32), 2)
    mask = jnp.zeros((B, 1, 8, 5), bool).at[1, :, :, 4:].set(True)
    m = MultiHeadAttention(
        num_attention_heads=H,
        dtype=jnp.float32,
        head_dim=D,
        num_gqa_groups=H,
        transpose_batch_sequence=False,
        enable_sequence_parallel=False,
        attention_dropout=0.1,
        dropout_rng_name="dropout",
        layernorm_type="layernorm",
        layernorm_epsilon=1e-6,
        zero_centered_gamma=False,
        return_layernorm_output=True,
        input_layernorm=True,
        attn_mask_type="padding",
        attn_bias_type="no_bias",
        enable_rotary_pos_emb=False,
        low_rank_adaptation_scope="none",
        float32_logits=False,
        scale_attn_logits=False,
        scaled_query_init=True,
        fuse_qkv_params=True,
        use_bias=False,
        window_size=None,
        name="encoder_decoder_attention",
    )
    v = m.init(jax.random.PRNGKey(0), x, enc, mask, deterministic=True)
    assert set(v["params"]) == {"query", "kv", "out"}
    out, ln_out = m.apply(v, x, enc, mask, deterministic=True)
    assert out.shape == x.shape and ln_out.shape == x.shape
    out2, _ = m.apply(v, x, enc.at[1, 4:].set(99.0), mask, deterministic=True)  # padded keys do not matter
    np.testing.assert_allclose(out2, out, rtol=1e-5, atol=1e-5)


# ---- TE's field order and defaults ------------------------------------------------------------
def _fields(cls):
    return [(f.name, f.default) for f in dataclasses.fields(cls) if f.name not in ("parent", "name")]


def test_field_order_and_defaults_match_te():
    dpa = _fields(DotProductAttention)
    assert dpa[:23] == [
        ("head_dim", dataclasses.MISSING),
        ("num_attention_heads", dataclasses.MISSING),
        ("num_gqa_groups", None),
        ("attention_dropout", 0.0),
        ("attn_mask_type", "causal"),
        ("attn_bias_type", None),
        ("dtype", jnp.float32),
        ("dropout_rng_name", "dropout"),
        ("float32_logits", False),
        ("qkv_layout", "bshd_bshd_bshd"),
        ("scale_factor", None),
        ("transpose_batch_sequence", None),
        ("window_size", None),
        ("max_segments_per_seq", 1),
        ("context_parallel_causal_load_balanced", False),
        ("context_parallel_axis", ""),
        ("context_parallel_strategy", "DEFAULT"),
        ("context_checkpoint_name", "context"),
        ("softmax_type", "vanilla"),
        ("score_mod", None),
        ("score_mod_bprop", None),
        ("return_max_logit", False),
        ("implementation", None),  # lowbit's, after TE's fields
    ]
    mha = _fields(MultiHeadAttention)
    names = [n for n, _ in mha]
    assert names == [
        "head_dim",
        "num_attention_heads",
        "num_gqa_groups",
        "attention_dropout",
        "dropout_rng_name",
        "input_layernorm",
        "layernorm_type",
        "layernorm_epsilon",
        "return_layernorm_output",
        "zero_centered_gamma",
        "kernel_init",
        "use_bias",
        "bias_init",
        "attn_mask_type",
        "attn_bias_type",
        "enable_rotary_pos_emb",
        "rotary_pos_emb_windows",
        "rotary_pos_emb_group_method",
        "low_rank_adaptation_scope",
        "low_rank_adaptation_dim",
        "low_rank_adaptation_alpha",
        "dtype",
        "fuse_qkv_params",
        "transpose_batch_sequence",
        "enable_sequence_parallel",
        "scale_attn_logits",
        "scaled_query_init",
        "float32_logits",
        "window_size",
        "softmax_type",
        "score_mod",
        "score_mod_bprop",
        "num_heads",
        "dropout_rate",
        "output_layernorm",
        "apply_residual_connection_post_layernorm",
        "fuse_qkv",
    ]
    d = dict(mha)
    assert d["attention_dropout"] == 0.0 and d["input_layernorm"] is True and d["layernorm_epsilon"] == 1e-6
    assert d["kernel_init"] is None and d["use_bias"] is False and d["attn_mask_type"] == "causal"
    assert d["rotary_pos_emb_windows"] == (1, 10000) and d["rotary_pos_emb_group_method"] == "consecutive"
    assert d["low_rank_adaptation_scope"] == "none" and d["low_rank_adaptation_dim"] == 32
    assert d["fuse_qkv_params"] is True and d["transpose_batch_sequence"] is None
    assert d["scale_attn_logits"] is False and d["scaled_query_init"] is True and d["float32_logits"] is False
    rpb = _fields(RelativePositionBiases)
    assert [n for n, _ in rpb] == [
        "num_buckets",
        "max_distance",
        "num_attention_heads",
        "embedding_init",
        "embedding_axes",
        "dtype",
    ]
    assert dict(rpb)["embedding_axes"] == ("heads", "relpos_buckets")
    # positional construction in TE's order
    assert MultiHeadAttention(8, 4).head_dim == 8 and DotProductAttention(8, 4, 2).num_gqa_groups == 2


def test_deprecated_fields():
    x = randn((B, 8, 32), 1)
    m = MultiHeadAttention(head_dim=D, num_attention_heads=2, num_heads=H, transpose_batch_sequence=False)
    with pytest.warns(DeprecationWarning, match="num_heads is deprecated"):
        v = m.init(jax.random.PRNGKey(0), x, x, deterministic=True)
    assert nn.unbox(v)["params"]["qkv"]["kernel"].shape == (32, 3, H * D)
    with pytest.raises(ValueError, match="output_layernorm is deprecated"):
        MultiHeadAttention(head_dim=D, num_attention_heads=H, output_layernorm=True).init(
            jax.random.PRNGKey(0), x, x
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiHeadAttention(head_dim=D, num_attention_heads=H).init(
            jax.random.PRNGKey(0), x, x, deterministic=True
        )


# ---- clear errors ------------------------------------------------------------------------------
def test_errors_name_the_field():
    q = randn((B, 8, H, D), 1)  # batch-first: the default since TE 2.10
    x = randn((B, 8, 32), 1)

    def dpa(**kw):
        return lambda *a, **k: DotProductAttention(head_dim=D, num_attention_heads=H, **kw).apply({}, *a, **k)

    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        dpa(attn_mask_type="sliding")(q, q, q)
    with pytest.raises(ValueError, match="attn_bias_type must be one of"):
        dpa(attn_bias_type="alibi")(q, q, q)
    with pytest.raises(ValueError, match="attn_bias_type='no_bias' but a bias"):
        dpa(attn_bias_type="no_bias")(q, q, q, None, jnp.zeros((1, H, 8, 8)))
    with pytest.raises(ValueError, match="attn_bias_type='pre_scale_bias' needs a bias"):
        dpa(attn_bias_type="pre_scale_bias")(q, q, q)
    with pytest.raises(ValueError, match="THD layouts .* need a SequenceDescriptor"):
        dpa(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal")(q, q, q, jnp.zeros((B, 1, 8, 8), bool))
    with pytest.raises(ValueError, match="qkv_layout must be one of"):
        dpa(qkv_layout="sbhd")(q, q, q)
    with pytest.raises(ValueError, match="max_segments_per_seq must be a positive int"):
        dpa(max_segments_per_seq=0)(q, q, q)
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        dpa(softmax_type="sparsemax")(q, q, q)
    with pytest.raises(ValueError, match="context_parallel_strategy must be one of"):
        dpa(context_parallel_strategy="tree")(q, q, q)
    with pytest.raises(ValueError, match="window_size must be None or a pair"):
        dpa(window_size=3)(q, q, q)
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\)"):
        dpa(attention_dropout=1.0)(q, q, q)
    with pytest.raises(TypeError, match="SequenceDescriptor"):
        dpa(attn_mask_type="padding")(q, q, q, object())
    with pytest.raises(ValueError, match="cannot be provided at the same time"):
        dpa(attn_mask_type="padding")(
            q, q, q, jnp.zeros((B, 1, 8, 8), bool), mask=jnp.zeros((B, 1, 8, 8), bool)
        )
    with pytest.raises(ValueError, match="bias must have shape"):
        dpa()(q, q, q, None, jnp.zeros((H, 8, 8)))

    def mha(**kw):
        m = MultiHeadAttention(head_dim=D, num_attention_heads=H, transpose_batch_sequence=False, **kw)
        return lambda *a, **k: m.init(jax.random.PRNGKey(0), *a, **k)

    with pytest.raises(ValueError, match="rotary_pos_emb_group_method must be one of"):
        mha(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="interleaved")(x, x)
    with pytest.raises(ValueError, match="rotary_pos_emb_windows must be a pair"):
        mha(enable_rotary_pos_emb=True, rotary_pos_emb_windows=(0, 10))(x, x)
    with pytest.raises(ValueError, match="low_rank_adaptation_scope must be one of"):
        mha(low_rank_adaptation_scope="qkv")(x, x)
    with pytest.raises(ValueError, match="decode=True: each step takes one position"):
        m = MultiHeadAttention(head_dim=D, num_attention_heads=H, transpose_batch_sequence=False)
        v = m.init(jax.random.PRNGKey(0), x, x, decode=True, deterministic=True)
        m.apply(v, x, x, decode=True, deterministic=True, mutable=["cache"])
    with pytest.raises(ValueError, match="same dtype"):
        mha()(x, x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"num_gqa_groups \(3\) must be a positive divisor"):
        mha(num_gqa_groups=3)(x, x)
    with pytest.raises(ValueError, match="num_buckets must be a positive int"):
        RelativePositionBiases(num_buckets=0, max_distance=8, num_attention_heads=H).init(
            jax.random.PRNGKey(0), 4, 4
        )


@pytest.mark.parametrize(
    "g,fuse",
    [
        (H, True),
        pytest.param(2, True, marks=pytest.mark.slow),
        pytest.param(2, False, marks=pytest.mark.slow),
    ],
    ids=["qkv", "query+kv", "unfused"],
)
@pytest.mark.parametrize(
    "name,recipe,dtype,tol_out,tol_grad",
    [CASES[0], pytest.param(*CASES[3], marks=pytest.mark.slow)],
    ids=["f32", "current"],
)
def test_mha_lora_as_te(g, fuse, name, recipe, dtype, tol_out, tol_grad):
    """low_rank_adaptation_scope="all": TE's adapters, one per slot of the fused kernels (qkv
    ``(H, 3, r)``/``(3, r, h*d)``, kv ``(H, 2, r)``/``(2, r, g*d)``), forward and gradients
    against the float64 reference (B randomised by check_module so every adapter carries signal)."""
    r, alpha, hidden = 4, 2.0, 32
    m = MultiHeadAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        fuse_qkv_params=fuse,
        transpose_batch_sequence=False,
        low_rank_adaptation_scope="all",
        low_rank_adaptation_dim=r,
        low_rank_adaptation_alpha=alpha,
    )
    x = randn((B, 8, hidden), 1)
    cfg = dict(h=H, g=g, lora_alpha=alpha)
    masked = jnp.asarray(ref_mask("causal", None, 8, 8))
    v = check_module(
        m,
        x,
        lambda p, x: ref_mha(p, x, None, cfg, masked),
        recipe,
        dtype,
        tol_out,
        tol_grad,
        apply_kw={"deterministic": True},
    )
    shapes = jax.tree_util.tree_map(jnp.shape, v["params"])
    lora = {
        k: (shapes[k]["lora_a_kernel"], shapes[k]["lora_b_kernel"])
        for k in shapes
        if "lora_a_kernel" in shapes[k]
    }
    if g == H:
        want = {"qkv": ((hidden, 3, r), (3, r, H * D))}
    elif fuse:
        want = {"query": ((hidden, r), (r, H * D)), "kv": ((hidden, 2, r), (2, r, g * D))}
    else:
        want = {
            "query": ((hidden, r), (r, H * D)),
            "key": ((hidden, r), (r, g * D)),
            "value": ((hidden, r), (r, g * D)),
        }
    assert lora == {**want, "out": ((H * D, r), (r, hidden))}


def test_mha_lora_fused_init_as_te():
    """TE initialises the fused adapter's A with the kernel's initialiser (per slot, the query
    slot divided by sqrt(head_dim) with scaled_query_init) and B with zeros: the adapter starts
    as a no-op."""
    m = MultiHeadAttention(
        head_dim=16,
        num_attention_heads=4,
        transpose_batch_sequence=False,
        low_rank_adaptation_scope="qkv_proj",
        low_rank_adaptation_dim=64,
    )
    x = randn((B, 8, 256), 1)
    p = nn.unbox(m.init(jax.random.PRNGKey(0), x, x, deterministic=True))["params"]["qkv"]
    std = np.asarray(p["lora_a_kernel"]).std(axis=(0, 2))
    np.testing.assert_allclose(std, [1 / 16 / 4, 1 / 16, 1 / 16], rtol=0.1)
    assert not np.asarray(p["lora_b_kernel"]).any()


def test_dropout_falls_back_when_cudnn_refuses(monkeypatch):
    """Where cuDNN cannot take the call at trace time the reference dropout path runs (same
    output as without the cuDNN attempt); forcing implementation='cudnn' surfaces the error."""
    import lowbit.flax.attention as attn

    q = randn((2, 8, H, 16), 1).astype(jnp.bfloat16)
    m = DotProductAttention(
        head_dim=16, num_attention_heads=H, attention_dropout=0.2, transpose_batch_sequence=False
    )
    rngs = {"dropout": jax.random.PRNGKey(0)}
    ref = m.apply({}, q, q, q, rngs=rngs)
    monkeypatch.setattr(attn, "_default_is_gpu", lambda: True)  # pretend: cuDNN is tried first
    np.testing.assert_array_equal(m.apply({}, q, q, q, rngs=rngs), ref)
    forced = DotProductAttention(
        head_dim=16,
        num_attention_heads=H,
        attention_dropout=0.2,
        transpose_batch_sequence=False,
        implementation="cudnn",
    )
    if not jax.devices()[0].platform == "gpu":
        with pytest.raises(Exception, match="(?i)cudnn"):
            forced.apply({}, q, q, q, rngs=rngs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mask_type,window,bias_type,sq,sk",
    [
        ("causal", None, None, 64, 64),
        ("causal", (16, 0), None, 64, 64),
        ("padding_causal", None, "post_scale_bias", 64, 64),
        ("causal_bottom_right", None, None, 32, 64),
        ("padding", (8, 8), "pre_scale_bias", 48, 64),
        ("no_mask", None, None, 32, 64),
    ],
)
def test_dpa_gpu_cudnn_matches_xla(gpu_device, mask_type, window, bias_type, sq, sk):
    """bf16 on a GPU: the default path (cuDNN where it applies) equals implementation='xla',
    forward and gradients, for the mask types, windows and bias types."""
    d, g = 64, 2
    q = randn((B, sq, H, d), 1).astype(jnp.bfloat16)
    k, v = (randn((B, sk, g, d), i).astype(jnp.bfloat16) for i in (2, 3))
    pad = jnp.zeros((B, 1, sq, sk), bool).at[1, :, :, sk - 5 :].set(True)
    bias = randn((1, H, sq, sk), 4).astype(jnp.bfloat16) if bias_type else None
    masked = ref_mask(mask_type, window, sq, sk, np.asarray(pad) if mask_type.startswith("padding") else None)
    live = jnp.asarray(np.broadcast_to(~masked.all(-1, keepdims=True), (B, 1, sq, 1)).transpose(0, 2, 1, 3))
    kw = dict(
        head_dim=d,
        num_gqa_groups=g,
        num_attention_heads=H,
        attn_mask_type=mask_type,
        window_size=window,
        attn_bias_type=bias_type,
        transpose_batch_sequence=False,
    )
    dy = randn((B, sq, H, d), 5).astype(jnp.bfloat16)

    def run(impl):
        m = DotProductAttention(**kw, implementation=impl)

        def f(q, k, v):
            return (m.apply({}, q, k, v, pad, bias) * live).astype(jnp.float32)

        return jax.jit(
            lambda q, k, v: (
                f(q, k, v),
                jax.grad(lambda *a: jnp.vdot(f(*a), dy.astype(jnp.float32)), (0, 1, 2))(q, k, v),
            )
        )(q, k, v)

    out, grads = run(None)
    ref, rgrads = run("xla")
    assert rel(out, ref) < 2e-2
    for g1, g2 in zip(grads, rgrads):
        assert rel(np.asarray(g1, np.float32), np.asarray(g2, np.float32)) < 3e-2


@pytest.mark.parametrize("tbs", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "g,rotary,window", [(H, None, None), (2, "alternate", (2, 0)), (H, "consecutive", None)]
)
def test_mha_decode_steps_equal_full_causal(tbs, g, rotary, window):
    """decode=True: the init call sizes the cache; one position per call after that gives the
    full causal forward's rows (rotary at the cache position, window relative to it)."""
    L = 6
    m = MultiHeadAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        attn_mask_type="causal",
        enable_rotary_pos_emb=rotary is not None,
        rotary_pos_emb_group_method=rotary or "consecutive",
        window_size=window,
        transpose_batch_sequence=tbs,
    )
    x = randn((B, L, 32), 1)
    xs = jnp.swapaxes(x, 0, 1) if tbs else x
    v = m.init(jax.random.PRNGKey(0), xs, xs, decode=True, deterministic=True)
    params, cache = v["params"], v["cache"]
    assert set(cache) == {"cached_key", "cached_value", "cache_index"}
    full, _ = m.apply({"params": params}, xs, xs, deterministic=True)
    step = jax.jit(
        lambda c, xt: m.apply(
            {"params": params, "cache": c}, xt, xt, decode=True, deterministic=True, mutable=["cache"]
        )
    )
    outs = []
    for t in range(L):
        xt = xs[t : t + 1] if tbs else xs[:, t : t + 1]
        (o, _), mut = step(cache, xt)
        cache = mut["cache"]
        outs.append(o)
    dec = jnp.concatenate(outs, axis=0 if tbs else 1)
    np.testing.assert_allclose(dec, full, rtol=2e-5, atol=2e-5)
    assert int(cache["cache_index"]) == L


@pytest.mark.gpu
@pytest.mark.parametrize("wrap", ["plain", "lax.scan", "remat"])
def test_dpa_cudnn_dropout_forward_and_backward_masks_agree(gpu_device, wrap):
    """cuDNN regenerates the dropout mask in the backward from its seed and an offset that XLA
    advances per execution: the backward's mask must be the forward's, also when the forward is
    recomputed (remat) and when the attention runs in a loop (layers under lax.scan, where
    lowbit takes the reference path: cuDNN's dropout there aborts XLA). With q = k = 0 (uniform
    probabilities) and value = identity the output is the forward's dropped probability matrix;
    with dy = identity, dvalue is the backward's (transposed)."""
    scan = wrap == "lax.scan"
    b, s, rate, layers = 2, 64, 0.2, 3
    m = DotProductAttention(
        head_dim=s,
        num_attention_heads=H,
        attn_mask_type="no_mask",
        attention_dropout=rate,
        transpose_batch_sequence=False,
        implementation="cudnn",
    )
    z = jnp.zeros((b, s, H, s), jnp.bfloat16)
    eye = jnp.broadcast_to(jnp.eye(s, dtype=jnp.bfloat16)[None, :, None, :], (b, s, H, s))

    def one(v):
        return m.apply({}, z, z, v, rngs={"dropout": jax.random.PRNGKey(0)})

    if scan:
        vs = jnp.stack([eye] * layers)
        f = lambda vs: jax.lax.scan(lambda c, v: (c, one(v)), 0, vs)[1]  # noqa: E731
    else:
        vs, f = eye, (jax.checkpoint(one) if wrap == "remat" else one)
    txt = jax.jit(f).lower(vs).as_text()
    assert ("SoftmaxDropout" in txt) == (not scan), "cuDNN dropout inside a loop, or not used outside"

    def fwd_bwd(vs):
        out, vjp = jax.vjp(f, vs)
        return out, vjp(vs)[0]  # dy = identity as well

    for _ in range(2):  # a second execution: offsets have advanced
        out, dv = jax.jit(fwd_bwd)(vs)
        p_fwd = np.asarray(out, np.float32)
        p_bwd = np.asarray(jnp.swapaxes(dv, -3, -1), np.float32)
        assert abs(float((p_fwd == 0).mean()) - rate) < 0.03
        np.testing.assert_array_equal(p_fwd == 0, p_bwd == 0)


def test_dropout_takes_the_reference_path_inside_loops():
    """cuDNN's dropout aborts XLA inside loop bodies (lax.scan, jax 0.11.2 on the H100), so the
    attention asks whether it is traced in one; jit and remat are not loops."""
    from lowbit.flax.attention import _traced_in_loop

    seen = {}

    def note(tag, v):
        seen[tag] = _traced_in_loop()
        return v

    def f(x):
        note("jit", x)
        y = jax.lax.scan(lambda c, v: (c, note("scan", v)), 0, x)[1]
        y = jax.checkpoint(lambda v: note("remat", v))(y)
        y = jax.lax.fori_loop(0, 2, lambda i, v: note("fori_loop", v), y)
        y = jax.lax.while_loop(lambda v: v.sum() < 0, lambda v: note("while_loop", v), y)
        return jax.lax.map(lambda v: note("map", v), y)

    jax.jit(f)(jnp.ones((3, 2)))
    note("eager", None)
    assert seen == {
        "jit": False,
        "scan": True,
        "remat": False,
        "fori_loop": True,
        "while_loop": True,
        "map": True,
        "eager": False,
    }


def test_cudnn_dropout_needs_opt_in_or_command_buffers_without_cudnn(monkeypatch):
    """cuDNN's dropout crashes XLA when recorded into a command buffer (jax 0.11.2, H100), so by
    default dropout takes the reference path; implementation="cudnn", LOWBIT_CUDNN_DROPOUT=1 or
    XLA_FLAGS command buffers without CUDNN select the fused kernel."""
    from lowbit.flax.attention import _cudnn_dropout_allowed

    monkeypatch.delenv("LOWBIT_CUDNN_DROPOUT", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert not _cudnn_dropout_allowed(None)
    assert _cudnn_dropout_allowed("cudnn")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,CUBLASLT,CUDNN")
    assert not _cudnn_dropout_allowed(None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,CUBLASLT")
    assert _cudnn_dropout_allowed(None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert _cudnn_dropout_allowed(None)
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("LOWBIT_CUDNN_DROPOUT", "1")
    assert _cudnn_dropout_allowed(None)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_padding_types_without_a_mask_keep_every_position(mask_type):
    """TE: a padding mask type called without a mask (a decoder's cross-attention without
    encoder_decoder_mask) treats every position as valid; lowbit raised before."""
    q, k, v = randn((B, 8, H, D), 1), randn((B, 8, H, D), 2), randn((B, 8, H, D), 3)
    out = DotProductAttention(head_dim=D, num_attention_heads=H, attn_mask_type=mask_type).apply({}, q, k, v)
    plain = "causal" if "causal" in mask_type else "no_mask"
    with jax.enable_x64(True):
        ref = ref_attention(
            *(jnp.asarray(np.asarray(t, np.float64)) for t in (q, k, v)),
            jnp.asarray(ref_mask(plain, None, 8, 8)),
        )
    assert rel(out, ref) < 1e-5


def test_attention_softmax_type_vanilla_accepted():
    from lowbit.te.attention import AttnSoftmaxType

    q = randn((B, 8, H, D), 1)
    base = DotProductAttention(head_dim=D, num_attention_heads=H).apply({}, q, q, q)
    for st in ("vanilla", AttnSoftmaxType.VANILLA_SOFTMAX):
        m = DotProductAttention(head_dim=D, num_attention_heads=H, softmax_type=st)
        np.testing.assert_array_equal(m.apply({}, q, q, q), base)
