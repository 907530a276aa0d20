"""quantize / dequantize / grouped_quantize: argument checks, then one XLA FFI call each."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from lowbit.ops._ffi import quantize as ffi
from lowbit.quantization.checks import (
    as_array,
    as_dtype,
    as_int,
    check_block_multiple,
    check_block_options,
    check_flatten_axis,
    check_input,
    check_layout,
    check_q_dtype,
    check_scale_value,
    check_scaling_mode,
    check_tensor_scale,
    validate,
)
from lowbit.quantization.scaling_modes import DEFAULT_RHT_SIGN_MASK, INPUT_DTYPES, ScalingMode
from lowbit.quantization.tensor import ScaledTensor, fp4_pack, fp4_unpack, prod, register_dequantize


def quantize(
    x: ArrayLike,
    scaling_mode: ScalingMode,
    q_dtype: Optional[DTypeLike] = None,
    *,
    scale: Optional[ArrayLike] = None,
    layout: str = "rowwise",
    flatten_axis: int = -1,
    rng_key: Optional[jax.Array] = None,
    rht: bool = False,
    rht_sign_mask: int = DEFAULT_RHT_SIGN_MASK,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> ScaledTensor:
    """Quantizes ``x`` in one pass; see docs/numerics.md for the exact numerics.

    Args:
      x: float32/bfloat16/float16 array of any rank.
      scaling_mode: a :class:`lowbit.ScalingMode`.
      q_dtype: float8_e4m3fn or float8_e5m2 (FP8 modes), float4_e2m1fn (NVFP4); default E4M3/E2M1.
      scale: delayed scaling only, the float32 encode scale, shape ``()`` or ``(1,)``.
      layout: "rowwise", "colwise" or "both".
      flatten_axis: ``x`` is viewed as 2-D (prod(shape[:axis]), prod(shape[axis:])).
      rng_key: NVFP4 only: enables stochastic rounding.
      rht: NVFP4 1-D only: random Hadamard transform of the colwise copy.
      power_2_scale: FP8 block scaling only: block scales rounded down to powers of two.
      amax_epsilon: FP8 block scaling only: floor of each block's amax (float32, >= 0).
    """
    qt, _ = _quantize_impl(
        x,
        scaling_mode,
        q_dtype,
        scale,
        layout,
        flatten_axis,
        rng_key,
        rht,
        rht_sign_mask,
        dbias=False,
        power_2_scale=power_2_scale,
        amax_epsilon=amax_epsilon,
    )
    return qt


def quantize_dbias(
    x: ArrayLike,
    scaling_mode: ScalingMode,
    q_dtype: Optional[DTypeLike] = None,
    *,
    scale: Optional[ArrayLike] = None,
    layout: str = "rowwise",
    flatten_axis: int = -1,
    rng_key: Optional[jax.Array] = None,
    rht: bool = False,
    rht_sign_mask: int = DEFAULT_RHT_SIGN_MASK,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> tuple[ScaledTensor, jax.Array]:
    """Fused quantize + bias gradient: returns (ScaledTensor, column sums of the 2-D view).
    Arguments as :func:`quantize`."""
    return _quantize_impl(
        x,
        scaling_mode,
        q_dtype,
        scale,
        layout,
        flatten_axis,
        rng_key,
        rht,
        rht_sign_mask,
        dbias=True,
        power_2_scale=power_2_scale,
        amax_epsilon=amax_epsilon,
    )


def parts_fusable(parts: Sequence, scaling_mode) -> bool:
    """Whether :func:`quantize_parts` reads ``parts`` in place (else it concatenates them first):
    tensor or FP8 block scaling, 2 or 3 arrays of one shape (..., C) and dtype, rows a multiple of
    16 and C of 64 (the CUDA cast kernels' tiles)."""
    mode = ScalingMode(int(scaling_mode))
    in_place_modes = (ScalingMode.BLOCK_1D_SCALING, ScalingMode.BLOCK_2D_SCALING)
    if not 2 <= len(parts) <= ffi.MAX_PARTS or not (mode.is_tensor_scaling or mode in in_place_modes):
        return False
    shapes = {tuple(p.shape) for p in parts}
    dtypes = {np.dtype(p.dtype) for p in parts}
    if len(shapes) != 1 or len(dtypes) != 1:
        return False
    shape = shapes.pop()
    return len(shape) >= 2 and prod(shape[:-1]) % 16 == 0 and shape[-1] % 64 == 0


def quantize_parts(
    parts: Sequence[ArrayLike],
    scaling_mode: ScalingMode,
    q_dtype: Optional[DTypeLike] = None,
    *,
    scale: Optional[ArrayLike] = None,
    layout: str = "both",
    dbias: bool = False,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> tuple[ScaledTensor, Optional[jax.Array]]:
    """:func:`quantize_dbias` (``dbias``) or :func:`quantize` of ``jnp.concatenate(parts, -1)``
    without writing the concatenation (when :func:`parts_fusable`): the kernel reads each part
    where it lies. For gradients that arrive split, as dq, dk and dv of a fused QKV projection.
    Returns ``(ScaledTensor, dbias or None)``."""
    parts = [check_input(p, "parts") for p in parts]
    if not parts:
        raise ValueError("quantize_parts: parts must hold at least one array")
    if len({p.shape[:-1] for p in parts}) != 1 or any(p.ndim < 1 for p in parts):
        raise ValueError(
            "quantize_parts: parts must share every axis but the last (..., C_i), got shapes "
            f"{[tuple(p.shape) for p in parts]}"
        )
    mode = check_scaling_mode(scaling_mode)
    x, extra = parts[0], tuple(parts[1:])
    if extra and not parts_fusable(parts, mode):
        x, extra = jnp.concatenate(parts, axis=-1), ()
    return _quantize_impl(
        x,
        mode,
        q_dtype,
        scale,
        layout,
        -1,
        None,
        False,
        DEFAULT_RHT_SIGN_MASK,
        dbias,
        power_2_scale=power_2_scale,
        amax_epsilon=amax_epsilon,
        extra_parts=extra,
    )


def _quantize_impl(
    x,
    scaling_mode,
    q_dtype,
    scale,
    layout,
    flatten_axis,
    rng_key,
    rht,
    rht_sign_mask,
    dbias,
    power_2_scale=False,
    amax_epsilon=0.0,
    extra_parts=(),
):
    x = check_input(x)
    mode = check_scaling_mode(scaling_mode)
    q = check_q_dtype(mode, q_dtype, x.dtype)
    flags = check_layout(layout)
    rowwise, colwise = bool(flags & ffi.ROWWISE), bool(flags & ffi.COLWISE)
    n_parts = 1 + len(extra_parts)  # x and extra_parts: the columns of one tensor (quantize_parts)
    shape = tuple(x.shape[:-1]) + (x.shape[-1] * n_parts,) if extra_parts else tuple(x.shape)
    axis = check_flatten_axis(flatten_axis, x.ndim)
    check_block_multiple(mode, shape, axis, rowwise, colwise)
    rows, cols = prod(shape[:axis]), prod(shape[axis:])
    scale = check_tensor_scale(mode, scale)

    if rng_key is not None:
        if not mode.is_nvfp4:
            raise ValueError(f"rng_key (stochastic rounding) is only used with NVFP4 modes, not {mode.name}")
        seed = jax.random.bits(rng_key, (2,), jnp.uint32)
        flags |= ffi.STOCHASTIC
    else:
        seed = None
    rht_sign_mask = as_int(rht_sign_mask, "rht_sign_mask")
    if rht:
        if mode != ScalingMode.NVFP4_1D_SCALING:
            raise ValueError(f"rht (random Hadamard transform) needs NVFP4_1D_SCALING, not {mode.name}")
        flags |= ffi.RHT
    if dbias:
        flags |= ffi.DBIAS
    eps = check_block_options(mode, power_2_scale, amax_epsilon)
    if power_2_scale:
        flags |= ffi.POW2

    packed = mode.is_nvfp4
    part = (rows, cols // n_parts)
    data, s_inv, cw_data, cw_s_inv, amax, gsi, db = ffi.quantize(
        x.reshape(part),
        [p.reshape(part) for p in extra_parts],
        scale,
        seed,
        mode=mode,
        q=q,
        flags=flags,
        rht_sign_mask=rht_sign_mask & ffi.RHT_SIGN_MASK_BITS,
        amax_epsilon=eps,
    )

    cw_shape = shape[axis:] + shape[:axis]
    if rowwise:
        data = fp4_unpack(data, shape) if packed else data.reshape(shape)
    if colwise:
        cw_data = fp4_unpack(cw_data, cw_shape) if packed else cw_data.reshape(cw_shape)
    no_scale = mode == ScalingMode.NO_SCALING
    qt = ScaledTensor(
        data=data if rowwise else None,
        scale_inv=s_inv if rowwise and not no_scale else None,
        colwise_data=cw_data if colwise else None,
        colwise_scale_inv=cw_s_inv if colwise and not no_scale else None,
        amax=amax,
        global_scale_inv=gsi if mode.is_nvfp4 else None,
        scaling_mode=mode,
        q_dtype=q,
        dq_dtype=np.dtype(x.dtype),
        shape=shape,
        flatten_axis=axis,
        rht=bool(rht),
        rht_sign_mask=int(rht_sign_mask & ffi.RHT_SIGN_MASK_BITS) if rht else 0,
    )
    return qt, (db if dbias else None)


def dequantize(qt: ScaledTensor, layout: str = "rowwise", dtype: Optional[DTypeLike] = None) -> jax.Array:
    """Decodes one copy of ``qt`` back to its original shape (and dtype unless ``dtype`` is given)."""
    if not isinstance(qt, ScaledTensor):
        raise TypeError(f"qt must be a lowbit.ScaledTensor, got {type(qt).__name__}")
    if layout not in ("rowwise", "colwise"):
        raise ValueError(f"layout must be 'rowwise' or 'colwise', got {layout!r}")
    out_dtype = as_dtype(dtype if dtype is not None else qt.dq_dtype, "dtype")
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {out_dtype.name}")
    validate(qt, layout, "dequantize")
    colwise = layout == "colwise"
    data = qt.colwise_data if colwise else qt.data
    s_inv = qt.colwise_scale_inv if colwise else qt.scale_inv
    mode = ScalingMode(qt.scaling_mode)
    if mode == ScalingMode.NO_SCALING:
        out = data.astype(out_dtype)
        return _from_colwise(out, qt.rows, qt.cols, qt.shape) if colwise else out
    r, c = (qt.cols, qt.rows) if colwise else (qt.rows, qt.cols)
    cfg = _DequantizeConfig(
        mode,
        np.dtype(qt.q_dtype),
        out_dtype,
        r,
        c,
        colwise,
        qt.rht and colwise,
        qt.rht_sign_mask,
        qt.shape,
        qt.flatten_axis,
    )
    return _dequantize(cfg, data, s_inv, qt.global_scale_inv)


register_dequantize(dequantize)  # ScaledTensor.dequantize() (lowbit.quantization sits below)


def _from_colwise(colwise, rows: int, cols: int, shape):
    """A colwise-layout array (any shape holding cols x rows) -> the original layout."""
    return colwise.reshape(cols, rows).T.reshape(shape)


def _dequantize_ffi(data, s_inv, gsi, mode, q, out_dtype, r, c, colwise, rht, mask):
    d = fp4_pack(data, r, c) if mode.is_nvfp4 else data.reshape(r, c)
    g = gsi[1:2] if (mode.is_nvfp4 and colwise) else (gsi[0:1] if mode.is_nvfp4 else None)
    return ffi.dequantize(d, s_inv, g, mode=mode, q=q, out_dtype=out_dtype, rht=rht, rht_sign_mask=mask)


@dataclasses.dataclass(frozen=True)
class _DequantizeConfig:
    """The decode of one copy: its 2-D (rows, cols) as stored (the colwise copy: transposed), and
    the tensor's shape and flatten_axis."""

    mode: ScalingMode
    q_dtype: Any
    out_dtype: Any
    rows: int
    cols: int
    colwise: bool
    rht: bool
    rht_sign_mask: int
    shape: tuple
    flatten_axis: int


# Decoding is linear in the data and, for tensor scaling, in scale_inv: those gradients are
# defined. Block scales (E8M0/E4M3 codes) get zero gradients.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dequantize(cfg: _DequantizeConfig, data, s_inv, gsi):
    r, c = cfg.rows, cfg.cols
    out2d = _dequantize_ffi(
        data, s_inv, gsi, cfg.mode, cfg.q_dtype, cfg.out_dtype, r, c, cfg.colwise, cfg.rht, cfg.rht_sign_mask
    )
    return _from_colwise(out2d, c, r, cfg.shape) if cfg.colwise else out2d.reshape(cfg.shape)


def _dequantize_fwd(cfg: _DequantizeConfig, data, s_inv, gsi):
    return _dequantize(cfg, data, s_inv, gsi), (data, s_inv, gsi)


def _dequantize_bwd(cfg: _DequantizeConfig, res, g):
    data, s_inv, gsi = res
    shape, axis = cfg.shape, cfg.flatten_axis
    g2 = g.reshape(prod(shape[:axis]), prod(shape[axis:])).astype(jnp.float32)
    g2 = g2.T if cfg.colwise else g2
    if cfg.mode.is_tensor_scaling:
        dec = data.reshape(cfg.rows, cfg.cols).astype(jnp.float32)
        d_data = (g2 * s_inv[0]).astype(data.dtype).reshape(data.shape)
        d_s = jnp.sum(g2 * dec).reshape(s_inv.shape).astype(s_inv.dtype)
        return d_data, d_s, _zeros_or_none(gsi)
    return _zeros_or_none(data), _zeros_or_none(s_inv), _zeros_or_none(gsi)


_dequantize.defvjp(_dequantize_fwd, _dequantize_bwd)


def _zeros_or_none(a):
    return None if a is None else jnp.zeros_like(a)


def grouped_dequantize(
    qt: ScaledTensor, group_sizes: ArrayLike, layout: str = "rowwise", dtype: Optional[DTypeLike] = None
) -> jax.Array:
    """Decodes a grouped_quantize result to (M, K); rows in no group decode to zero.

    Groups are laid out as grouped_quantize lays them: negative sizes count as 0 and the group
    ends are clamped to M, so a sum past M (even past 2**31) never wraps."""
    op = "grouped_dequantize"
    if not isinstance(qt, ScaledTensor):
        raise TypeError(f"{op}: qt must be a lowbit.ScaledTensor, got {type(qt).__name__}")
    if layout not in ("rowwise", "colwise"):
        raise ValueError(f"{op}: layout must be 'rowwise' or 'colwise', got {layout!r}")
    if not isinstance(qt.shape, tuple) or len(qt.shape) != 2:
        raise ValueError(f"{op}: qt.shape must be 2-D (M, K) as grouped_quantize makes it, got {qt.shape!r}")
    group_sizes = as_array(host_group_sizes(group_sizes, qt.shape[0]), f"{op}: group_sizes")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{op}: group_sizes must be an integer array of shape (G,), got {_desc(group_sizes)}")
    group_sizes = group_sizes_int32(group_sizes, qt.shape[0])
    G = group_sizes.shape[0]
    out_dtype = as_dtype(dtype if dtype is not None else qt.dq_dtype, f"{op}: dtype")
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {out_dtype.name}")
    M, K = qt.shape
    if qt.scaling_mode == ScalingMode.MXFP8_1D_SCALING:
        validate(qt, layout, op)
        return dequantize(qt, layout, dtype=out_dtype)
    if qt.scaling_mode == ScalingMode.BLOCK_1D_SCALING:
        validate(qt, layout, op, num_groups=G)
        return _grouped_dequantize_block1d(qt, group_sizes, layout, out_dtype)
    if not ScalingMode(qt.scaling_mode).is_tensor_scaling:
        raise ValueError(
            f"{op}: qt.scaling_mode must be one grouped_quantize makes (DELAYED/CURRENT_TENSOR_"
            f"SCALING, MXFP8_1D_SCALING or BLOCK_1D_SCALING), got {ScalingMode(qt.scaling_mode).name}"
        )
    s_field = "colwise_scale_inv" if layout == "colwise" else "scale_inv"
    s_inv = getattr(qt, s_field)
    if s_inv is not None and getattr(s_inv, "ndim", None) == 1 and s_inv.shape[0] != G:
        raise ValueError(
            f"{op}: group_sizes has {G} groups but qt.{s_field} has {s_inv.shape[0]} "
            f"(one decode scale per group); pass the group_sizes given to grouped_quantize"
        )
    validate(qt, layout, op, num_groups=G)
    gid = group_ids(group_sizes, M)
    data = qt.data if layout == "rowwise" else qt.colwise_data.T

    def fast(data, s_inv):
        row_scale = jnp.concatenate([s_inv, jnp.zeros((1,), jnp.float32)])[gid]
        return (data.astype(jnp.float32) * row_scale[:, None]).astype(out_dtype)

    def exact(data, s_inv):
        # One dequantize kernel call per group (G passes over the data): the kernels keep float32
        # subnormals (docs/numerics.md), while XLA's CPU threads flush them to zero.
        def body(g, acc):
            dq = _dequantize_ffi(
                data,
                jax.lax.dynamic_slice(s_inv, (g,), (1,)),
                None,
                qt.scaling_mode,
                np.dtype(qt.q_dtype),
                out_dtype,
                M,
                K,
                False,
                False,
                0,
            )
            return jnp.where((gid == g)[:, None], dq, acc)

        return jax.lax.fori_loop(0, G, body, jnp.zeros((M, K), out_dtype))

    # decode(q) * scale_inv is a normal float32 or 0 whenever every scale_inv >= 2^-110 (the
    # smallest nonzero FP8 magnitude is 2^-16); only then is the plain XLA product exact.
    return jax.lax.cond(jnp.all(s_inv >= np.float32(2.0**-110)), fast, exact, data, s_inv)


def _grouped_dequantize_block1d(qt, group_sizes, layout, out_dtype):
    """decode(q) * scale_inv of every element, the scale gathered from the grouped layouts
    (rows in no group: 0). float32 products in XLA (a subnormal product may flush to zero on
    the CPU, unlike the kernels)."""
    M, K = qt.shape
    G = group_sizes.shape[0]
    ends = group_ends(group_sizes.astype(jnp.int32), M)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    gid = group_ids(group_sizes, M)  # G: in no group
    r = jnp.arange(M, dtype=jnp.int32)
    start = jnp.concatenate([starts, ends[-1:]])[gid]
    if layout == "rowwise":
        nkb = -(-K // 128)
        size = jnp.concatenate([ends - starts, jnp.int32(M) - ends[-1:]])[gid]
        kb = jnp.arange(K, dtype=jnp.int32) // 128
        idx = start[:, None] * nkb + kb[None, :] * size[:, None] + (r - start)[:, None]
        out = qt.data.astype(jnp.float32) * qt.scale_inv[idx]
    else:
        row = start // 128 + gid + (r - start) // 128
        row = jnp.where(gid < G, row, 0)
        out = qt.colwise_data.T.astype(jnp.float32) * qt.colwise_scale_inv[row]
        out = jnp.where((gid < G)[:, None], out, 0.0)
    return out.astype(out_dtype)


def _wider_than_int32(dtype) -> bool:
    d = np.dtype(dtype)
    return d.kind in "iu" and np.iinfo(d).max > np.iinfo(np.int32).max


def host_group_sizes(group_sizes, extent: int):
    """A host value (NumPy, list) of a wider integer dtype clipped to [0, ``extent``] as int32,
    before jnp.asarray would wrap it (int64 2**32 + 10 -> 10); the clipped sizes lay out the
    same groups (negative counts as 0, groups end at ``extent``). Anything else unchanged."""
    if isinstance(group_sizes, jax.Array):
        return group_sizes
    try:
        host = np.asarray(group_sizes)
    except (TypeError, ValueError):
        return group_sizes  # refused by as_array, naming the argument
    return np.clip(host, 0, extent).astype(np.int32) if _wider_than_int32(host.dtype) else group_sizes


def group_sizes_int32(group_sizes: jax.Array, extent: int) -> jax.Array:
    """Integer ``group_sizes`` as int32 without a wrap: a wider dtype (uint32 2**32 - 1 would
    become -1) is clipped to [0, ``extent``] on the device first (no host sync)."""
    if _wider_than_int32(group_sizes.dtype):
        group_sizes = jnp.clip(group_sizes, 0, extent)
    return group_sizes.astype(jnp.int32)


def group_ends(group_sizes: jax.Array, extent: int) -> jax.Array:
    """Group ends as the kernels compute them: sizes below 0 count as 0 and the running sum
    saturates at ``extent``, so it never overflows int32 (a plain cumsum wraps past 2**31)."""
    sizes = jnp.clip(group_sizes, 0, extent).astype(jnp.int32)

    def sat_add(a, b):  # a, b in [0, extent]: a + min(b, extent - a) cannot overflow
        return a + jnp.minimum(b, jnp.int32(extent) - a)

    return jax.lax.associative_scan(sat_add, sizes)


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of every row, (rows,) int32; G for rows in no group."""
    ends = group_ends(group_sizes, rows)
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")


def _desc(a) -> str:
    return f"{np.dtype(a.dtype).name} {tuple(a.shape)}"


def grouped_quantize(
    x: ArrayLike,
    group_sizes: ArrayLike,
    scaling_mode: ScalingMode,
    q_dtype: Optional[DTypeLike] = None,
    *,
    scale: Optional[ArrayLike] = None,
    layout: str = "rowwise",
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> ScaledTensor:
    """Quantizes the row groups of ``x`` (M, K) as separate tensors; ``group_sizes`` int32 (G,)
    stays on the device (a host array of a wider integer type is clipped to [0, M] first: the
    same groups, no wrap). Returns a ScaledTensor whose scales and amax have one entry per group
    (tensor modes) and whose colwise copy is the (K, M) transpose.

    ``BLOCK_1D_SCALING`` (Float8BlockScaling's activations and gradients): 1x128 blocks along K
    for the rowwise copy and, for the colwise copy, 1x128 blocks along the rows *inside each
    group* (a block never straddles two groups). The scales are laid out as the grouped GEMM
    reads them (csrc/include/lowbit/block_scaling.h): ``scale_inv`` (M * ceil(K/128),) float32,
    per group an M-major (ceil(K/128), size_g) array at offset start_g * ceil(K/128);
    ``colwise_scale_inv`` (M // 128 + G, K) float32, block j of group g in row
    start_g // 128 + g + j (other rows 1.0). ``amax`` holds each group's amax.
    ``power_2_scale`` / ``amax_epsilon``: as :func:`quantize` (BLOCK_1D only). MXFP8 is
    rowwise only (its colwise blocks would straddle groups); BLOCK_2D_SCALING is refused (its
    128x128 tiles would)."""
    x = check_input(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K) for grouped_quantize, got shape {tuple(x.shape)}")
    group_sizes = as_array(host_group_sizes(group_sizes, x.shape[0]), "group_sizes")
    if group_sizes.ndim != 1 or np.dtype(group_sizes.dtype) != np.int32:
        raise TypeError(
            f"group_sizes must be int32 of shape (G,), got {group_sizes.dtype} {group_sizes.shape}"
        )
    if group_sizes.shape[0] < 1:
        raise ValueError("group_sizes must have shape (G,) with at least one group, got shape (0,)")
    mode = check_scaling_mode(scaling_mode)
    if not (mode.is_tensor_scaling or mode in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.BLOCK_1D_SCALING)):
        raise ValueError(
            f"scaling_mode must be DELAYED/CURRENT_TENSOR_SCALING, MXFP8_1D_SCALING or BLOCK_1D_SCALING "
            f"for grouped_quantize, got {mode.name}"
            + (" (128x128 tiles would straddle groups)" if mode == ScalingMode.BLOCK_2D_SCALING else "")
        )
    eps = check_block_options(mode, power_2_scale, amax_epsilon)
    q = check_q_dtype(mode, q_dtype, x.dtype)
    flags = check_layout(layout)
    rowwise, colwise = bool(flags & ffi.ROWWISE), bool(flags & ffi.COLWISE)
    M, K = x.shape
    G = group_sizes.shape[0]
    if mode == ScalingMode.MXFP8_1D_SCALING:
        if colwise:
            raise ValueError(
                f"layout must be 'rowwise' for grouped MXFP8_1D_SCALING, got {layout!r} "
                "(colwise blocks would straddle groups)"
            )
        if K % 32:
            raise ValueError(
                f"x: size {K} of the contraction axis (1) must be a multiple of 32 for MXFP8_1D_SCALING"
            )
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        if scale is None:
            raise ValueError("scale (float32, shape (G,)) is required for DELAYED_TENSOR_SCALING")
        scale = as_array(scale, "scale")
        if scale.shape != (G,) or np.dtype(scale.dtype) != np.float32:
            raise TypeError(f"scale must be float32 of shape ({G},), got {scale.dtype} {scale.shape}")
        scale = check_scale_value(scale, "scale")
    elif scale is not None:
        raise ValueError(f"scale is only used with DELAYED_TENSOR_SCALING, not {mode.name}")

    if mode == ScalingMode.BLOCK_1D_SCALING and power_2_scale:
        flags |= ffi.POW2
    data, s_inv, cw, cw_s, amax = ffi.grouped_quantize(
        x, group_sizes, scale, mode=mode, q=q, flags=flags, amax_epsilon=eps
    )
    return ScaledTensor(
        data=data if rowwise else None,
        scale_inv=s_inv if rowwise else None,
        colwise_data=cw if colwise else None,
        colwise_scale_inv=cw_s if colwise else None,
        amax=amax,
        global_scale_inv=None,
        scaling_mode=mode,
        q_dtype=q,
        dq_dtype=np.dtype(x.dtype),
        shape=(M, K),
        flatten_axis=1,
    )
