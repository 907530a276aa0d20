"""Packed sequences on lowbit's cuDNN handler (:mod:`lowbit.ops.fused_attention_ragged`) as the
implementation "cudnn_thd" of :func:`lowbit.ops.attention.attention`.

It takes THD layouts with a SequenceDescriptor (segment ids and positions, or seqlens and
offsets) under the ``padding`` and ``padding_causal`` masks, self-attention shapes (sq == sk),
``max_segments_per_seq`` given, no bias, window, sinks (cuDNN before 9.26 miscomputes the ragged
backward with a sink), context parallelism or mask array, bf16/fp16 on a GPU with cuDNN loaded.
Everything else stays on the jnp path. Under a mesh it runs per (batch, heads) shard.
"""

from __future__ import annotations

import jax.numpy as jnp

from lowbit.ops import fused_attention_ragged as fr
from lowbit.ops.attention.cudnn_impl import handler_runs
from lowbit.ops.attention.dispatch import AttentionArrays, AttentionSpec, register_implementation
from lowbit.ops.attention.per_shard import per_shard_attention


def supports(spec: AttentionSpec) -> bool:
    n = spec.max_segments_per_seq
    fits = (
        spec.thd
        and spec.has_segments
        and not (spec.has_mask or spec.cp_axis)
        and spec.mask_type in ("padding", "padding_causal")
        and spec.bias_type == "no_bias"
        and spec.window is None
        and spec.softmax_type == "vanilla"
        and n is not None
        and spec.seq_q == spec.seq_kv
        # element offsets are int32
        and spec.batch * spec.seq_q * spec.heads * spec.head_dim < 2**31
    )
    return fits and handler_runs(spec)


def run(q, k, v, spec: AttentionSpec, arrays: AttentionArrays):
    seg = arrays.segments
    # The ids travel as one (b, 1, 2, s) array: per_shard_attention splits its batch like q's.
    ids = jnp.stack([seg.ids_q, seg.ids_kv], axis=1)[:, None]

    def one(q, k, v, _bias, ids, _sink, rng):
        return fr.packed_attention(
            q, k, v, ids[:, 0, 0], ids[:, 0, 1], max_segments=spec.max_segments_per_seq,
            causal=spec.mask_type == "padding_causal", scale=spec.scale, dropout_rate=spec.dropout_rate,
            rng=rng,
        )  # fmt: skip

    return per_shard_attention(one, q, k, v, None, ids, None, arrays.rng)


register_implementation("cudnn_thd", run, supports, priority=10)
