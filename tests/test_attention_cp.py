"""Context parallelism (issue 26) on 4 forced CPU devices (a subprocess per case, this file as the
script): DotProductAttention with ``context_parallel_axis`` over a mesh axis of 4, strategies
all-gather and ring, causal load balancing (DualChunkSwap for BSHD, Striped for THD), packing,
learnable sinks: outputs and gradients equal one device's (whose own float64 checks are in
test_attention_packing / test_attention_sinks). The ring issues each next block's ppermute
before the current block's attention; a context axis of size 1 is ignored."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import run_worker

CASES = (
    "all_gather_causal",
    "ring_causal",
    "ring_gqa_no_mask",
    "ring_load_balanced",
    "all_gather_load_balanced",
    "ring_packed",
    "all_gather_packed_striped",
    "ring_learnable_sink",
    "ring_structure",
    "size_one_ignored",
    "errors",
)


@pytest.mark.parametrize("case", CASES)
def test_context_parallel(case):
    run_worker(__file__, case)


# ---------------------------------------------------------------------------------------------
# The worker (runs only in the subprocess)
# ---------------------------------------------------------------------------------------------
B, S, H, D = 2, 16, 4, 8


def _run(case):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from attention_ref import segment_pos
    from helpers import jaxpr_eqns, randn, rel
    from jax.sharding import Mesh

    from lowbit.flax.attention import DotProductAttention
    from lowbit.ops.attention import (
        ReorderStrategy,
        SequenceDescriptor,
        inverse_reorder_causal_load_balancing,
        reorder_causal_load_balancing,
    )

    mesh = Mesh(np.array(jax.devices()), ("cp",))
    g = 2 if "gqa" in case else H
    q, k, v = randn((B, S, H, D), 1), randn((B, S, g, D), 2), randn((B, S, g, D), 3)
    dy = randn((B, S, H, D), 4)
    strategy = "RING" if case.startswith("ring") else "ALL_GATHER"
    kw = dict(attn_mask_type="causal", transpose_batch_sequence=False)
    desc = None
    if "gqa" in case:
        kw["attn_mask_type"] = "no_mask"
    if "packed" in case:
        ids = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 4, 4, 4, 4, 0]] * B, np.int32)
        if "striped" in case:  # THD seqlens/offsets: the original order, reordered inside
            lens = jnp.asarray([[3, 5, 2, 4, -1]] * B)
            offs = jnp.asarray([[0, 3, 8, 11, 16, -1]] * B)
            desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offs)
        else:
            desc = SequenceDescriptor.from_segment_ids_and_pos(
                jnp.asarray(ids), jnp.asarray(segment_pos(ids))
            )
        kw.update(attn_mask_type="padding_causal", qkv_layout="thd_thd_thd", max_segments_per_seq=4)
    if "sink" in case:
        kw["softmax_type"] = "learnable"
    one = DotProductAttention(D, H, g, **kw)
    params = one.init(jax.random.PRNGKey(0), q, k, v, desc)
    if "sink" in case:
        params = {"params": {"softmax_offset": randn((1, H, 1, 1), 5)}}
    balanced = "balanced" in case or "striped" in case
    cp = DotProductAttention(
        D,
        H,
        g,
        context_parallel_axis="cp",
        context_parallel_strategy=strategy,
        context_parallel_causal_load_balanced=balanced,
        **kw,
    )
    order = ReorderStrategy.Striped if "striped" in case else ReorderStrategy.DualChunkSwap

    def loss_one(p, q, k, v):
        return jnp.sum(one.apply(p, q, k, v, desc) * dy), one.apply(p, q, k, v, desc)

    def loss_cp(p, q, k, v):
        if balanced:  # the tensors go in reordered; the output comes back reordered
            q, k, v = (reorder_causal_load_balancing(t, order, 4, 1) for t in (q, k, v))
        out = cp.apply(p, q, k, v, desc)
        if balanced:
            out = inverse_reorder_causal_load_balancing(out, order, 4, 1)
        return jnp.sum(out * dy), out

    if case == "size_one_ignored":
        mesh1 = Mesh(np.array(jax.devices()).reshape(4, 1), ("dp", "cp"))
        with jax.set_mesh(mesh1):
            jaxpr = jax.make_jaxpr(lambda q, k, v: cp.apply({}, q, k, v))(q, k, v)
            out = cp.apply({}, q, k, v)
        assert not any(e.primitive.name == "shard_map" for e in jaxpr_eqns(jaxpr.jaxpr))
        np.testing.assert_array_equal(out, one.apply({}, q, k, v))
        return
    if case == "errors":
        with jax.set_mesh(mesh):
            try:
                cp.apply({}, q[:, :14], k[:, :14], v[:, :14])
            except ValueError as e:
                assert "context_parallel_axis='cp' of size 4 must divide" in str(e), e
            else:
                raise AssertionError("no error for a sequence the axis does not divide")
            bad = DotProductAttention(D, H, context_parallel_axis="sp", transpose_batch_sequence=False)
            try:
                bad.apply({}, q, k, v)
            except ValueError as e:
                assert "context_parallel_axis='sp' is not an axis" in str(e), e
            else:
                raise AssertionError("no error for an unknown axis")
        return
    if case == "ring_structure":
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(lambda q, k, v: cp.apply({}, q, k, v))(q, k, v)
        eqns = [e.primitive.name for e in jaxpr_eqns(jaxpr.jaxpr)]
        # 3 steps pass (k, v, ids, pos) on; each step's ppermutes come before its attention
        assert eqns.count("ppermute") == 12, eqns.count("ppermute")
        first_perm, first_dot = eqns.index("ppermute"), eqns.index("dot_general")
        assert first_perm < first_dot
        return

    (l1, o1), g1 = jax.value_and_grad(loss_one, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v)
    with jax.set_mesh(mesh):
        (l2, o2), g2 = jax.jit(jax.value_and_grad(loss_cp, argnums=(0, 1, 2, 3), has_aux=True))(
            params, q, k, v
        )
    assert rel(o2, o1) < 1e-5, rel(o2, o1)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert rel(a, b) < 1e-5, rel(a, b)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _run(sys.argv[1])
    print(f"OK {sys.argv[1]}")
