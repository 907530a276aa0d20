"""Context parallelism on a fused attention kernel per block: the implementation "cudnn_cp" of
:func:`lowbit.ops.attention.attention` (lowbit's cuDNN handler per block, on a GPU) and its CPU
twin "blockwise_cp" (the same schedule on jnp block kernels; never picked by default).

Each device keeps its query block (``s / n`` tokens) and sees every key/value block once, one
per step: ring (the blocks passed on with ``ppermute``, the next one issued before the current
one's attention; memory O(s / n)) or all-gather (all blocks gathered first, then sliced). Every
step runs the kernel on whole blocks without a mask array, so the scores are never formed:

* step 0 (its own block): causal (top-left), or no mask;
* causal, unbalanced: a block before its own in full, one after it computed and dropped (no
  branch: XLA's GPU conditional reads its predicate on the host, a stall per step, while every
  device of the ring waits for the highest one, which sees every block in full anyway);
* causal, load balanced (DualChunkSwap: device ``r`` holds chunks ``r`` and ``2n - 1 - r``):
  a block of a lower device is seen by both query chunks through its first chunk only, one of a
  higher device by the second query chunk only, in full: each step is half a block's work on
  every device, so the devices stay in step.

The partial outputs merge by the online softmax in float32. The backward is a custom VJP that
runs the same schedule again: each block's kernel backward with the global output and
log-sum-exp (the softmax gradient splits over key blocks exactly), dQ summed in float32 on its
device, dK/dV travelling with their block around the ring (in the inputs' dtype) until they
reach their owner (all-gather: one reduce-scatter). It takes no dropout, bias, window, sink,
packing or mask array (those keep the jnp path of :mod:`.context_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lowbit.ops._ffi import attention as ffi
from lowbit.ops.attention.context_parallel import over_context
from lowbit.ops.attention.core import MASKED, acc_dtype, merge, partial_attention
from lowbit.ops.attention.cudnn_impl import handler_runs
from lowbit.ops.attention.dispatch import AttentionArrays, AttentionSpec, register_implementation

_MASKS = ("no_mask", "causal", "causal_bottom_right")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    axis: str
    size: int
    strategy: str  # "ring" or "all_gather"
    causal: bool
    balanced: bool
    scale: float
    kernels: str  # "cudnn" or "reference"


# ---------------------------------------------------------------------------------------------
# Block kernels: fwd(q, k, v, causal, scale) -> (o in q's dtype, lse (b, h, sq));
# bwd(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv) in q's dtype. No mask but causal.
# ---------------------------------------------------------------------------------------------
def _ref_fwd(q, k, v, causal, scale):
    keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)) if causal else None
    out, lse = partial_attention(q, k, v, scale=scale, keep=keep)
    return out.astype(q.dtype), lse


def _ref_bwd(q, k, v, o, do, lse, causal, scale):
    """The flash-attention backward in jnp: ``p`` from the given log-sum-exp, ``D = rowsum(dO o)``."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    acc, hi = acc_dtype(q.dtype), jax.lax.Precision.HIGHEST
    ein = functools.partial(jnp.einsum, preferred_element_type=acc, precision=hi)
    qg, dog = q.reshape(b, sq, g, h // g, d), do.reshape(b, sq, g, h // g, d)
    s = ein("bqgrd,bkgd->bgrqk", qg, k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((sq, sk), bool)), s, MASKED)
    p = jnp.exp(s - lse.reshape(b, g, h // g, sq)[..., None].astype(acc))
    dv = ein("bgrqk,bqgrd->bkgd", p, dog)
    dp = ein("bqgrd,bkgd->bgrqk", dog, v)
    rows = jnp.sum(do.astype(acc) * o.astype(acc), axis=-1).reshape(b, sq, g, h // g)
    ds = p * (dp - rows.transpose(0, 2, 3, 1)[..., None])
    dq = ein("bgrqk,bkgd->bqgrd", ds, k).reshape(b, sq, h, d) * scale
    dk = ein("bgrqk,bqgrd->bkgd", ds, qg) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _cudnn_fwd(q, k, v, causal, scale):
    o, stats, _ = ffi.attention_fwd(
        q, k, v, None, None, None, None, None, None, None, None, flags=ffi.CAUSAL if causal else 0,
        scale=scale, dropout_rate=0.0, max_sq=q.shape[1], max_skv=k.shape[1], o_dtype=q.dtype,
        dv=v.shape[-1],
    )  # fmt: skip
    return o, stats


def _cudnn_bwd(q, k, v, o, do, lse, causal, scale):
    dq, dk, dv, _, _, _ = ffi.attention_bwd(
        q, k, v, o, do.astype(q.dtype), lse.astype(jnp.float32), None, None, None, None, None, None,
        None, None, flags=ffi.CAUSAL if causal else 0, scale=scale, dropout_rate=0.0,
        max_sq=q.shape[1], max_skv=k.shape[1], grad_dtype=q.dtype, want_dbias=False, want_dsink=False,
    )  # fmt: skip
    return dq, dk, dv


_KERNELS = {"reference": (_ref_fwd, _ref_bwd), "cudnn": (_cudnn_fwd, _cudnn_bwd)}


# ---------------------------------------------------------------------------------------------
# The schedule (per device)
# ---------------------------------------------------------------------------------------------
def _blocks(cfg: _Cfg, kv):
    """Yields ``(src, kv block)`` per step: step ``t`` holds device ``(me - t) % n``'s block.
    Ring: the next block's ppermute is issued before the current block is handed out, so it
    does not wait for (and can overlap) that block's attention."""
    me, n = jax.lax.axis_index(cfg.axis), cfg.size
    if cfg.strategy == "ring":
        perm = [(i, (i + 1) % n) for i in range(n)]
        for t in range(n):
            nxt = jax.lax.ppermute(kv, cfg.axis, perm) if t < n - 1 else None
            yield (me - t) % n, kv
            kv = nxt
        return
    full = jax.lax.all_gather(kv, cfg.axis, axis=1, tiled=True)
    yield me, kv
    blk = kv[0].shape[1]
    for t in range(1, n):
        src = (me - t) % n
        yield src, tuple(jax.lax.dynamic_slice_in_dim(a, src * blk, blk, axis=1) for a in full)


def _chunk_offset(me, src, c: int):
    """Load balanced, a step past the first is two c x c blocks without a branch: (second query
    chunk, first key chunk) on every device, plus (chunk at ``off``, chunk at ``off``) with
    ``off`` 0 for a lower device's block (with the first: all queries x its first chunk) or
    ``c`` for a higher one's (with the first: the second query chunk x the whole block).
    Selecting by offset instead of ``cond`` keeps the step free of host syncs, so the ring's
    transfers can run under the kernels (session 12: the cond version idled 5.8 of 26.6 ms)."""
    return jnp.where(src < me, 0, c).astype(jnp.int32)


def _rows(a, start, n: int, axis: int = 1):
    return jax.lax.dynamic_slice_in_dim(a, start, n, axis)


def _merge_rows(o, lse, part, start):
    """Merge ``part`` (out, lse) into the query rows ``start:start + len`` of the accumulators
    (``start`` static or traced)."""
    po, pl = part[0].astype(o.dtype), part[1].astype(lse.dtype)
    n = po.shape[1]
    mo, ml = merge((_rows(o, start, n), _rows(lse, start, n, 2)), (po, pl))
    return _put(o, mo, start, 1), _put(lse, ml, start, 2)


def _put(acc, rows, start, axis: int):
    """``acc`` with ``rows`` written from ``start`` along ``axis`` (an in-place update, not a scatter)."""
    if rows.shape == acc.shape:
        return rows
    return jax.lax.dynamic_update_slice_in_dim(acc, rows, start, axis)


def _add_rows(acc, rows, start, axis: int = 1):
    """``acc`` with ``rows`` added from ``start`` along ``axis``, in acc's dtype."""
    cur = _rows(acc, start, rows.shape[axis], axis)
    return _put(acc, cur + rows.astype(acc.dtype), start, axis)


def _forward(cfg: _Cfg, q, k, v):
    fwd = _KERNELS[cfg.kernels][0]
    acc, c, me = acc_dtype(q.dtype), q.shape[1] // 2, jax.lax.axis_index(cfg.axis)
    o = lse = None
    for src, (kb, vb) in _blocks(cfg, (k, v)):
        if o is None:  # step 0: the device's own block
            o, lse = fwd(q, kb, vb, cfg.causal, cfg.scale)
            o, lse = o.astype(acc), lse.astype(acc)
        elif cfg.causal and cfg.balanced:
            off = _chunk_offset(me, src, c)
            o, lse = _merge_rows(o, lse, fwd(q[:, c:], kb[:, :c], vb[:, :c], False, cfg.scale), c)
            part = fwd(_rows(q, off, c), _rows(kb, off, c), _rows(vb, off, c), False, cfg.scale)
            o, lse = _merge_rows(o, lse, part, off)
        else:
            po, pl = fwd(q, kb, vb, False, cfg.scale)
            if cfg.causal:  # unbalanced: a later device's block is computed and dropped
                pl = jnp.where(src < me, pl, -jnp.inf)  # weight 0 in the merge
            o, lse = _merge_rows(o, lse, (po, pl), 0)
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: _Cfg, q, k, v):
    return _forward(cfg, q, k, v)[0]


def _attend_fwd(cfg, q, k, v):
    out, lse = _forward(cfg, q, k, v)
    return out, (q, k, v, out, lse)


def _attend_bwd(cfg, res, do):
    q, k, v, o, lse = res
    bwd = _KERNELS[cfg.kernels][1]
    acc, c, n, me = acc_dtype(q.dtype), q.shape[1] // 2, cfg.size, jax.lax.axis_index(cfg.axis)

    def grads(dq, qs, kb, vb, os, dos, ls, causal, row):
        gq, gk, gv = bwd(qs, kb, vb, os, dos, ls, causal, cfg.scale)
        return _add_rows(dq, gq, row), gk, gv

    def balanced(dq, src, kb, vb):  # the two c x c blocks of _chunk_offset; dK/dV summed in float32
        dq, gk1, gv1 = grads(dq, q[:, c:], kb[:, :c], vb[:, :c], o[:, c:], do[:, c:], lse[:, :, c:], False, c)
        off = _chunk_offset(me, src, c)
        sl = functools.partial(_rows, start=off, n=c)
        dq, gk2, gv2 = grads(dq, sl(q), sl(kb), sl(vb), sl(o), sl(do), sl(lse, axis=2), False, off)
        dk, dv = (_add_rows(_put(jnp.zeros(kb.shape, acc), g1.astype(acc), 0, 1), g2, off) for g1, g2 in
                  ((gk1, gk2), (gv1, gv2)))  # fmt: skip
        return dq, dk.astype(kb.dtype), dv.astype(vb.dtype)

    dq, travelling, full = jnp.zeros(q.shape, acc), None, None
    if cfg.strategy != "ring":
        full = (jnp.zeros((k.shape[0], k.shape[1] * n, *k.shape[2:]), k.dtype),) * 2
    perm = [(i, (i + 1) % n) for i in range(n)]
    for t, (src, (kb, vb)) in enumerate(_blocks(cfg, (k, v))):
        if t == 0:
            dq, gk, gv = grads(dq, q, kb, vb, o, do, lse, cfg.causal, 0)
        elif cfg.causal and cfg.balanced:
            dq, gk, gv = balanced(dq, src, kb, vb)
        else:
            gq, gk, gv = bwd(q, kb, vb, o, do, lse, False, cfg.scale)
            if cfg.causal:  # a dropped block's terms may be inf: select, not scale
                gq, gk, gv = (jnp.where(src < me, g, jnp.zeros_like(g)) for g in (gq, gk, gv))
            dq = _add_rows(dq, gq, 0)
        if full is not None:  # all-gather: each block's gradient in its slot
            full = tuple(
                jax.lax.dynamic_update_slice_in_dim(f, g, src * k.shape[1], axis=1)
                for f, g in zip(full, (gk, gv))
            )
            continue
        # ring: the block's dK/dV travel with it; after n hops they are back at their owner
        own = (gk, gv) if travelling is None else (travelling[0] + gk, travelling[1] + gv)
        travelling = jax.lax.ppermute(own, cfg.axis, perm)
    if full is not None:
        travelling = tuple(jax.lax.psum_scatter(f, cfg.axis, scatter_dimension=1, tiled=True) for f in full)
    return dq.astype(q.dtype), travelling[0].astype(k.dtype), travelling[1].astype(v.dtype)


_attend.defvjp(_attend_fwd, _attend_bwd)


def fused_context_parallel(
    q, k, v, *, axis: str, strategy: str = "ring", causal: bool = True, load_balanced: bool = False,
    scale: float | None = None, kernels: str = "cudnn",
):  # fmt: skip
    """Attention of ``q (b, s, h, d)`` over ``k``/``v (b, s, g, d)`` with the sequence split
    over mesh ``axis`` (under a mesh, or inside a shard_map over it): ``strategy`` "ring" or
    "all_gather", ``causal`` (top-left; ``load_balanced``: the tensors arrive in DualChunkSwap
    order, :func:`lowbit.ops.attention.reorder_causal_load_balancing`), ``kernels`` "cudnn"
    (lowbit's handler, GPU) or "reference" (jnp). Returns ``(b, s, h, d)`` in q's dtype, or None
    where the axis does not apply (no mesh, size 1)."""
    if strategy not in ("ring", "all_gather"):
        raise ValueError(f"strategy must be 'ring' or 'all_gather', got {strategy!r}")
    if kernels not in _KERNELS:
        raise ValueError(f"kernels must be one of {sorted(_KERNELS)}, got {kernels!r}")
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or k.shape[1] != q.shape[1]:
        raise ValueError(
            f"q must be (b, s, h, d) and k/v (b, s, g, d) with q's sequence length, got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    def body(qx, kv, ax, size, _rng):
        if load_balanced and causal and qx[0].shape[1] % 2:
            raise ValueError(f"load_balanced needs an even block per device, got {qx[0].shape[1]}")
        cfg = _Cfg(ax, int(size), strategy, bool(causal), bool(load_balanced), scale, kernels)
        return _attend(cfg, qx[0], *kv)

    return over_context(body, q, (k, v), (), None, axis=axis, with_lse=False)


def fits(spec: AttentionSpec) -> bool:
    """Whether the blockwise schedule takes ``spec`` (context parallel, self-attention without
    dropout, bias, window, sink, packing or mask array)."""
    return (
        bool(spec.cp_axis)
        and not (spec.thd or spec.has_segments or spec.has_mask)
        and spec.bias_type == "no_bias"
        and spec.window is None
        and spec.softmax_type == "vanilla"
        and spec.dropout_rate == 0
        and spec.mask_type in _MASKS
        and spec.seq_q == spec.seq_kv
    )


def _runner(kernels):
    def run(q, k, v, spec: AttentionSpec, arrays: AttentionArrays):
        out = fused_context_parallel(
            q, k, v, axis=spec.cp_axis, strategy=spec.cp_strategy, causal="causal" in spec.mask_type,
            load_balanced=spec.cp_load_balanced, scale=spec.scale, kernels=kernels,
        )  # fmt: skip
        return out.astype(q.dtype)

    return run


# Picked on a GPU for the specs it fits (its gpu tests passed on 4 x H200 in session 12); below
# the single-device handlers, which take no context-parallel spec.
register_implementation("cudnn_cp", _runner("cudnn"), lambda spec: fits(spec) and handler_runs(spec), 5)
register_implementation("blockwise_cp", _runner("reference"), fits, priority=-2)

__all__ = ["fits", "fused_context_parallel"]
