"""gemm: out = A . B^T with both operands K-major (contraction over their last axis).

Per-tensor FP8 operands (E4M3/E5M2 with float32 decode scales) and BF16 operands go to one XLA
FFI call (cuBLASLt on the GPU, a C++ loop on the CPU). MXFP8 and NVFP4 operands take the study
path: they are decoded exactly to BF16 and multiplied by the same BF16 GEMM, which reproduces a
block-scaled GEMM's numerics on GPUs without block-scaled tensor cores (Hopper); it is not fast.
FP8 block-scaled operands (BLOCK_1D/2D_SCALING, Float8BlockScaling) go to cuBLASLt's
block-scaled FP8 GEMM (VEC128_32F / BLK128x128_32F scales, Hopper) as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike, DTypeLike

from lowbit.ops._ffi import gemm as ffi
from lowbit.ops.quantize import dequantize
from lowbit.quantization.checks import as_array, as_dtype, validate
from lowbit.quantization.scaling_modes import FP8_DTYPES, ScalingMode
from lowbit.quantization.tensor import ScaledTensor, prod

# Name given to every GEMM output, so remat policies can save it (lowbit.checkpoint_policies).
GEMM_CHECKPOINT_NAME = "lowbit_gemm"
_BLOCK_FLAG = {ScalingMode.BLOCK_1D_SCALING: ffi.BLOCK_1D, ScalingMode.BLOCK_2D_SCALING: ffi.BLOCK_2D}
_BLOCK_K_ALIGN = 128  # block-scaled GEMMs get K in whole 128-blocks (zero padding: same result)

_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(jnp.float32)
_E5M2 = np.dtype(jnp.float8_e5m2)
_FP8_ALIGN = 16  # cuBLASLt FP8: K (leading dimension) and N in multiples of 16 bytes/elements


@dataclasses.dataclass(frozen=True)
class _Operand:
    """One GEMM operand as a K-major 2-D matrix, plus how to decode it."""

    kind: str  # "bf16", "fp8" (per-tensor scale), "fp8block" (FP8 block scaling), "block" (MX/NV)
    lead: tuple  # the non-contracted dims, in the copy's order
    k: int  # contraction size
    data: Optional[jax.Array] = None  # (rows, k) for bf16/fp8/fp8block
    scale_inv: Optional[jax.Array] = None  # (1,) float32 for fp8; the block-scale array for fp8block
    qt: Optional[ScaledTensor] = None  # block-scaled source tensor
    layout: str = "rowwise"
    mode: Optional[ScalingMode] = None

    @property
    def rows(self) -> int:
        return prod(self.lead)


def _operand(x, name: str, layout: Optional[str]) -> _Operand:
    if isinstance(x, ScaledTensor):
        return _scaled_operand(x, name, layout)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(
            f"gemm: {name} must be a bfloat16 array or a lowbit.ScaledTensor, got {type(x).__name__}"
        )
    if layout is not None:
        raise ValueError(
            f"gemm: {name}_layout must be None for an array operand {name} (it picks a copy "
            f"of a ScaledTensor), got {layout!r}"
        )
    if np.dtype(x.dtype) != _BF16:
        raise TypeError(
            f"gemm: array operand {name} must be bfloat16, got {np.dtype(x.dtype).name}; cast it, or "
            "quantize it with lowbit.quantize for an FP8 GEMM"
        )
    if x.ndim < 1:
        raise ValueError(f"gemm: {name} must have at least one dimension (its last is contracted)")
    lead, k = tuple(x.shape[:-1]), int(x.shape[-1])
    return _Operand("bf16", lead, k, data=x.reshape(prod(lead), k))


def _scaled_operand(qt: ScaledTensor, name: str, layout: Optional[str]) -> _Operand:
    if layout is None:
        layout = "rowwise" if qt.has_rowwise else "colwise"
    if layout not in ("rowwise", "colwise"):
        raise ValueError(f"gemm: {name}_layout must be 'rowwise' or 'colwise', got {layout!r}")
    validate(qt, layout, "gemm", name)
    colwise = layout == "colwise"
    data = qt.colwise_data if colwise else qt.data
    ax = qt.flatten_axis
    lead = tuple(qt.shape[ax:]) if colwise else tuple(qt.shape[:ax])
    k = qt.rows if colwise else qt.cols
    mode = qt.scaling_mode
    if mode == ScalingMode.NO_SCALING:
        if np.dtype(data.dtype) != _BF16:
            raise TypeError(
                f"gemm: {name} holds {np.dtype(data.dtype).name} data; only bfloat16 is supported"
            )
        return _Operand("bf16", lead, k, data=data.reshape(prod(lead), k))
    if mode.is_tensor_scaling or mode.is_fp8_block:
        s_inv = qt.colwise_scale_inv if colwise else qt.scale_inv
        kind = "fp8" if mode.is_tensor_scaling else "fp8block"
        return _Operand(
            kind, lead, k, data=data.reshape(prod(lead), k), scale_inv=s_inv, qt=qt, layout=layout, mode=mode
        )
    return _Operand("block", lead, k, qt=qt, layout=layout, mode=mode)


def _block_family(mode: ScalingMode) -> str:
    return "NVFP4" if mode.is_nvfp4 else "MXFP8"


def _check_pair(a: _Operand, b: _Operand) -> None:
    if a.k != b.k:
        raise ValueError(
            f"gemm: contraction sizes differ: a has K={a.k} (non-contracted dims {a.lead}), "
            f"b has K={b.k} (non-contracted dims {b.lead})"
        )
    if a.kind != b.kind:
        desc = {
            "bf16": "BF16",
            "fp8": "per-tensor FP8",
            "fp8block": "FP8 block-scaled (BLOCK_1D/2D_SCALING)",
            "block": "block-scaled (MXFP8/NVFP4)",
        }
        raise TypeError(
            f"gemm: operands must both be {desc[a.kind]}; a is {desc[a.kind]}, b is {desc[b.kind]}"
        )
    if a.kind == "fp8block" and a.mode == b.mode == ScalingMode.BLOCK_2D_SCALING:
        raise TypeError(
            "gemm: a and b are both BLOCK_2D_SCALING (128x128 tiles): cuBLASLt's block-scaled FP8 "
            "GEMM takes 1Dx1D, 1Dx2D or 2Dx1D; quantize one operand with BLOCK_1D_SCALING"
        )
    if a.kind in ("fp8", "fp8block"):
        qa, qb = np.dtype(a.qt.q_dtype), np.dtype(b.qt.q_dtype)
        for q, n in ((qa, "a"), (qb, "b")):
            if q not in FP8_DTYPES:
                raise TypeError(f"gemm: {n} must hold float8_e4m3fn or float8_e5m2 data, got {q.name}")
        if qa == _E5M2 and qb == _E5M2:
            raise TypeError(
                "gemm: a and b are both float8_e5m2 (their q_dtype): E5M2 x E5M2 is not "
                "supported "
                "(the FP8 tensor cores need float8_e4m3fn on one side)"
            )
    if a.kind == "block":
        fa, fb = _block_family(a.mode), _block_family(b.mode)
        if fa != fb:
            raise TypeError(
                f"gemm: a and b must use the same block-scaled format (their scaling_mode); "
                f"a is {fa} ({a.mode.name}), b is {fb} ({b.mode.name})"
            )
        ra = a.qt.rht and a.layout == "colwise"
        rb = b.qt.rht and b.layout == "colwise"
        if ra != rb or (ra and a.qt.rht_sign_mask != b.qt.rht_sign_mask):
            raise ValueError(
                "gemm: both NVFP4 operands must carry the same random Hadamard transform (or neither); "
                f"a.rht={ra}, b.rht={rb} (on the copies used)"
            )


def _check_out_dtype(out_dtype):
    d = as_dtype(out_dtype, "gemm: out_dtype")
    if d not in (_BF16, _F32):
        raise TypeError(f"gemm: out_dtype must be bfloat16 or float32, got {d.name}")
    return d


def gemm_out_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype to ask the GEMM for: it writes BF16 or F32; other dtypes are cast from F32."""
    d = np.dtype(dtype)
    return d if d in (_BF16, _F32) else _F32


