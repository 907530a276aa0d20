"""Attention sinks (issue 26): ``softmax_type`` "off_by_one" (a zero logit more in the
denominator) and "learnable" (TransformerEngine's parameter ``softmax_offset (1, heads, 1, 1)``,
float32, zeros), forward and gradients (the sink parameter's included) against the float64
definition ``exp(s_i) / (exp(sink_h) + sum_j exp(s_j))``; with masks, GQA, packing; and TE's
``fused_attn`` entry point."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_ref import attend64, per_document64, segment_pos, to64
from helpers import randn, rel

from lowbit.flax.attention import DotProductAttention
from lowbit.ops.attention import SequenceDescriptor
from lowbit.te.attention import fused_attn

B, S, H, D = 2, 12, 4, 8


def _keep(mask_type, s):
    return jnp.asarray(np.tril(np.ones((s, s), bool)))[None, None] if mask_type == "causal" else None


@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
@pytest.mark.parametrize("g", [H, 2], ids=["mha", "gqa"])
def test_sink_forward_and_gradients(softmax_type, mask_type, g):
    q, k, v = randn((B, S, H, D), 1, 2.0), randn((B, S, g, D), 2), randn((B, S, g, D), 3)
    m = DotProductAttention(
        D, H, g, attn_mask_type=mask_type, softmax_type=softmax_type, transpose_batch_sequence=False
    )
    params = m.init(jax.random.PRNGKey(0), q, k, v)
    if softmax_type == "learnable":
        boxed = params["params"]["softmax_offset"]
        assert boxed.names == (None, "nvte_head", None, None)  # TE's logical axes
        off = boxed.unbox()
        assert off.shape == (1, H, 1, 1) and off.dtype == jnp.float32 and not np.any(off)
        params = {"params": {"softmax_offset": randn((1, H, 1, 1), 4)}}
    else:
        assert not params
    scale = 1 / math.sqrt(D)

    def f(p, q, k, v):
        return m.apply(p, q, k, v)

    def ref(p, q, k, v):
        sink = p["params"]["softmax_offset"].reshape(H) if p else jnp.zeros(H, q.dtype)
        return attend64(q, k, v, scale, _keep(mask_type, S), sink)

    out, vjp = jax.vjp(f, params, q, k, v)
    dy = randn(out.shape, 5)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: to64(a)[0], params)
        r, rvjp = jax.vjp(ref, p64, *to64(q, k, v))
        rg = rvjp(*to64(dy))
    assert rel(out, r) < 1e-5
    # the sink takes weight away from the values: the plain softmax is farther from the reference
    plain = DotProductAttention(D, H, g, attn_mask_type=mask_type, transpose_batch_sequence=False)
    assert rel(plain.apply({}, q, k, v), r) > 1e-3
    got = vjp(dy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(rg)):
        assert rel(a, b) < 1e-5
    if softmax_type == "learnable":
        assert np.all(np.abs(np.asarray(got[0]["params"]["softmax_offset"])) > 0)


def test_sink_with_packing():
    ids = np.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 0]] * B, np.int32)
    desc = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(segment_pos(ids)))
    q, k, v = randn((B, S, H, D), 1), randn((B, S, H, D), 2), randn((B, S, H, D), 3)
    m = DotProductAttention(
        D,
        H,
        attn_mask_type="padding_causal",
        qkv_layout="thd_thd_thd",
        max_segments_per_seq=3,
        softmax_type="off_by_one",
        transpose_batch_sequence=False,
    )
    out = m.apply({}, q, k, v, desc)
    with jax.enable_x64(True):
        r = per_document64(*to64(q, k, v), ids, ids, 1 / math.sqrt(D), True, sink=jnp.zeros(H))
    valid = ids != 0
    assert rel(np.asarray(out)[valid], np.asarray(r)[valid]) < 1e-5


def test_fused_attn_te_signature():
    """TE's fused_attn with the learnable softmax, a qkv-packed layout and a SequenceDescriptor."""
    q, k, v = randn((B, S, H, D), 1), randn((B, S, H, D), 2), randn((B, S, H, D), 3)
    off = randn((1, H, 1, 1), 4)
    lens = jnp.asarray([S, 7])
    out = fused_attn(
        (jnp.stack([q, k, v], 2),),
        None,
        SequenceDescriptor.from_seqlens(lens),
        None,
        "no_bias",
        "padding_causal",
        "bs3hd",
        "learnable",
        0.3,
        0.0,
        True,
        softmax_offset=off,
    )
    keep = np.tril(np.ones((S, S), bool))[None, None] & (
        np.arange(S)[None, None, None, :] < np.asarray(lens)[:, None, None, None]
    )
    with jax.enable_x64(True):
        r = attend64(*to64(q, k, v), 0.3, jnp.asarray(keep), to64(off)[0].reshape(H))
    valid = np.arange(S)[None, :] < np.asarray(lens)[:, None]
    assert rel(np.asarray(out)[valid], np.asarray(r)[valid]) < 1e-5
    with pytest.raises(ValueError, match="softmax_offset"):
        fused_attn(
            (q, k, v), None, None, None, "no_bias", "causal", "bshd_bshd_bshd", "learnable", 1.0, 0.0, False
        )
    with pytest.raises(NotImplementedError, match="score_mod"):
        fused_attn(
            (q, k, v),
            None,
            None,
            None,
            "no_bias",
            "causal",
            "bshd_bshd_bshd",
            "vanilla",
            1.0,
            0.0,
            False,
            score_mod=abs,
        )
