"""Packed sequences (issue 26): SequenceDescriptor in its three forms, the THD layouts, padding
and padding-causal masks (top-left and bottom-right) inside each document, in
DotProductAttention, MultiHeadAttention and TransformerLayer: the packed result equals attention
run per document (float64 reference, tests/attention_ref.py), gradients too; and the errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_ref import per_document64, segment_pos, to64
from helpers import randn, rel

from lowbit.flax.attention import DotProductAttention, MultiHeadAttention
from lowbit.flax.transformer import TransformerLayer
from lowbit.ops.attention import SequenceDescriptor

B, S, H, D = 2, 16, 4, 8
# Two packed rows: documents of several lengths, padding at the end (0) and between documents.
IDS = np.array(
    [
        [1, 1, 1, 2, 2, 2, 2, 2, 3, 0, 4, 4, 4, 4, 0, 0],
        [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 0],
    ],
    np.int32,
)


def _offsets(ids, n=5):
    """THD seqlens (b, n) and offsets (b, n + 1) of ``ids`` (-1 where unused)."""
    lens, offs = -np.ones((ids.shape[0], n), np.int32), -np.ones((ids.shape[0], n + 1), np.int32)
    for r, row in enumerate(ids):
        docs = [dd for dd in dict.fromkeys(row.tolist()) if dd]
        for i, doc in enumerate(docs):
            t = np.where(row == doc)[0]
            lens[r, i], offs[r, i] = len(t), t[0]
        offs[r, len(docs)] = len(row)
    return jnp.asarray(lens), jnp.asarray(offs)


def _desc(form, ids_q, ids_kv=None):
    ids_kv = ids_q if ids_kv is None else ids_kv
    if form == "ids":
        pq, pk = segment_pos(ids_q), segment_pos(ids_kv)
        return SequenceDescriptor.from_segment_ids_and_pos(
            (jnp.asarray(ids_q), jnp.asarray(ids_kv)), (jnp.asarray(pq), jnp.asarray(pk))
        )
    (lq, oq), (lk, ok) = _offsets(ids_q), _offsets(ids_kv)
    return SequenceDescriptor.from_seqlens_and_offsets((lq, lk), (oq, ok))


def _dpa(mask_type, g=H, **kw):
    return DotProductAttention(
        head_dim=D,
        num_attention_heads=H,
        num_gqa_groups=g,
        attn_mask_type=mask_type,
        qkv_layout="thd_thd_thd",
        transpose_batch_sequence=False,
        max_segments_per_seq=4,
        **kw,
    )


def _check(f, ref, args, ids_q):
    """Forward and the gradients of <out, dy> (dy zero on padding) against the float64 ref."""
    out, vjp = jax.vjp(f, *args)
    dy = randn(out.shape, 7) * jnp.asarray(ids_q != 0, jnp.float32)[:, :, None, None]
    with jax.enable_x64(True):
        a64 = to64(*args)
        r, rvjp = jax.vjp(ref, *a64)
        rg = rvjp(*to64(dy))
    valid = np.asarray(ids_q != 0)
    assert rel(np.asarray(out)[valid], np.asarray(r)[valid]) < 1e-5
    assert np.all(np.asarray(out)[~valid] == 0)  # padding queries output 0
    for got, want in zip(vjp(dy), rg):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("form", ["ids", "offsets"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("g", [H, 2], ids=["mha", "gqa"])
def test_packed_equals_per_document(form, mask_type, g):
    q, k, v = randn((B, S, H, D), 1), randn((B, S, g, D), 2), randn((B, S, g, D), 3)
    desc = _desc(form, IDS)
    m = _dpa(mask_type, g)
    scale = 1 / math.sqrt(D)

    def ref(q, k, v):
        return per_document64(q, k, v, IDS, IDS, scale, causal="causal" in mask_type)

    _check(lambda q, k, v: m.apply({}, q, k, v, desc), ref, (q, k, v), IDS)


def test_cross_attention_bottom_right_per_document():
    """Query and key/value documents of different lengths (ids per side): bottom-right causal
    inside each document, as cuDNN's padding_causal_bottom_right with ragged offsets."""
    ids_kv = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0, 0]] * 2, np.int32)
    ids_q = np.array([[1, 1, 2, 2, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]] * 2, np.int32)
    q, k, v = randn((B, S, H, D), 4), randn((B, S, H, D), 5), randn((B, S, H, D), 6)
    for form in ("ids", "offsets"):
        desc = _desc(form, ids_q, ids_kv)
        m = _dpa("padding_causal_bottom_right")

        def ref(q, k, v):
            return per_document64(q, k, v, ids_q, ids_kv, 1 / math.sqrt(D), causal=True, bottom_right=True)

        _check(lambda q, k, v, m=m, desc=desc: m.apply({}, q, k, v, desc), ref, (q, k, v), ids_q)