def gemm_bias(bias: Optional[jax.Array]) -> Optional[jax.Array]:
    """A bias the GEMM takes (BF16 or F32): other dtypes become F32 (exact for float16)."""
    if bias is not None and np.dtype(bias.dtype) not in (_BF16, _F32):
        return bias.astype(jnp.float32)
    return bias


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """x zero-padded at the end of ``axis`` to a multiple of ``multiple`` (zeros add nothing
    to a product, so GEMM operands are padded to the kernels' alignment and sliced after)."""
    extra = (-x.shape[axis]) % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _splits_in_place(N, parts, fp8):
    """Whether the GEMM's ``parts`` column blocks can be written in place (else: slices of the
    whole): whole blocks, and for FP8 no padding of B's rows and blocks of 16-element multiples
    (cuBLASLt's alignment)."""
    if parts == 1:
        return True
    return N % parts == 0 and (not fp8 or (N // parts) % _FP8_ALIGN == 0)


def _gemm_2d(a2, b2, a_s, b_s, bias, out_dtype, fast_accum, fp8, parts=1):
    """Pads FP8 operands to cuBLASLt's alignment (zeros add nothing) and routes the bias. With
    ``parts`` > 1 returns the tuple of the product's column blocks."""
    M, N = a2.shape[0], b2.shape[0]
    if fp8:
        a2 = pad_to(a2, 1, _FP8_ALIGN)
        b2 = pad_to(pad_to(b2, 1, _FP8_ALIGN), 0, _FP8_ALIGN)
    # Fused epilogue where cuBLASLt takes the bias type: BF16 bias always (FP8 and BF16 GEMMs),
    # or an F32 bias for an F32 output of a BF16 GEMM. Otherwise add it in F32 outside.
    fused_bias, outer_bias = None, None
    if bias is not None:
        bd = np.dtype(bias.dtype)
        if bd == _BF16 and (fp8 or out_dtype == _BF16):
            fused_bias = bias
        elif not fp8 and out_dtype == _F32:
            fused_bias = bias.astype(jnp.float32)
        else:
            outer_bias = bias
    if fused_bias is not None and b2.shape[0] != N:
        fused_bias = pad_to(fused_bias, 0, _FP8_ALIGN)
    ffi_out = out_dtype if outer_bias is None else _F32
    in_place = parts > 1 and _splits_in_place(N, parts, fp8)
    out = ffi.gemm(
        a2, b2, a_s, b_s, fused_bias, ffi_out, fast_accum=fast_accum, parts=parts if in_place else 1
    )
    return _column_blocks(out, M, N, parts, in_place, outer_bias, out_dtype)


def _column_blocks(out, M, N, parts, in_place, outer_bias, out_dtype):
    """The GEMM's result as its ``parts`` column blocks (M, N / parts): the FFI's outputs where
    it wrote them in place, else slices of the whole (cut back to M rows and N columns where
    the operands were padded), each with the bias added in float32 when the GEMM did not add it;
    one array when ``parts`` is 1."""
    w = N // parts
    outs = list(out) if in_place else [out[:, i * w : (i + 1) * w] for i in range(parts)]
    outs = [o[:M] if o.shape[0] != M else o for o in outs]
    if outer_bias is not None:
        outs = [
            (o + outer_bias[i * w : (i + 1) * w].astype(jnp.float32)).astype(out_dtype)
            for i, o in enumerate(outs)
        ]
    return tuple(outs) if parts > 1 else outs[0]


def _fp8_block_gemm(a: _Operand, b: _Operand, bias, out_dtype, parts: int = 1):
    """FP8 block scaling: the block-scale arrays go to the GEMM as they are (cuBLASLt's layout).

    K is zero-padded to whole 128-blocks and M and N to cuBLASLt's FP8 alignment (16); zeros
    add nothing and leave the number of K blocks (hence the scale arrays) unchanged, except that
    a 1x128 operand's scale array gains columns for the padded rows (filled with 1). With M, N
    multiples of 16 the 1x128 scale arrays' leading dimension round_up(rows, 4) equals rows,
    which is what cuBLASLt reads (its docs give the 1x128 scales of an (M, K) operand strides
    (1, M)). The bias goes to the GEMM's epilogue where it has one (ffi.block_bias_fused), else
    it is added in float32 after an F32 GEMM: both round acc + bias once. ``parts`` > 1 returns
    the tuple of the product's column blocks, written in place where ``_block_splits_in_place``."""
    a2, b2, sa, sb = a.data, b.data, a.scale_inv, b.scale_inv
    M, N = a2.shape[0], b2.shape[0]
    a2 = pad_to(pad_to(a2, 1, _BLOCK_K_ALIGN), 0, _FP8_ALIGN)
    b2 = pad_to(pad_to(b2, 1, _BLOCK_K_ALIGN), 0, _FP8_ALIGN)

    def pad_rows_of_1d(s, op, rows):  # a 1x128 scale array has a column per operand row
        if op.mode == ScalingMode.BLOCK_1D_SCALING and s.shape[1] < rows:
            return jnp.pad(s, ((0, 0), (0, rows - s.shape[1])), constant_values=1.0)
        return s

    sa, sb = pad_rows_of_1d(sa, a, a2.shape[0]), pad_rows_of_1d(sb, b, b2.shape[0])
    blocks = (_BLOCK_FLAG[a.mode], _BLOCK_FLAG[b.mode])
    # The bias in the GEMM's epilogue where it has one (rounded once, as below), else in F32 after.
    fused = bias is not None and ffi.block_bias_fused(a2.dtype, b2.dtype, blocks, out_dtype)
    ffi_bias = pad_to(bias, 0, _FP8_ALIGN) if fused else None
    ffi_out = out_dtype if bias is None or fused else _F32
    in_place = parts > 1 and _block_splits_in_place(N, parts, b.mode, bias is None or fused)
    out = ffi.gemm(
        a2, b2, sa, sb, ffi_bias, ffi_out, fast_accum=False, blocks=blocks, parts=parts if in_place else 1
    )
    return _column_blocks(out, M, N, parts, in_place, None if fused else bias, out_dtype)


def _block_splits_in_place(N, parts, b_mode, bias_in_gemm):
    """Whether a block-scaled GEMM writes its ``parts`` column blocks in place: B 128x128-scaled
    with each block whole 128-row bands of B and its scales (no padding of B's rows), and the bias
    (if any) in the GEMM's epilogue."""
    return b_mode == ScalingMode.BLOCK_2D_SCALING and (N // parts) % 128 == 0 and bias_in_gemm


def _ldexp_exact(x, n):
    """``x * 2**n`` (float32 x, int32 n) rounded once to nearest-even, computed on the bits.

    XLA's CPU threads flush subnormal float32 results (and inputs) to zero; docs/numerics.md keeps
    them, so scaling that may leave the normal range is done here in integer arithmetic."""
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(x, u32)
    sign = bits & u32(0x80000000)
    e = ((bits >> 23) & u32(0xFF)).astype(jnp.int32)
    m = bits & u32(0x7FFFFF)
    mant = jnp.where(e > 0, m | u32(0x800000), m)  # value = mant * 2^(max(e, 1) - 150)
    lz = jax.lax.clz(mant).astype(jnp.int32) - 8  # normalize mant to [2^23, 2^24)
    mant = mant << jnp.clip(lz, 0, 31).astype(u32)
    E = jnp.maximum(e, 1) + n - lz  # biased exponent of the result
    normal = sign | (jnp.clip(E, 1, 254).astype(u32) << 23) | (mant & u32(0x7FFFFF))
    sh = jnp.clip(1 - E, 1, 31).astype(u32)  # subnormal result: shift right, round to even
    q = mant >> sh
    rem = mant & ((u32(1) << sh) - u32(1))
    half = u32(1) << (sh - u32(1))
    q = q + ((rem > half) | ((rem == half) & ((q & u32(1)) == u32(1)))).astype(u32)
    out = jnp.where(E >= 255, sign | u32(0x7F800000), jnp.where(E >= 1, normal, sign | q))
    out = jnp.where((e == 255) | (mant == 0), bits, out)  # NaN, Inf, zeros unchanged
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def _frexp_bits(g):
    """A float32 scalar g > 0 (also subnormal) as (m, e): g = m * 2^e, m float32 in [1, 2)."""
    bits = jax.lax.bitcast_convert_type(g, jnp.uint32)
    e = ((bits >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    m = bits & jnp.uint32(0x7FFFFF)
    lz = jax.lax.clz(m).astype(jnp.int32) - 8  # subnormal: normalize the significand
    m = jnp.where(e > 0, m, (m << jnp.clip(lz, 0, 31).astype(jnp.uint32)) & jnp.uint32(0x7FFFFF))
    e = jnp.where(e > 0, e, 1 - lz) - 127
    return jax.lax.bitcast_convert_type(m | jnp.uint32(127 << 23), jnp.float32), e


# bf16 of decode(q) * 2^(b-127) is exact while it stays a normal bf16: nonzero FP8 magnitudes
# lie in [2^-16, 2^16), so codes b in [17, 238] are safe.
_MX_SAFE_LO, _MX_SAFE_HI = 17, 238


def _block_gemm(a: _Operand, b: _Operand, bias, out_dtype):
    """Study path for MXFP8/NVFP4: exact BF16 decode of each copy, BF16 GEMM with float32
    accumulation, then NVFP4's float32 tensor scales, as a block-scaled GEMM applies them.

    Values below float32's normal range stay exact: MXFP8 block scales are raised by a power of
    two per operand before the BF16 decode (a subnormal BF16 would drop significand bits) and the
    product is scaled back on the bits (_ldexp_exact); NVFP4's two tensor scales are applied as
    their significands, then their exponents (ga * gb alone underflows for tiny tensors)."""
    shift = jnp.int32(0)

    def decode(op: _Operand):
        nonlocal shift
        qt = op.qt
        if qt.scaling_mode.is_nvfp4:
            # E2M1 x E4M3 products are exact in BF16; the tensor scale is applied after the
            # GEMM. The Hadamard transform is kept: both operands carry it, and it cancels.
            qt = dataclasses.replace(qt, global_scale_inv=jnp.ones((2,), jnp.float32), rht=False)
        else:
            field = "colwise_scale_inv" if op.layout == "colwise" else "scale_inv"
            codes = jax.lax.bitcast_convert_type(getattr(qt, field), jnp.uint8).astype(jnp.int32)
            k = jnp.clip(_MX_SAFE_LO - codes.min(), 0, jnp.maximum(_MX_SAFE_HI - codes.max(), 0))
            shift = shift + k  # 0 for tensors in the normal range: the plain decode, unchanged
            raised = jax.lax.bitcast_convert_type((codes + k).astype(jnp.uint8), jnp.float8_e8m0fnu)
            qt = dataclasses.replace(qt, **{field: raised})
        full = dequantize(qt, op.layout, dtype=jnp.bfloat16)
        if op.layout == "colwise":
            return full.reshape(qt.rows, qt.cols).T
        return full.reshape(qt.rows, qt.cols)

    out = _gemm_2d(decode(a), decode(b), None, None, None, _F32, False, fp8=False)
    if a.qt.scaling_mode.is_nvfp4:
        ga = a.qt.global_scale_inv[1 if a.layout == "colwise" else 0]
        gb = b.qt.global_scale_inv[1 if b.layout == "colwise" else 0]
        ma, ea = _frexp_bits(ga)
        mb, eb = _frexp_bits(gb)
        # Bit-identical to out * (ga * gb) whenever that is a normal float32.
        out = _ldexp_exact(out * (ma * mb), ea + eb)
        # A NaN tensor scale (an operand's Inf amax, nonfinite.py) poisons every product, as
        # out * (ga * gb) would; _frexp_bits reads a NaN as a finite significand.
        out = jnp.where(jnp.isnan(ga) | jnp.isnan(gb), jnp.float32(jnp.nan), out)
    else:
        out = _ldexp_exact(out, -shift)
    if bias is not None:
        b32 = bias.astype(jnp.float32)
        out = jnp.where(b32 == 0, out, out + b32)  # x + 0 would flush a subnormal x on the CPU
    return out.astype(out_dtype)


def gemm(
    a: Union[jax.Array, ScaledTensor],
    b: Union[jax.Array, ScaledTensor],
    bias: Optional[ArrayLike] = None,
    *,
    a_layout: Optional[str] = None,
    b_layout: Optional[str] = None,
    out_dtype: DTypeLike = jnp.bfloat16,
    fast_accum: bool = False,
    parts: int = 1,
) -> Union[jax.Array, tuple]:
    """``out = a . b^T (+ bias)``, contracting the last axis of both operands.

    Args:
      a: bfloat16 array ``(..., K)`` or a :class:`lowbit.ScaledTensor`; for a ScaledTensor the
        operand is one of its copies (``a_layout``: "rowwise", the data as quantized, contracting
        the axes from ``flatten_axis`` on; "colwise", the transposed copy, contracting the axes
        before ``flatten_axis``). Default: the rowwise copy if present.
      b: the same for the second operand ``(..., K)``.
      bias: optional ``(N,)`` (N = product of b's non-contracted dims), bfloat16 or float32.
      out_dtype: bfloat16 or float32.
      fast_accum: FP8 on the GPU only: cuBLASLt's fast accumulation (for forward GEMMs).
      parts: return the output's b dims (flattened, N) as this many equal contiguous blocks,
        each written in place where the operands allow it (per-tensor FP8 or BF16; FP8 block
        scaling with a 128x128-scaled b whose blocks are whole 128-row bands and the bias, if
        any, in the GEMM; else sliced from the whole): the fused QKV projection's q, k and v
        without copies.

    Returns:
      an array of shape ``a_lead + b_lead`` (the non-contracted dims of a, then of b); with
      ``parts`` > 1 a tuple of ``parts`` arrays ``a_lead + (N / parts,)``.

    Both operands must be of one kind: BF16, per-tensor FP8 (E4M3 x E4M3, E4M3 x E5M2 or
    E5M2 x E4M3; delayed and current scaling mix freely), FP8 block-scaled (BLOCK_1D/2D_SCALING,
    not both 2D; same FP8 pairs; split accumulation always), or block-scaled of one format
    (MXFP8, or NVFP4 with the same Hadamard transform on both or neither).
    """
    out_dtype = _check_out_dtype(out_dtype)
    pa = _operand(a, "a", a_layout)
    pb = _operand(b, "b", b_layout)
    _check_pair(pa, pb)
    M, N, K = pa.rows, pb.rows, pa.k
    if bias is not None:
        bias = as_array(bias, "gemm: bias")
        if np.dtype(bias.dtype) not in (_BF16, _F32):
            raise TypeError(f"gemm: bias must be bfloat16 or float32, got {np.dtype(bias.dtype).name}")
        if bias.size != N:
            raise ValueError(
                f"gemm: bias must have N={N} elements (b's non-contracted dims {pb.lead}), "
                f"got shape {bias.shape}"
            )
        bias = bias.reshape(N)
    shape = pa.lead + pb.lead
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1 or N % parts:
        raise ValueError(
            f"gemm: parts must be a positive int dividing N={N} (b's non-contracted dims {pb.lead}), "
            f"got {parts!r}"
        )
    if parts > 1:
        part_shape = pa.lead + (N // parts,)
        if pa.kind in ("bf16", "fp8") and M and N and K:
            fp8 = pa.kind == "fp8"
            outs = _gemm_2d(
                pa.data, pb.data, pa.scale_inv, pb.scale_inv, bias, out_dtype, fast_accum and fp8, fp8, parts
            )
        elif pa.kind == "fp8block" and M and N and K:
            outs = _fp8_block_gemm(pa, pb, bias, out_dtype, parts)
        else:  # the whole product, then its blocks
            whole = gemm(
                a, b, bias, a_layout=a_layout, b_layout=b_layout, out_dtype=out_dtype, fast_accum=fast_accum
            )
            outs = jnp.split(whole.reshape(pa.lead + (N,)), parts, axis=-1)
        return tuple(checkpoint_name(o.reshape(part_shape), GEMM_CHECKPOINT_NAME) for o in outs)

    if M == 0 or N == 0 or K == 0:
        out = jnp.zeros((M, N), jnp.float32)
        if bias is not None:
            out = out + bias.astype(jnp.float32)
        return out.astype(out_dtype).reshape(shape)
    if pa.kind == "block":
        out = _block_gemm(pa, pb, bias, out_dtype)
    elif pa.kind == "fp8block":
        out = _fp8_block_gemm(pa, pb, bias, out_dtype)
    else:
        fp8 = pa.kind == "fp8"
        out = _gemm_2d(pa.data, pb.data, pa.scale_inv, pb.scale_inv, bias, out_dtype, fast_accum and fp8, fp8)
    return checkpoint_name(out.reshape(shape), GEMM_CHECKPOINT_NAME)
