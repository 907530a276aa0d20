"""One entry point for attention with the features DotProductAttention's fused paths lack
(packed sequences, attention sinks, context parallelism) and the choice of the implementation.

:func:`attention` builds a static :class:`AttentionSpec` and the arrays, picks an implementation
(:func:`pick_implementation`) and runs it. Implementations are registered by name with a
predicate saying which specs they take: "xla" (this package's jnp path, every feature, every
backend) is always there; lowbit's cuDNN-frontend op registers itself as another (with a higher
priority), and then becomes the default wherever its predicate accepts the spec, dropout inside
``lax.scan`` and under remat included. ``implementation=None`` picks the highest-priority
implementation that takes the spec; a name forces that one (an error if it cannot).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops.attention.context_parallel import (
    ReorderStrategy,
    context_parallel,
    cp_mesh,
    load_balance_order,
    strategy_name,
)
from lowbit.ops.attention.core import (
    apply_sink,
    partial_attention,
    segment_keep,
    sink_logit,
    softmax_type_name,
)
from lowbit.ops.attention.descriptor import Segments, SequenceDescriptor, to_segments


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Everything static about one attention call (hashable: implementations may key caches on
    it). Shapes: ``q (b, sq, h, d)``, ``k``/``v (b, sk, g, d)``."""

    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    groups: int
    head_dim: int
    dtype: Any
    scale: float
    bias_type: str = "no_bias"  # "no_bias", "pre_scale_bias", "post_scale_bias"
    mask_type: str = "no_mask"  # lowbit.flax.attention_masks.MASK_TYPES
    window: Optional[Tuple[int, int]] = None
    thd: bool = False
    max_segments_per_seq: Optional[int] = 1
    softmax_type: str = "vanilla"
    dropout_rate: float = 0.0
    cp_axis: str = ""  # "" when context parallelism does not apply
    cp_strategy: str = "all_gather"
    cp_load_balanced: bool = False
    has_mask: bool = False  # an explicit (legacy) boolean mask array
    has_segments: bool = False  # a SequenceDescriptor


class AttentionArrays(NamedTuple):
    """The arrays of one call besides q/k/v (None where unused). ``descriptor`` is the user's
    SequenceDescriptor (seqlens and offsets for a ragged kernel), ``segments`` its per-token
    form (the masks of the jnp path)."""

    bias: Optional[jax.Array]
    mask: Optional[jax.Array]  # True = masked out, (b|1, h|1, sq, sk)
    descriptor: Optional[SequenceDescriptor]
    segments: Optional[Segments]
    softmax_offset: Optional[jax.Array]
    rng: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class _Impl:
    fn: Callable  # fn(q, k, v, spec, arrays) -> out (b, sq, h, d) in q.dtype
    supports: Callable  # supports(spec) -> bool
    priority: int


_REGISTRY: Dict[str, _Impl] = {}


