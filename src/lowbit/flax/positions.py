"""Position encodings with TransformerEngine's names: ``rotary_pos_emb`` and
``RelativePositionBiases`` (T5-style bucketed relative position biases).

``rotary_pos_emb`` rotates pairs of coordinates of the projected query and key by
``position / timescale_i``; ``MultiHeadAttention(enable_rotary_pos_emb=True)`` applies it after the
projections, before the dot product, as TransformerEngine does. Pairs:

* ``"consecutive"``: coordinate ``2i`` with ``2i + 1``, both rotated by timescale ``i``;
* ``"alternate"``: coordinate ``i`` with ``i + d/2`` (the first half with the second).

Timescales: ``min_window * (max_window / min_window) ** (2i / d)`` for ``i < d/2``, from
``windows = (min_window, max_window)`` (TransformerEngine's default ``(1, 10000)``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.sharding import constrain_bias

_GROUP_METHODS = ("consecutive", "alternate")


def canonical_group_method(group_method: Any) -> str:
    """``"consecutive"`` or ``"alternate"`` (case, ``-`` and ``_`` ignored, as in TransformerEngine)."""
    if not isinstance(group_method, str):
        raise ValueError(
            f"rotary_pos_emb_group_method must be one of {list(_GROUP_METHODS)}, got {group_method!r}"
        )
    s = group_method.lower().strip().replace("-", "").replace("_", "")
    if s not in _GROUP_METHODS:
        raise ValueError(
            f"rotary_pos_emb_group_method must be one of {list(_GROUP_METHODS)}, got {group_method!r}"
        )
    return s


def check_rotary_windows(windows: Any) -> Tuple[float, float]:
    """``(min_window, max_window)``: two positive numbers."""
    try:
        lo, hi = (float(w) for w in windows)
    except (TypeError, ValueError):
        raise ValueError(
            f"rotary_pos_emb_windows must be a pair (min, max) of positive numbers, got {windows!r}"
        ) from None
    if not (lo > 0 and hi > 0 and np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(
            f"rotary_pos_emb_windows must be a pair (min, max) of positive numbers, got {windows!r}"
        )
    return lo, hi


def rotary_pos_emb(
    x: jax.Array,
    windows: Tuple[int, int],
    transpose_batch_sequence: bool,
    group_method: str = "consecutive",
    *,
    position_offset: Any = 0,
) -> jax.Array:
    """Rotary position embedding of ``x``: ``(batch, seq, ..., heads, head_dim)``, or
    ``(seq, batch, ...)`` with ``transpose_batch_sequence``. Positions are ``0 .. seq-1`` along
    the sequence axis, plus ``position_offset`` (lowbit: an int or a traced scalar, e.g. the
    decode cache index); ``head_dim`` must be even. Returns x's shape and dtype."""
    method = canonical_group_method(group_method)
    lo, hi = check_rotary_windows(windows)
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"rotary_pos_emb: x must be (batch, seq, ..., head_dim), got shape {x.shape}")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary_pos_emb: head_dim must be even, got {d}")
    half = d // 2
    seq_axis = 0 if transpose_batch_sequence else 1
    timescale = lo * (hi / lo) ** (2.0 * np.arange(half) / d)  # (half,)
    # Broadcast (seq, half) over x's other axes: seq at seq_axis, half at the end.
    shape = [1] * x.ndim
    shape[seq_axis] = x.shape[seq_axis]
    shape[-1] = half
    if isinstance(position_offset, (int, np.integer)):
        pos = np.arange(x.shape[seq_axis], dtype=np.float64) + int(position_offset)
        angle = pos[:, None] / timescale[None, :]  # (seq, half), float64 on the host
        sin = jnp.asarray(np.sin(angle).reshape(shape), jnp.float32)
        cos = jnp.asarray(np.cos(angle).reshape(shape), jnp.float32)
    else:
        pos = jnp.arange(x.shape[seq_axis], dtype=jnp.float32) + jnp.asarray(position_offset, jnp.float32)
        angle = pos[:, None] / jnp.asarray(timescale, jnp.float32)[None, :]
        sin, cos = jnp.sin(angle).reshape(shape), jnp.cos(angle).reshape(shape)
    xf = x.astype(jnp.float32)
    if method == "alternate":
        a, b = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        pairs = xf.reshape(x.shape[:-1] + (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def relative_position_buckets(
    q_seqlen: int, k_seqlen: int, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> np.ndarray:
    """T5's bucket of each (query i, key j): ``(q_seqlen, k_seqlen)`` int32.

    ``n = i - j``. Bidirectional: half the buckets for keys after the query (``n < 0``), the
    other half for the rest, on ``|n|``; otherwise ``max(n, 0)`` over all buckets. Within a half
    of ``m`` buckets, distances below ``m // 2`` have a bucket each and larger ones share
    log-spaced buckets up to ``max_distance`` (the last bucket beyond)."""
    n = np.arange(q_seqlen, dtype=np.int64)[:, None] - np.arange(k_seqlen, dtype=np.int64)[None, :]
    m = int(num_buckets)
    bucket = np.zeros(n.shape, np.int64)
    if bidirectional:
        m //= 2
        bucket += (n < 0).astype(np.int64) * m
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    exact = m // 2
    # float32 arithmetic (and eps) as TransformerEngine computes it, so edge distances bucket alike
    with np.errstate(divide="ignore"):
        log_ratio = np.log(n.astype(np.float32) / np.float32(exact) + np.finfo(np.float32).eps) / np.log(
            np.float32(max_distance) / np.float32(exact)
        )
    large = exact + (log_ratio * np.float32(m - exact)).astype(np.int64)
    large = np.minimum(large, m - 1)
    bucket += np.where(n < exact, n, large)
    return bucket.astype(np.int32)


class RelativePositionBiases(nn.Module):
    """T5-style relative position biases: a learned ``(num_attention_heads, num_buckets)`` table
    (param ``rel_embedding``) indexed by the bucket of each (query, key) distance.

    ``__call__(q_seqlen, k_seqlen, bidirectional=True)`` returns
    ``(1, num_attention_heads, q_seqlen, k_seqlen)`` in ``dtype``: an attention bias.

    ``layout`` (:func:`lowbit.sharding.bias_layout` of the attention, under a mesh) returns
    ``(n, ...)``: the same bias once per batch shard (n of them), its heads split as the
    attention splits them, each shard built on its own device from the table, so that its
    gradient reaches the (heads, buckets) table before it is summed over the mesh (a few KB
    reduced instead of the whole (1, heads, sq, sk) gradient)."""

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    embedding_axes: Tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True, *, layout=None) -> jax.Array:
        for name in ("num_buckets", "max_distance", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RelativePositionBiases: {name} must be a positive int, got {v!r}")
        if self.num_buckets < (4 if bidirectional else 2):
            raise ValueError(
                f"RelativePositionBiases: num_buckets must be at least {4 if bidirectional else 2} "
                f"(bidirectional={bidirectional}), got {self.num_buckets}"
            )
        for name, v in (("q_seqlen", q_seqlen), ("k_seqlen", k_seqlen)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"RelativePositionBiases: {name} must be a positive (static) int, got {v!r}")
        bucket = relative_position_buckets(
            q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional
        )
        axes: Sequence[str] = tuple(self.embedding_axes or ())
        init = nn.with_logical_partitioning(self.embedding_init, axes) if axes else self.embedding_init
        table = self.param("rel_embedding", init, (self.num_attention_heads, self.num_buckets), self.dtype)
        table = jnp.asarray(table, self.dtype)[None]
        if layout is not None:
            table = constrain_bias(jnp.broadcast_to(table, (layout[0],) + table.shape[1:]), layout)
        # One-hot contraction (a gather's gradient would be a scatter): (n, h, nb) x (nb, q, k).
        onehot = jnp.asarray(bucket[None, :, :] == np.arange(self.num_buckets)[:, None, None], self.dtype)
        values = jax.lax.dot_general(table, onehot, (((2,), (0,)), ((), ())))
        return values if layout is None else constrain_bias(values, layout)


__all__ = ["RelativePositionBiases", "relative_position_buckets", "rotary_pos_emb"]
