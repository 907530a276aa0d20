"""Attention, forward+backward, one process (issue 26's goals):

* ``fp8``: FP8 attention (``fp8_dpa``; :func:`lowbit.ops.attention.fp8.fp8_attention`) under
  Float8CurrentScaling and DelayedScaling next to BF16 attention on lowbit's cuDNN handler
  (:func:`lowbit.ops.fused_attention.fused_attention`); causal, seq 4096, 32 heads x 128
  (goal: >= 1.3x BF16). On the CPU both are the references/emulation.
* ``packing``: 4 x 2048 tokens as 24 documents (THD, ``padding_causal``, through
  :func:`lowbit.ops.attention.attention`: cuDNN's ragged path on a GPU) next to the same batch
  as 4 unpacked causal rows on the same handler (goal: within 10%, speedup >= 0.9).

``--small`` (the default without a GPU) runs the same cases at small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.bench.common import time_fn
from lowbit.ops.attention import SequenceDescriptor, fp8_scales
from lowbit.ops.attention import attention as core_attention
from lowbit.ops.attention.fp8 import fp8_attention
from lowbit.ops.fused_attention import fused_attention
from lowbit.recipe import DelayedScaling, Float8CurrentScaling

# (batch, seq, heads, head_dim); document lengths per packed row (6 per row: 24 in 4 rows)
FP8_SHAPE = {False: (2, 4096, 32, 128), True: (1, 128, 4, 64)}
PACK_SHAPE = {False: (4, 2048, 32, 128), True: (4, 64, 4, 64)}
DOCS = {False: (512, 256, 384, 128, 512, 256), True: (16, 8, 12, 4, 16, 8)}


def _inputs(shape, seed=0):
    b, s, h, d = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys)


def _grad_step(f, n_args=3):
    """jit of the gradients of sum(f(...)) in its first ``n_args`` arguments (forward+backward)."""
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=tuple(range(n_args))))


def _row(model, name, shape, ms, base_ms, base, goal):
    return {
        "model": model,
        "name": name,
        "shape": "x".join(map(str, shape)),
        "ms": ms,
        "speedup": base_ms / ms if ms else None,
        "speedup_vs": base,
        "goal": goal,
    }


def _fp8_rows(small):
    shape = FP8_SHAPE[small]
    q, k, v = _inputs(shape)
    base = "bf16 cudnn"
    t_bf16 = time_fn(_grad_step(lambda q, k, v: fused_attention(q, k, v, causal=True)), q, k, v)
    rows = [_row("fp8", base, shape, t_bf16, t_bf16, base, "")]
    current = Float8CurrentScaling(fp8_dpa=True)
    f = _grad_step(lambda q, k, v: fp8_attention(q, k, v, recipe=current, causal=True))
    rows.append(_row("fp8", "fp8 current", shape, time_fn(f, q, k, v), t_bf16, base, ">= 1.3"))
    delayed = DelayedScaling(fp8_dpa=True)
    state = fp8_scales.init_state(delayed)
    g = _grad_step(lambda q, k, v, st: fp8_attention(q, k, v, recipe=delayed, state=st, causal=True), 4)
    state = g(q, k, v, state)[3]  # scales from these tensors' amaxes, as in training
    rows.append(_row("fp8", "fp8 delayed", shape, time_fn(g, q, k, v, state), t_bf16, base, ">= 1.3"))
    return rows


def packed_descriptor(b, s, docs):
    """A SequenceDescriptor (segment ids and positions) of ``b`` rows of ``s`` tokens, each
    row packed with documents of lengths ``docs`` (summing to ``s``)."""
    ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(docs)])
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in docs])
    tile = lambda a: jnp.asarray(np.tile(a, (b, 1)))  # noqa: E731
    return SequenceDescriptor.from_segment_ids_and_pos(tile(ids), tile(pos))


def _packing_rows(small):
    shape = PACK_SHAPE[small]
    b, s, h, d = shape
    docs = DOCS[small]
    q, k, v = _inputs(shape, seed=1)
    desc = packed_descriptor(b, s, docs)
    base = "unpacked causal"
    t_plain = time_fn(_grad_step(lambda q, k, v: fused_attention(q, k, v, causal=True)), q, k, v)

    def packed(q, k, v):
        return core_attention(
            q, k, v, scale=d**-0.5, mask_type="padding_causal", sequence_descriptor=desc, thd=True,
            max_segments_per_seq=len(docs),
        )  # fmt: skip

    t_packed = time_fn(_grad_step(packed), q, k, v)
    name = f"packed {b * len(docs)} docs"
    return [
        _row("packing", base, shape, t_plain, t_plain, base, ""),
        _row("packing", name, shape, t_packed, t_plain, base, ">= 0.9"),
    ]


def count(small: bool) -> int:
    return 2


def run(small: bool, progress=None) -> list[dict]:
    rows = []
    for part in (_fp8_rows, _packing_rows):
        rows += part(small)
        if progress:
            progress(1)
    return rows


__all__ = ["count", "packed_descriptor", "run"]