def register_implementation(name: str, fn: Callable, supports: Callable, priority: int = 0) -> None:
    """Make ``fn(q, k, v, spec, arrays)`` available as implementation ``name``; with
    ``implementation=None`` the highest ``priority`` whose ``supports(spec)`` holds runs."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    _REGISTRY[name] = _Impl(fn, supports, int(priority))


def implementations() -> Tuple[str, ...]:
    """The registered names, highest priority first."""
    return tuple(sorted(_REGISTRY, key=lambda n: -_REGISTRY[n].priority))


def pick_implementation(spec: AttentionSpec, implementation: Optional[str] = None) -> str:
    """The implementation that runs ``spec``: ``implementation`` if named (it must take the
    spec), else the highest-priority registered one that takes it ("xla" takes every spec);
    implementations of negative priority run only when named."""
    if implementation is not None:
        impl = _REGISTRY.get(implementation)
        if impl is None:
            raise ValueError(
                f"implementation must be None or one of {list(implementations())}, got {implementation!r}"
            )
        if not impl.supports(spec):
            raise ValueError(f"implementation={implementation!r} does not support this attention: {spec}")
        return implementation
    for name in implementations():  # a negative priority: by name only
        if _REGISTRY[name].priority >= 0 and _REGISTRY[name].supports(spec):
            return name
    return "xla"


def _xla(q, k, v, spec: AttentionSpec, arrays: AttentionArrays):
    """The jnp path: segment masks, bias, dropout, sinks, context parallelism."""
    b, sq, sk = spec.batch, spec.seq_q, spec.seq_kv
    seg = arrays.segments
    if seg is None:  # one segment per row: positions only (the causal / window masks)
        pos_q = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (b, sq))
        pos_kv = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk))
        if spec.cp_load_balanced:  # the tensors arrive reordered: so do their positions
            strategy = ReorderStrategy.Striped if spec.thd else ReorderStrategy.DualChunkSwap
            size = _cp_size(spec.cp_axis)
            pos_q = pos_q[:, load_balance_order(strategy, size, sq)]
            pos_kv = pos_kv[:, load_balance_order(strategy, size, sk)]
        if spec.mask_type.endswith("bottom_right"):
            pos_q = pos_q + (sk - sq)
        seg = Segments(jnp.ones((b, sq), jnp.int32), pos_q, jnp.ones((b, sk), jnp.int32), pos_kv)
    causal = "causal" in spec.mask_type
    bias = arrays.bias
    if bias is not None and spec.bias_type == "pre_scale_bias":  # softmax(scale * (qk + bias))
        bias = bias.astype(jnp.float32) * spec.scale
    dense_keep = None if arrays.mask is None else jnp.logical_not(arrays.mask)

    def step(qx, kvx, rng):
        qq, ids_q, pos_q = qx
        kk, vv, ids_kv, pos_kv = kvx
        keep = segment_keep(ids_q, pos_q, ids_kv, pos_kv, causal, spec.window)
        if dense_keep is not None:
            keep = keep & dense_keep
        return partial_attention(
            qq, kk, vv, scale=spec.scale, keep=keep, bias=bias, rate=spec.dropout_rate, rng=rng
        )

    kv = (k, v, seg.ids_kv, seg.pos_kv)
    result = None
    if spec.cp_axis:
        if bias is not None or dense_keep is not None:
            raise NotImplementedError(
                "context parallelism with a bias or a mask array is not supported; describe padding "
                "and packing with a SequenceDescriptor"
            )
        result = context_parallel(
            step, q, kv, (seg.ids_q, seg.pos_q), arrays.rng, axis=spec.cp_axis, strategy=spec.cp_strategy
        )
    if result is None:
        result = step((q, seg.ids_q, seg.pos_q), kv, arrays.rng)
    out, lse = result
    sink = sink_logit(spec.softmax_type, arrays.softmax_offset, spec.heads)
    if sink is not None:
        out, lse = apply_sink(out, lse, sink)
    return out.astype(q.dtype)


register_implementation("xla", _xla, lambda spec: True, priority=-1)


def _cp_size(axis) -> int:
    from lowbit.ops.attention.context_parallel import _inside_manual

    if _inside_manual(axis):
        return int(jax.lax.psum(1, axis))
    found = cp_mesh(axis)
    return 1 if found is None else found[1]


def cp_active(axis) -> bool:
    """Whether context parallelism over ``axis`` applies here (a mesh axis of size > 1, or
    already inside a shard_map over it)."""
    return bool(axis) and _cp_size(axis) > 1


def make_spec(
    q,
    k,
    v,
    *,
    scale: float,
    bias=None,
    bias_type: str = "no_bias",
    mask_type: str = "no_mask",
    mask=None,
    sequence_descriptor: Optional[SequenceDescriptor] = None,
    thd: bool = False,
    window=None,
    max_segments_per_seq: Optional[int] = 1,
    softmax_type="vanilla",
    softmax_offset=None,
    dropout_rate: float = 0.0,
    rng=None,
    context_parallel_axis: str = "",
    context_parallel_strategy="DEFAULT",
    context_parallel_load_balanced: bool = False,
):
    """The checked :class:`AttentionSpec` of an :func:`attention` call (same arguments, less
    ``implementation``)."""
    del bias, rng, softmax_offset
    if (
        q.ndim != 4
        or k.ndim != 4
        or v.shape != k.shape
        or k.shape[0] != q.shape[0]
        or k.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"query must be (b, sq, h, d) and key/value (b, sk, g, d) alike, got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    if h % g:
        raise ValueError(f"the key/value groups ({g}) must divide the query heads ({h})")
    softmax_type = softmax_type_name(softmax_type)
    strategy = strategy_name(context_parallel_strategy)
    cp_axis = context_parallel_axis if cp_active(context_parallel_axis) else ""
    if max_segments_per_seq is not None and (
        not isinstance(max_segments_per_seq, (int, np.integer)) or max_segments_per_seq < 1
    ):
        raise ValueError(f"max_segments_per_seq must be None or a positive int, got {max_segments_per_seq!r}")
    if thd and sequence_descriptor is None:
        raise ValueError("the THD layouts (packed sequences) need a SequenceDescriptor")
    if sequence_descriptor is not None and mask is not None:
        raise ValueError("sequence_descriptor and a mask array cannot be given together")
    spec = AttentionSpec(
        batch=b,
        seq_q=sq,
        seq_kv=sk,
        heads=h,
        groups=g,
        head_dim=d,
        dtype=jnp.dtype(q.dtype),
        scale=float(scale),
        bias_type=bias_type,
        mask_type=mask_type,
        window=None if window is None else tuple(window),
        thd=bool(thd),
        max_segments_per_seq=None if max_segments_per_seq is None else int(max_segments_per_seq),
        softmax_type=softmax_type,
        dropout_rate=float(dropout_rate),
        cp_axis=cp_axis,
        cp_strategy=strategy,
        cp_load_balanced=bool(context_parallel_load_balanced) and bool(cp_axis),
        has_mask=mask is not None,
        has_segments=sequence_descriptor is not None,
    )
    return spec


def attention(q, k, v, *, implementation: Optional[str] = None, **kw):
    """Attention of ``q (b, sq, h, d)`` over ``k``/``v (b, sk, g, d)`` (batch first; masks,
    bias and windows as :mod:`lowbit.flax.attention_masks` defines them, mask type and bias type
    canonical names), run by :func:`pick_implementation`'s choice. Keywords: those of
    :func:`make_spec`. Returns ``(b, sq, h, d)`` in ``q.dtype``."""
    spec = make_spec(q, k, v, **kw)
    sequence_descriptor, thd, mask_type = kw.get("sequence_descriptor"), spec.thd, spec.mask_type
    b, sq, sk, cp_axis = spec.batch, spec.seq_q, spec.seq_kv, spec.cp_axis
    segments = None
    if sequence_descriptor is not None:
        reorder = None
        if spec.cp_load_balanced:
            strat = ReorderStrategy.Striped if thd else ReorderStrategy.DualChunkSwap
            size = _cp_size(cp_axis)
            reorder = lambda a: a[:, load_balance_order(strat, size, a.shape[1])]  # noqa: E731
        segments = to_segments(
            sequence_descriptor,
            thd=thd,
            padding=mask_type.startswith("padding"),
            bottom_right=mask_type.endswith("bottom_right"),
            b=b,
            sq=sq,
            sk=sk,
            max_segments=spec.max_segments_per_seq if thd else None,
            reorder=reorder,
        )
    arrays = AttentionArrays(
        kw.get("bias"), kw.get("mask"), sequence_descriptor, segments, kw.get("softmax_offset"), kw.get("rng")
    )
    name = pick_implementation(spec, implementation)
    return _REGISTRY[name].fn(q, k, v, spec, arrays)


__all__ = [
    "AttentionArrays",
    "AttentionSpec",
    "attention",
    "cp_active",
    "implementations",
    "make_spec",
    "pick_implementation",
    "register_implementation",
]