def test_from_seqlens_equals_padding_mask():
    """BSHD with from_seqlens: the padding mask of the lengths (the legacy mask-array path)."""
    q, k, v = randn((B, S, H, D), 1), randn((B, S, H, D), 2), randn((B, S, H, D), 3)
    lq, lk = np.array([16, 9]), np.array([12, 16])
    desc = SequenceDescriptor.from_seqlens((jnp.asarray(lq), jnp.asarray(lk)))
    mask = ~(
        (np.arange(S)[None, :, None] < lq[:, None, None]) & (np.arange(S)[None, None, :] < lk[:, None, None])
    )
    m = DotProductAttention(D, H, attn_mask_type="padding_causal", transpose_batch_sequence=False)
    got = m.apply({}, q, k, v, desc)
    want = m.apply({}, q, k, v, jnp.asarray(mask[:, None]))
    valid = np.arange(S)[None, :] < lq[:, None]
    assert rel(np.asarray(got)[valid], np.asarray(want)[valid]) < 1e-5


def test_t3hd_and_kv_packed_layouts():
    q, k, v = randn((B, S, H, D), 1), randn((B, S, H, D), 2), randn((B, S, H, D), 3)
    desc = _desc("ids", IDS)
    want = _dpa("padding_causal").apply({}, q, k, v, desc)
    for layout, args in (
        ("t3hd", (jnp.stack([q, k, v], 2), None, None)),
        ("thd_t2hd", (q, jnp.stack([k, v], 2), None)),
    ):
        m = DotProductAttention(
            D,
            H,
            attn_mask_type="padding_causal",
            qkv_layout=layout,
            max_segments_per_seq=4,
            transpose_batch_sequence=False,
        )
        np.testing.assert_allclose(m.apply({}, *args, desc), want, rtol=1e-6, atol=1e-6)


def _docs(ids):
    return [
        (r, np.where(ids[r] == doc)[0])
        for r in range(ids.shape[0])
        for doc in sorted(set(ids[r].tolist()) - {0})
    ]


def test_mha_and_transformer_layer_per_document():
    """MultiHeadAttention (mask argument) and TransformerLayer (attention_mask) take the
    descriptor: each document's rows equal the module run on that document alone."""
    x = randn((B, S, 32), 1)
    desc = _desc("ids", IDS)
    mha = MultiHeadAttention(D, H, attn_mask_type="padding_causal", transpose_batch_sequence=False)
    one = MultiHeadAttention(D, H, attn_mask_type="causal", transpose_batch_sequence=False)
    p = mha.init(jax.random.PRNGKey(0), x, x, desc, deterministic=True)
    packed = mha.apply(p, x, x, desc, deterministic=True)[0]
    layer_kw = dict(
        hidden_size=32,
        mlp_hidden_size=64,
        num_attention_heads=H,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        intermediate_dropout=0.0,
        enable_relative_embedding=False,
    )
    layer = TransformerLayer(self_attn_mask_type="padding_causal", **layer_kw)
    lone = TransformerLayer(self_attn_mask_type="causal", **layer_kw)
    lp = layer.init(jax.random.PRNGKey(1), x, attention_mask=desc, deterministic=True)
    lpacked = layer.apply(lp, x, attention_mask=desc, deterministic=True)
    for r, t in _docs(IDS):
        xd = x[r : r + 1, t]
        assert rel(packed[r, t], one.apply(p, xd, xd, deterministic=True)[0][0]) < 1e-5
        assert rel(lpacked[r, t], lone.apply(lp, xd, deterministic=True)[0]) < 1e-5


def test_errors_name_the_argument():
    q = randn((B, S, H, D), 1)
    dpa = _dpa("padding_causal")
    bad_pos = segment_pos(IDS)
    bad_pos[0, 4] = 7
    with pytest.raises(ValueError, match="segment_ids and segment_pos disagree"):
        dpa.apply(
            {}, q, q, q, SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(IDS), jnp.asarray(bad_pos))
        )
    two = DotProductAttention(
        D,
        H,
        attn_mask_type="padding_causal",
        qkv_layout="thd_thd_thd",
        max_segments_per_seq=2,
        transpose_batch_sequence=False,
    )
    for form in ("ids", "offsets"):
        with pytest.raises(ValueError, match="max_segments_per_seq=2"):
            two.apply({}, q, q, q, _desc(form, IDS))
    with pytest.raises(ValueError, match="need a padding attn_mask_type"):
        _dpa("causal").apply({}, q, q, q, _desc("ids", IDS))
    with pytest.raises(ValueError, match="segment_pos is required"):
        SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(IDS))
    with pytest.raises(ValueError, match="seqlens must be"):
        bshd = DotProductAttention(D, H, attn_mask_type="padding", transpose_batch_sequence=False)
        bshd.apply({}, q, q, q, SequenceDescriptor.from_seqlens(jnp.ones((B, 3), jnp.int32)))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 16\)"):
        dpa.apply(
            {},
            q,
            q,
            q,
            SequenceDescriptor.from_segment_ids_and_pos(
                jnp.ones((B, 8), jnp.int32), jnp.zeros((B, 8), jnp.int32)
            ),
        )
