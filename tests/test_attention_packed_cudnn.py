"""Packed sequences on lowbit's cuDNN handler (implementation "cudnn_thd", the ragged THD path):
the documents found from segment ids (CPU, against a plain loop), the dispatch choosing it only
where cuDNN applies, and (``gpu`` marker) per-document results equal to attention run per
document in float64, forward and gradients, with the jnp path beside it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_ref import per_document64, segment_pos, to64
from helpers import rel

from lowbit.flax.attention import DotProductAttention
from lowbit.ops.attention import SequenceDescriptor, make_spec, pick_implementation
from lowbit.ops.fused_attention_ragged import documents

IDS = np.array(
    [
        [1, 1, 1, 2, 2, 2, 2, 2, 3, 0, 4, 4, 4, 4, 0, 0],
        [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 0],
    ],
    np.int32,
)


def _runs(row, n):
    """(start, length, id) of the runs of equal non-zero ids, in order, at most n."""
    out, t = [], 0
    while t < len(row):
        if row[t] == 0:
            t += 1
            continue
        e = t
        while e < len(row) and row[e] == row[t]:
            e += 1
        out.append((t, e - t, row[t]))
        t = e
    return out[:n]


@pytest.mark.parametrize("n", [2, 4, 6])
def test_documents_are_the_runs_of_ids(n):
    starts, lens, ids, inside = (np.asarray(x) for x in documents(jnp.asarray(IDS), n))
    for r, row in enumerate(IDS):
        runs = _runs(row, n)
        for k in range(n):
            want = runs[k] if k < len(runs) else (IDS.shape[1], 0, 0)
            assert (starts[r, k], lens[r, k], ids[r, k]) == want
        kept = np.zeros(len(row), bool)
        for s, ln, _ in runs:
            kept[s : s + ln] = True
        np.testing.assert_array_equal(inside[r], kept)


def test_dispatch_takes_cudnn_thd_only_where_it_applies():
    q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
    desc = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(IDS), jnp.asarray(segment_pos(IDS)))
    kw = dict(
        scale=0.125, mask_type="padding_causal", sequence_descriptor=desc, thd=True, max_segments_per_seq=4
    )
    spec = make_spec(q, q, q, **kw)
    from lowbit.ops._ffi import attention as ffi
    from lowbit.ops.attention import cudnn_packed

    on_gpu = jax.default_backend() == "gpu" and ffi.cudnn_status()[0]
    assert pick_implementation(spec) == ("cudnn_thd" if on_gpu else "xla")
    for change in (dict(window=(4, 0)), dict(softmax_type="off_by_one"), dict(max_segments_per_seq=None)):
        assert not cudnn_packed.supports(make_spec(q, q, q, **{**kw, **change}))
    assert not cudnn_packed.supports(make_spec(q.astype(jnp.float32), q, q, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("g", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("form", ["ids", "offsets"])
def test_cudnn_packed_equals_per_document(mask_type, g, form, gpu_device):
    b, s, h, d = IDS.shape[0], IDS.shape[1], 4, 64
    r = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(r.standard_normal(x), jnp.bfloat16) for x in ((b, s, h, d), (b, s, g, d), (b, s, g, d))
    )
    if form == "ids":
        desc = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(IDS), jnp.asarray(segment_pos(IDS)))
    else:
        from test_attention_packing import _offsets

        desc = SequenceDescriptor.from_seqlens_and_offsets(*_offsets(IDS))
    m = DotProductAttention(
        head_dim=d,
        num_attention_heads=h,
        num_gqa_groups=g,
        attn_mask_type=mask_type,
        qkv_layout="thd_thd_thd",
        max_segments_per_seq=4,
    )
    spec = make_spec(q, k, v, scale=1 / math.sqrt(d), mask_type=mask_type, sequence_descriptor=desc, thd=True,
                     max_segments_per_seq=4)  # fmt: skip
    assert pick_implementation(spec) == "cudnn_thd"
    f = jax.jit(lambda q, k, v: m.apply({}, q, k, v, desc))
    out, vjp = jax.vjp(f, q, k, v)
    dy = (
        jnp.asarray(r.standard_normal(out.shape), jnp.bfloat16)
        * jnp.asarray(IDS != 0, jnp.bfloat16)[:, :, None, None]
    )
    with jax.enable_x64(True):
        ref = lambda q, k, v: per_document64(
            q, k, v, IDS, IDS, 1 / math.sqrt(d), causal="causal" in mask_type
        )  # noqa: E731
        want, rvjp = jax.vjp(ref, *to64(q, k, v))
        want_g = rvjp(*to64(dy))
    valid = IDS != 0
    o = np.asarray(out, np.float32)
    assert rel(o[valid], np.asarray(want)[valid]) < 2e-2  # bf16 inputs and output
    assert np.all(o[~valid] == 0)
    for got, w in zip(vjp(dy), want_g):
        assert rel(np.asarray(got, np.float32), np.asarray(w)) < 3e-2


@pytest.mark.slow
def test_attention_bench_runs_small():
    """``python -m lowbit.bench attention --small``'s cases: the FP8 and packing rows, timed."""
    from lowbit.bench import attention as bench

    rows = bench.run(small=True)
    assert [r["name"] for r in rows] == [
        "bf16 cudnn",
        "fp8 current",
        "fp8 delayed",
        "unpacked causal",
        "packed 24 docs",
    ]
    assert all(r["ms"] > 0 and r["speedup"] > 0 for r in rows)
