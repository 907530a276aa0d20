"""Packed and padded sequences: TransformerEngine's ``SequenceDescriptor`` and its reduction to
per-token segment ids and positions, the one form every lowbit attention path works from.

A token with segment id 0 is padding; a query attends only to keys of its own (non-zero)
segment; the causal and sliding-window masks compare positions inside the segment. Three ways to
describe the tokens, as in TransformerEngine:

* ``from_seqlens(seqlens)``: one sequence per row, ``seqlens (batch,)`` valid tokens from the
  start (the rest is padding);
* ``from_seqlens_and_offsets(seqlens, seq_offsets)`` (THD layouts): ``seqlens (batch, n)`` and
  ``seq_offsets (batch, n + 1)``, segment ``k`` holding tokens ``[offsets[k], offsets[k] +
  seqlens[k])``; unused entries are -1 (or a zero length);
* ``from_segment_ids_and_pos(segment_ids, segment_pos)``: the ids and positions themselves,
  ``(batch, seq)`` each.

Each takes one array (query and key/value alike) or a pair ``(q, kv)``. Under context
parallelism with load balancing, ids and positions describe the tokens in the order the tensors
hold them (reordered as the tensors are); seqlens and offsets describe the original order and are
reordered here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


def _pair(value, name):
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be one array or a pair (q, kv), got {len(value)} items")
        return tuple(value)
    if hasattr(value, "shape"):
        return value, value
    raise TypeError(f"{name} must be an array or a pair (q, kv) of arrays, got {type(value).__name__}")


def _empty():
    return jnp.zeros(0, jnp.int32)


def _given(a) -> bool:
    return a is not None and int(np.prod(a.shape)) > 0


@jax.tree_util.register_pytree_node_class
class SequenceDescriptor:
    """How the tokens of a batch form sequences (TransformerEngine's class, its fields and
    factories). Fields are ``(q, kv)`` pairs; an unused one holds two empty arrays."""

    def __init__(self, seqlens=None, seq_offsets=None, segment_ids=None, segment_pos=None):
        self.seqlens = (_empty(), _empty()) if seqlens is None else seqlens
        self.seq_offsets = (_empty(), _empty()) if seq_offsets is None else seq_offsets
        self.segment_ids = (_empty(), _empty()) if segment_ids is None else segment_ids
        self.segment_pos = (_empty(), _empty()) if segment_pos is None else segment_pos

    def tree_flatten(self):
        return (self.seqlens, self.seq_offsets, self.segment_ids, self.segment_pos), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        del aux_data
        return cls(*children)

    @classmethod
    def from_seqlens(cls, seqlens) -> SequenceDescriptor:
        """``seqlens``: ``(batch,)`` valid tokens per row, or a pair ``(q_seqlens, kv_seqlens)``."""
        return cls(seqlens=_pair(seqlens, "seqlens"))

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, seq_offsets) -> SequenceDescriptor:
        """THD: ``seqlens (batch, n)``, ``seq_offsets (batch, n + 1)`` (-1 where unused)."""
        return cls(seqlens=_pair(seqlens, "seqlens"), seq_offsets=_pair(seq_offsets, "seq_offsets"))

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None) -> SequenceDescriptor:
        """``segment_ids (batch, seq)`` (0 = padding) and ``segment_pos (batch, seq)``."""
        if segment_pos is None:
            raise ValueError(
                "segment_pos is required (the position of each token inside its segment, as in "
                "TransformerEngine 2.20, which no longer derives it)"
            )
        return cls(
            segment_ids=_pair(segment_ids, "segment_ids"), segment_pos=_pair(segment_pos, "segment_pos")
        )


class Segments(NamedTuple):
    """Per-token ``(batch, s)`` int32 segment ids (0 = padding) and positions; ``pos_q`` already
    carries the bottom-right shift (``len_kv - len_q`` of its segment) where the mask has one."""

    ids_q: jax.Array
    pos_q: jax.Array
    ids_kv: jax.Array
    pos_kv: jax.Array


def _concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _check_shape(a, want, name):
    if tuple(a.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(a.shape)}")


def _from_offsets(lens, offs, b, s, max_segments, name):
    """ids and positions of ``s`` tokens from THD seqlens ``(b, n)`` and offsets ``(b, n + 1)``."""
    lens, offs = jnp.asarray(lens, jnp.int32), jnp.asarray(offs, jnp.int32)
    if lens.ndim != 2 or lens.shape[0] != b:
        raise ValueError(f"{name} seqlens must be (batch={b}, segments), got {tuple(lens.shape)}")
    n = lens.shape[1]
    _check_shape(offs, (b, n + 1), f"{name} seq_offsets")
    if _concrete(lens, offs):
        ln, of = np.asarray(lens), np.asarray(offs)
        used = (ln > 0) & (of[:, :-1] >= 0)
        if max_segments is not None and (used.sum(1) > max_segments).any():
            raise ValueError(
                f"max_segments_per_seq={max_segments}, but the {name} seqlens describe up to "
                f"{int(used.sum(1).max())} segments in one row"
            )
        if (used & (of[:, :-1] + ln > s)).any():
            raise ValueError(f"{name} seq_offsets + seqlens run past the sequence length {s}")
    t = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    start, ln = offs[:, :n, None], lens[:, :, None]
    inside = (start >= 0) & (ln > 0) & (t >= start) & (t < start + ln)  # (b, n, s)
    k = jnp.arange(1, n + 1, dtype=jnp.int32)[None, :, None]
    ids = jnp.sum(jnp.where(inside, k, 0), axis=1)
    pos = jnp.sum(jnp.where(inside, t - start, 0), axis=1)
    return ids, pos


def _check_ids(ids, pos, b, s, max_segments, name):
    ids, pos = jnp.asarray(ids), jnp.asarray(pos)
    _check_shape(ids, (b, s), f"{name} segment_ids")
    _check_shape(pos, (b, s), f"{name} segment_pos")
    for a, what in ((ids, "segment_ids"), (pos, "segment_pos")):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} {what} must be integers, got {a.dtype}")
    ids, pos = ids.astype(jnp.int32), pos.astype(jnp.int32)
    if _concrete(ids, pos):
        i, p = np.asarray(ids), np.asarray(pos)
        if (i < 0).any() or (p < 0).any():
            raise ValueError(f"{name} segment_ids and segment_pos must be >= 0")
        # Within a run of one segment the positions must count up by one: ids and positions
        # that disagree describe no packing.
        same = (i[:, 1:] == i[:, :-1]) & (i[:, 1:] != 0)
        if (same & (p[:, 1:] != p[:, :-1] + 1)).any():
            raise ValueError(
                f"{name} segment_ids and segment_pos disagree: inside a run of one segment id the "
                f"positions must increase by 1"
            )
        if max_segments is not None:
            counts = [len(set(row[row != 0].tolist())) for row in i]
            if max(counts, default=0) > max_segments:
                raise ValueError(
                    f"max_segments_per_seq={max_segments}, but the {name} segment_ids hold up to "
                    f"{max(counts)} segments in one row"
                )
    return ids, pos


def _row_padding(lens, b, s, name):
    lens = jnp.asarray(lens)
    if lens.ndim != 1 or lens.shape[0] != b:
        raise ValueError(
            f"{name} seqlens must be (batch={b},) for a BSHD layout (packed rows need a THD layout and "
            f"from_seqlens_and_offsets), got {tuple(lens.shape)}"
        )
    t = jnp.arange(s, dtype=jnp.int32)[None, :]
    ids = (t < lens.astype(jnp.int32)[:, None]).astype(jnp.int32)
    return ids, jnp.broadcast_to(t, (b, s))


def _segment_lengths_at(ids_a, ids_b):
    """For each token of ``ids_a``, how many tokens of its segment ``ids_b`` holds ``(b, sa)``."""
    return jnp.sum(ids_a[:, :, None] == ids_b[:, None, :], axis=-1, dtype=jnp.int32)


def to_segments(
    desc: SequenceDescriptor,
    *,
    thd: bool,
    padding: bool,
    bottom_right: bool,
    b: int,
    sq: int,
    sk: int,
    max_segments: Optional[int],
    reorder=None,
) -> Segments:
    """The descriptor as :class:`Segments`. ``padding`` False (the no_mask / causal types): the
    descriptor is ignored, as TransformerEngine does for BSHD layouts. ``reorder``: a function
    applying the context-parallel load-balancing order along axis 1 (for seqlens/offsets)."""
    if not isinstance(desc, SequenceDescriptor):
        raise TypeError(f"sequence_descriptor must be a SequenceDescriptor, got {type(desc).__name__}")
    if thd and not padding:
        raise ValueError(
            "the THD layouts (packed sequences) need a padding attn_mask_type, e.g. 'padding_causal'"
        )
    ids_given = _given(desc.segment_ids[0]) or _given(desc.segment_ids[1])
    if not padding:
        ones = lambda s: jnp.ones((b, s), jnp.int32)  # noqa: E731
        ar = lambda s: jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # noqa: E731
        seg = [ones(sq), ar(sq), ones(sk), ar(sk)]
        if reorder is not None:
            seg[1], seg[3] = reorder(seg[1]), reorder(seg[3])
    elif ids_given:
        q = _check_ids(desc.segment_ids[0], desc.segment_pos[0], b, sq, max_segments, "query")
        kv = _check_ids(desc.segment_ids[1], desc.segment_pos[1], b, sk, max_segments, "key/value")
        seg = [*q, *kv]
    else:
        if not (_given(desc.seqlens[0]) and _given(desc.seqlens[1])):
            raise ValueError("sequence_descriptor holds no seqlens and no segment_ids")
        if _given(desc.seq_offsets[0]):
            q = _from_offsets(desc.seqlens[0], desc.seq_offsets[0], b, sq, max_segments, "query")
            kv = _from_offsets(desc.seqlens[1], desc.seq_offsets[1], b, sk, max_segments, "key/value")
        else:
            q = _row_padding(desc.seqlens[0], b, sq, "query")
            kv = _row_padding(desc.seqlens[1], b, sk, "key/value")
        seg = [*q, *kv]
        if reorder is not None:
            seg = [reorder(a) for a in seg]
    if bottom_right and padding:
        shift = _segment_lengths_at(seg[0], seg[2]) - _segment_lengths_at(seg[0], seg[0])
        seg[1] = seg[1] + shift
    elif bottom_right:
        seg[1] = seg[1] + (sk - sq)
    return Segments(*seg)


__all__ = ["SequenceDescriptor", "Segments", "to_segments"]
