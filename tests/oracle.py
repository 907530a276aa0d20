"""Independent NumPy reference of docs/numerics.md (the bit-exact quantization spec).

Written from the spec alone: it never calls lowbit's C++ and never uses ml_dtypes' float8/float4
casts for rounding. Rounding onto each element format's grid is done here with float64 frexp/ldexp
and round-half-to-even (``np.rint``); float32 steps the spec names (``x * scale``, ``(a/6)*S``,
``S/decode(sb)``, the Hadamard butterflies, the dequantize products) are done with np.float32
arithmetic, which is IEEE round-to-nearest-even with subnormals (checked by ``_self_check``).

Everything takes / returns NumPy arrays:

* data codes are ``uint8`` (FP4: one unpacked code 0..15 per element, sign in bit 3);
* tensor-scaling ``scale_inv`` is float32 ``(1,)``; MXFP8 ``scale_inv`` is the E8M0 code (uint8),
  NVFP4 ``scale_inv`` the E4M3 code (uint8); NVFP4 ``global_scale_inv`` float32 ``(2,)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

F32 = np.float32
FLT_MAX = np.float32(np.finfo(np.float32).max)

# Mode numbers of lowbit.ScalingMode (kept as plain ints so the oracle imports nothing of lowbit).
NO_SCALING, DELAYED, CURRENT, MXFP8, NVFP4_1D, NVFP4_2D, BLOCK_1D, BLOCK_2D = 0, 1, 2, 3, 4, 5, 6, 7
TENSOR_MODES = (DELAYED, CURRENT)
FP8_BLOCK_MODES = (BLOCK_1D, BLOCK_2D)
NVFP4_MODES = (NVFP4_1D, NVFP4_2D)


# --------------------------------------------------------------------------------------------
# Element formats
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fmt:
    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    nan_code: int  # what enc(NaN) returns

    @property
    def emin(self) -> int:  # exponent of the smallest normal
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)


E4M3 = Fmt("float8_e4m3fn", 4, 3, 7, 448.0, 0x7F)
E5M2 = Fmt("float8_e5m2", 5, 2, 15, 57344.0, 0x7F)
E2M1 = Fmt("float4_e2m1fn", 2, 1, 1, 6.0, 0x07)  # no NaN: NaN encodes as +6
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}


def fmt_of(q_dtype) -> Fmt:
    return FORMATS[np.dtype(q_dtype).name]


def encode(v, fmt: Fmt) -> np.ndarray:
    """enc(v): float32 -> format code (uint8). RNE onto the grid, sign kept, saturating, NaN rule."""
    v = np.asarray(v, dtype=np.float32)
    nan = np.isnan(v)
    neg = np.signbit(v)
    a = np.abs(v.astype(np.float64))
    a = np.where(nan, 0.0, np.minimum(a, fmt.max))  # Inf and anything past max -> max
    # Quantum of the binade of a (subnormal binade below 2**emin).
    _, E = np.frexp(a)  # a = m * 2**E, m in [0.5, 1); a == 0 -> E == 0
    e = np.maximum(E - 1, fmt.emin)
    quantum = np.ldexp(1.0, e - fmt.mbits)
    val = np.rint(a / quantum) * quantum  # exact division by a power of two; rint = ties to even
    # max is on the grid and rounding is monotone, so val <= max. Now the code of val.
    _, E2 = np.frexp(val)
    e2 = np.maximum(E2 - 1, fmt.emin)
    sub = val < 2.0**fmt.emin
    exp_field = np.where(sub, 0, e2 + fmt.bias)
    mant = np.where(
        sub, val / 2.0 ** (fmt.emin - fmt.mbits), val / np.ldexp(1.0, e2 - fmt.mbits) - 2**fmt.mbits
    )
    assert np.all(mant == np.floor(mant)) and np.all((mant >= 0) & (mant < 2**fmt.mbits))
    code = (exp_field.astype(np.int64) << fmt.mbits) | mant.astype(np.int64)
    code = np.where(neg, code | fmt.sign_bit, code)
    code = np.where(nan, fmt.nan_code, code)
    return code.astype(np.uint8)


def decode(code, fmt: Fmt) -> np.ndarray:
    """Format code -> float64 value (exact)."""
    c = np.asarray(code).astype(np.int64)
    neg = (c & fmt.sign_bit) != 0
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = c & ((1 << fmt.mbits) - 1)
    sub = exp_field == 0
    val = np.where(
        sub,
        mant * 2.0 ** (fmt.emin - fmt.mbits),
        (1.0 + mant / 2.0**fmt.mbits) * np.ldexp(1.0, exp_field - fmt.bias),
    )
    if fmt is E4M3:
        val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    elif fmt is E5M2:
        top = exp_field == (1 << fmt.ebits) - 1
        val = np.where(top & (mant == 0), np.inf, np.where(top, np.nan, val))
    return np.where(neg, -val, val)


def decode_e8m0(b) -> np.ndarray:
    b = np.asarray(b).astype(np.int64)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b - 127))


def e2m1_grid() -> np.ndarray:
    return decode(np.arange(8), E2M1)  # 0, .5, 1, 1.5, 2, 3, 4, 6


# --------------------------------------------------------------------------------------------
# Scalar helpers
# --------------------------------------------------------------------------------------------
def to_f32(x) -> np.ndarray:
    """float32 view of an input array (f32/bf16/f16 -> f32 is exact)."""
    return np.asarray(x).astype(np.float32)


def amax(v, axis=None) -> np.ndarray:
    """max |v| ignoring NaN (Inf counts), 0 for an empty set; float32."""
    v = np.abs(np.asarray(v, np.float32))
    v = np.where(np.isnan(v), np.float32(0), v)
    if v.size == 0 and axis is None:
        return np.float32(0)
    return np.max(v, axis=axis, initial=np.float32(0)).astype(np.float32)


def scale_from_amax(a, m) -> np.ndarray:
    """m / a if a finite and > 0 else 1; an overflowing quotient becomes FLT_MAX (float32)."""
    a = np.asarray(a, np.float32)
    ok = np.isfinite(a) & (a > 0)
    with np.errstate(all="ignore"):
        s = np.float32(m) / np.where(ok, a, np.float32(1))
    s = np.where(np.isinf(s), FLT_MAX, s)
    return np.where(ok, s, np.float32(1)).astype(np.float32)


def f32_recip(s) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (np.float32(1) / np.asarray(s, np.float32)).astype(np.float32)


def mul32(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (np.asarray(a, np.float32) * np.asarray(b, np.float32)).astype(np.float32)


def div32(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (np.asarray(a, np.float32) / np.asarray(b, np.float32)).astype(np.float32)


def as2d(x, flatten_axis: int = -1) -> tuple[np.ndarray, tuple, int]:
    x = np.asarray(x)
    axis = flatten_axis + x.ndim if flatten_axis < 0 else flatten_axis
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    cols = int(np.prod(x.shape[axis:], dtype=np.int64))
    return x.reshape(rows, cols), x.shape, axis


# --------------------------------------------------------------------------------------------
# Random Hadamard transform (blocks of 16 along the last axis)
# --------------------------------------------------------------------------------------------
def _butterflies(b: np.ndarray) -> np.ndarray:
    b = b.copy()
    with np.errstate(all="ignore"):
        for h in (1, 2, 4, 8):
            for j in range(16):
                if j & h:
                    continue
                lo, hi = b[..., j].copy(), b[..., j + h].copy()
                b[..., j] = (lo + hi).astype(np.float32)
                b[..., j + h] = (lo - hi).astype(np.float32)
    return b


def _signs(mask: int) -> np.ndarray:
    return np.array([-1.0 if (mask >> j) & 1 else 1.0 for j in range(16)], np.float32)


def hadamard(v, mask: int) -> np.ndarray:
    """Forward transform of docs/numerics.md: signs, butterflies h=1,2,4,8, then * 0.25."""
    v = np.asarray(v, np.float32)
    assert v.shape[-1] % 16 == 0
    b = v.reshape(v.shape[:-1] + (v.shape[-1] // 16, 16))
    b = mul32(b, _signs(mask & 0xFFFF))
    b = mul32(_butterflies(b), np.float32(0.25))
    return b.reshape(v.shape)


def inverse_hadamard(v, mask: int) -> np.ndarray:
    """Inverse: butterflies, * 0.25, then the signs."""
    v = np.asarray(v, np.float32)
    b = v.reshape(v.shape[:-1] + (v.shape[-1] // 16, 16))
    b = mul32(_butterflies(b), np.float32(0.25))
    b = mul32(b, _signs(mask & 0xFFFF))
    return b.reshape(v.shape)


def hadamard_matrix(mask: int) -> np.ndarray:
    """The 16x16 float64 matrix M with hadamard(v) == v @ M.T (up to float32 rounding)."""
    H = np.array([[1.0]])
    for _ in range(4):
        H = np.block([[H, H], [H, -H]])
    # Sylvester order matches the butterfly order (pairs (j, j+h) with j & h == 0).
    return 0.25 * H @ np.diag(_signs(mask).astype(np.float64))


# --------------------------------------------------------------------------------------------
# Stochastic rounding hash
# --------------------------------------------------------------------------------------------
_M32 = np.uint64(0xFFFFFFFF)


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h & _M32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    h ^= h >> np.uint64(16)
    return h


def sr_uniform(n: int, s0: int, s1: int) -> np.ndarray:
    """u (24-bit, as uint64) for linear indices 0..n-1."""
    i = np.arange(n, dtype=np.uint64)
    h = _fmix(((i & _M32) * np.uint64(0x9E3779B1)) & _M32 ^ np.uint64(s0 & 0xFFFFFFFF))
    h = _fmix(h ^ np.uint64(s1 & 0xFFFFFFFF) ^ ((i >> np.uint64(32)) & _M32))
    return h >> np.uint64(8)


COLWISE_SEED_XOR = 0x9E3779B9


def stochastic_e2m1(w: np.ndarray, s0: int, s1: int) -> np.ndarray:
    """Stochastic E2M1 rounding of the float32 matrix w (rows, cols) with seed (s0, s1)."""
    w = np.asarray(w, np.float32)
    u = sr_uniform(w.size, s0, s1).reshape(w.shape).astype(np.float64)
    a = np.abs(w.astype(np.float64))
    grid = e2m1_grid()
    k = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 6)  # lo = grid[k] <= a < grid[k+1]
    lo, hi = grid[k], grid[k + 1]
    with np.errstate(all="ignore"):
        p = (a - lo) / (hi - lo)
    mag = np.where(u < p * 2.0**24, hi, lo)
    mag = np.where(a >= 6.0, 6.0, mag)
    neg = np.signbit(w)
    out = np.where(neg, -mag, mag)
    # -0 for negative values that land on lo == 0: encode keeps the sign.
    out = np.where(neg & (mag == 0), -0.0, out)
    codes = encode(out.astype(np.float32), E2M1)  # exact: out is on the grid
    return np.where(np.isnan(w), E2M1.nan_code, codes).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Per-copy quantization
# --------------------------------------------------------------------------------------------
def mx_exponent(a: np.ndarray, fmt: Fmt) -> np.ndarray:
    """E8M0 code b of the smallest power of two s with a / s <= fmax (float32 block amaxes a)."""
    a = np.asarray(a, np.float32)
    a64 = a.astype(np.float64)
    finite_pos = np.isfinite(a64) & (a64 > 0)
    safe = np.where(finite_pos, a64, 1.0)
    _, Ea = np.frexp(safe)
    _, Ef = np.frexp(fmt.max)
    e = Ea - Ef  # a / 2**e in (fmax/2, 2 fmax)
    e = np.where(safe > np.ldexp(fmt.max, e), e + 1, e)
    b = np.clip(e + 127, 0, 254)
    b = np.where(a64 == 0, 127, b)
    b = np.where(np.isinf(a64), 254, b)
    b = np.where(finite_pos & (a64 < 2.0**-126), 0, b)  # float32 subnormal amax
    return b.astype(np.uint8)


def quantize_copy_mxfp8(v: np.ndarray, fmt: Fmt):
    rows, cols = v.shape
    assert cols % 32 == 0
    a = amax(v.reshape(rows, cols // 32, 32), axis=-1)
    b = mx_exponent(a, fmt)
    mult = np.ldexp(np.float32(1), 127 - b.astype(np.int64)).astype(np.float32)  # 2^(127-b), exact
    q = encode(mul32(v, np.repeat(mult, 32, axis=1)), fmt)
    return q, b


def quantize_copy_nvfp4(v: np.ndarray, *, tiles_2d: bool = False, seed=None):
    """v: float32 (rows, cols) after the optional Hadamard transform.
    Returns (codes uint8 0..15, sb codes uint8 (rows, cols/16), global_scale_inv float32)."""
    rows, cols = v.shape
    assert cols % 16 == 0
    A = amax(v)
    S = scale_from_amax(A, 448.0 * 6.0)
    gsi = f32_recip(S)
    if tiles_2d:
        assert rows % 16 == 0
        t = amax(
            v.reshape(rows // 16, 16, cols // 16, 16)
            .transpose(0, 2, 1, 3)
            .reshape(rows // 16, cols // 16, 256),
            axis=-1,
        )
        a = np.repeat(t, 16, axis=0)
    else:
        a = amax(v.reshape(rows, cols // 16, 16), axis=-1)
    sb = encode(mul32(div32(a, np.float32(6)), S), E4M3)
    dsb = decode(sb, E4M3).astype(np.float32)
    f = np.where(dsb != 0, div32(S, np.where(dsb != 0, dsb, np.float32(1))), np.float32(0)).astype(np.float32)
    f16, d16 = np.repeat(f, 16, axis=1), np.repeat(dsb, 16, axis=1)
    # Where f overflowed (a block amax below ~1.8e-38), w = (v * S) / decode(sb) instead.
    w_big = div32(mul32(v, S), np.where(d16 != 0, d16, np.float32(1)))
    w = np.where(np.isinf(f16), w_big, mul32(v, f16)).astype(np.float32)
    if seed is None:
        q = encode(w, E2M1)
    else:
        q = stochastic_e2m1(w, seed[0], seed[1])
    return q, sb, np.float32(gsi)


@dataclasses.dataclass
class QResult:
    data: Optional[np.ndarray] = None  # codes in x's shape (rowwise)
    scale_inv: Optional[np.ndarray] = None
    colwise_data: Optional[np.ndarray] = None  # codes in shape[axis:] + shape[:axis]
    colwise_scale_inv: Optional[np.ndarray] = None
    amax: Optional[np.ndarray] = None  # float32 (1,)
    global_scale_inv: Optional[np.ndarray] = None  # float32 (2,) for NVFP4
    dbias: Optional[np.ndarray] = None  # float64 (C,)
    # extras for tests
    prequant_colwise: Optional[np.ndarray] = None  # v of the colwise copy (after RHT)
    w_rowwise: Optional[np.ndarray] = None
    w_colwise: Optional[np.ndarray] = None


# --------------------------------------------------------------------------------------------
# FP8 block scaling (1x128 blocks / 128x128 tiles, float32 scales in cuBLASLt's layout)
# --------------------------------------------------------------------------------------------
def fp8_block_scale_shape(mode: int, rows: int, cols: int) -> tuple:
    nc = -(-cols // 128)
    if mode == BLOCK_1D:
        return (nc, -(-rows // 4) * 4)
    return (-(-rows // 128), -(-nc // 4) * 4)


def fp8_block_scale(a, fmax: float, eps: float, pow2: bool) -> np.float32:
    """max(a, eps) -> scale_from_amax -> (power of two: the exponent bits only)."""
    a = np.float32(max(np.float32(a), np.float32(eps)))
    s = np.float32(scale_from_amax(a, fmax))
    if pow2:
        s = np.array([s], np.float32).view(np.uint32) & np.uint32(0x7F800000)
        s = s.view(np.float32)[0]
    return np.float32(s)


def fp8_block_scale_of(mode: int, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float32: which scale_inv entry decodes each element, as flat indices."""
    ld = fp8_block_scale_shape(mode, rows, cols)[1]
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    if mode == BLOCK_1D:
        return (c // 128) * ld + r
    return (r // 128) * ld + c // 128


def quantize_copy_fp8_block(v: np.ndarray, mode: int, fmt: Fmt, eps: float = 0.0, pow2: bool = False):
    """One copy (rows, cols): codes (rows, cols) uint8 and the float32 scale_inv array."""
    rows, cols = v.shape
    si = np.ones(fp8_block_scale_shape(mode, rows, cols), np.float32)
    q = np.zeros((rows, cols), np.uint8)
    th = 128 if mode == BLOCK_2D else 1
    for r0 in range(0, rows, th):
        for c0 in range(0, cols, 128):
            blk = v[r0 : r0 + th, c0 : c0 + 128]
            s = fp8_block_scale(amax(blk), fmt.max, eps, pow2)
            q[r0 : r0 + th, c0 : c0 + 128] = encode(mul32(blk, s), fmt)
            if mode == BLOCK_1D:
                si[c0 // 128, r0] = f32_recip(s)
            else:
                si[r0 // 128, c0 // 128] = f32_recip(s)
    return q, si


def quantize(
    x,
    mode: int,
    q_dtype=None,
    *,
    scale=None,
    layout: str = "rowwise",
    flatten_axis: int = -1,
    seed=None,
    rht: bool = False,
    rht_sign_mask: int = 0xA759,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> QResult:
    """Reference of lowbit.quantize. ``x``: NumPy array (f32 / bf16 / f16). ``seed``: (s0, s1)
    uint32 words (= jax.random.bits(key, (2,), uint32)) for stochastic rounding."""
    x2, shape, axis = as2d(x, flatten_axis)
    v = to_f32(x2)
    rows, cols = v.shape
    rowwise = layout in ("rowwise", "both")
    colwise = layout in ("colwise", "both")
    cw_shape = tuple(shape[axis:]) + tuple(shape[:axis])
    with np.errstate(all="ignore"):
        dbias = v.astype(np.float64).sum(axis=0)
    out = QResult(amax=np.array([amax(v)], np.float32), dbias=dbias)

    if mode == NO_SCALING:
        if rowwise:
            out.data = np.asarray(x).copy()
        if colwise:
            out.colwise_data = np.asarray(x2).T.reshape(cw_shape).copy()
        return out

    fmt = fmt_of(q_dtype) if q_dtype is not None else (E2M1 if mode in NVFP4_MODES else E4M3)

    if mode in TENSOR_MODES:
        if mode == DELAYED:
            s = np.float32(np.asarray(scale, np.float32).reshape(-1)[0])
        else:
            s = np.float32(scale_from_amax(amax(v), fmt.max))
        q = encode(mul32(v, s), fmt)
        si = np.array([f32_recip(s)], np.float32)
        if rowwise:
            out.data, out.scale_inv = q.reshape(shape), si
        if colwise:
            out.colwise_data, out.colwise_scale_inv = q.T.reshape(cw_shape), si.copy()
        return out

    if mode in FP8_BLOCK_MODES:
        kw = dict(eps=amax_epsilon, pow2=power_2_scale)
        if rowwise:
            q, si = quantize_copy_fp8_block(v, mode, fmt, **kw)
            out.data, out.scale_inv = q.reshape(shape), si
        if colwise:
            q, si = quantize_copy_fp8_block(np.ascontiguousarray(v.T), mode, fmt, **kw)
            out.colwise_data, out.colwise_scale_inv = q.reshape(cw_shape), si
        return out

    if mode == MXFP8:
        if rowwise:
            q, b = quantize_copy_mxfp8(v, fmt)
            out.data, out.scale_inv = q.reshape(shape), b
        if colwise:
            q, b = quantize_copy_mxfp8(np.ascontiguousarray(v.T), fmt)
            out.colwise_data, out.colwise_scale_inv = q.reshape(cw_shape), b
        return out

    assert mode in NVFP4_MODES and fmt is E2M1
    gsi = np.ones(2, np.float32)
    if rowwise:
        q, sb, g = quantize_copy_nvfp4(v, tiles_2d=mode == NVFP4_2D, seed=seed)
        out.data, out.scale_inv, gsi[0] = q.reshape(shape), sb, g
    if colwise:
        vc = np.ascontiguousarray(v.T)
        if rht:
            vc = hadamard(vc, rht_sign_mask)
        out.prequant_colwise = vc
        cseed = None if seed is None else ((seed[0] ^ COLWISE_SEED_XOR) & 0xFFFFFFFF, seed[1])
        q, sb, g = quantize_copy_nvfp4(vc, tiles_2d=mode == NVFP4_2D, seed=cseed)
        out.colwise_data, out.colwise_scale_inv, gsi[1] = q.reshape(cw_shape), sb, g
    if not rowwise:
        gsi[0] = gsi[1]
    if not colwise:
        gsi[1] = gsi[0]
    out.global_scale_inv = gsi
    return out


def nvfp4_w(v: np.ndarray, *, tiles_2d: bool = False) -> np.ndarray:
    """The pre-rounding values w = v * f of an NVFP4 copy (the target of stochastic rounding)."""
    rows, cols = v.shape
    A = amax(v)
    S = scale_from_amax(A, 2688.0)
    if tiles_2d:
        t = amax(
            v.reshape(rows // 16, 16, cols // 16, 16)
            .transpose(0, 2, 1, 3)
            .reshape(rows // 16, cols // 16, 256),
            axis=-1,
        )
        a = np.repeat(t, 16, axis=0)
    else:
        a = amax(v.reshape(rows, cols // 16, 16), axis=-1)
    sb = encode(mul32(div32(a, np.float32(6)), S), E4M3)
    dsb = decode(sb, E4M3).astype(np.float32)
    f = np.where(dsb != 0, div32(S, np.where(dsb != 0, dsb, np.float32(1))), np.float32(0)).astype(np.float32)
    return mul32(v, np.repeat(f, 16, axis=1))


# --------------------------------------------------------------------------------------------
# Dequantize
# --------------------------------------------------------------------------------------------
def cast_out(v32: np.ndarray, dtype) -> np.ndarray:
    """One rounding float32 -> output dtype (f32 / bf16 / f16 are IEEE RNE conversions)."""
    return np.asarray(v32, np.float32).astype(dtype)


def dequantize_copy(codes2d, scale_inv, mode: int, fmt: Fmt, *, gsi=None, rht=False, rht_sign_mask=0):
    """float32 (rows, cols) decode of one copy, before the final cast."""
    rows, cols = codes2d.shape
    d = decode(codes2d, fmt).astype(np.float32)
    if mode in TENSOR_MODES:
        return mul32(d, np.float32(np.asarray(scale_inv, np.float32).reshape(-1)[0]))
    if mode == MXFP8:
        s = decode_e8m0(scale_inv).astype(np.float32)
        return mul32(d, np.repeat(s, 32, axis=1))
    if mode in FP8_BLOCK_MODES:
        s = np.asarray(scale_inv, np.float32).reshape(-1)[fp8_block_scale_of(mode, rows, cols)]
        return mul32(d, s)
    assert mode in NVFP4_MODES
    sb = decode(scale_inv, E4M3).astype(np.float32)
    out = mul32(mul32(d, np.repeat(sb, 16, axis=1)), np.float32(gsi))
    if rht:
        out = inverse_hadamard(out, rht_sign_mask)
    return out


def dequantize(
    res: QResult,
    mode: int,
    q_dtype,
    shape,
    *,
    layout="rowwise",
    flatten_axis=-1,
    out_dtype=np.float32,
    rht=False,
    rht_sign_mask=0xA759,
) -> np.ndarray:
    axis = flatten_axis + len(shape) if flatten_axis < 0 else flatten_axis
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    cols = int(np.prod(shape[axis:], dtype=np.int64))
    fmt = fmt_of(q_dtype)
    if layout == "rowwise":
        v = dequantize_copy(
            res.data.reshape(rows, cols),
            res.scale_inv,
            mode,
            fmt,
            gsi=None if res.global_scale_inv is None else res.global_scale_inv[0],
        )
        return cast_out(v.reshape(shape), out_dtype)
    v = dequantize_copy(
        res.colwise_data.reshape(cols, rows),
        res.colwise_scale_inv,
        mode,
        fmt,
        gsi=None if res.global_scale_inv is None else res.global_scale_inv[1],
        rht=rht,
        rht_sign_mask=rht_sign_mask,
    )
    return cast_out(v.T.reshape(shape), out_dtype)


# --------------------------------------------------------------------------------------------
# Grouped quantize
# --------------------------------------------------------------------------------------------
def group_bounds(group_sizes, M: int):
    """[(start, end)] rows of each group, clipped to M (negative sizes count as 0)."""
    n = np.maximum(np.asarray(group_sizes, np.int64), 0)
    off = np.concatenate([[0], np.cumsum(n)[:-1]])
    return [(int(min(o, M)), int(min(o + k, M))) for o, k in zip(off, n)]


def grouped_quantize(x, group_sizes, mode: int, q_dtype=None, *, scale=None, layout="rowwise"):
    """Returns dict(data (M,K) codes, scale_inv, colwise_data (K,M), colwise_scale_inv, amax (G,))."""
    v = to_f32(x)
    M, K = v.shape
    fmt = fmt_of(q_dtype) if q_dtype is not None else E4M3
    bounds = group_bounds(group_sizes, M)
    G = len(bounds)
    codes = np.zeros((M, K), np.uint8)
    am = np.zeros(G, np.float32)
    si = np.ones(G, np.float32)
    mx_b = None
    if mode == MXFP8:
        _, mx_b_all = quantize_copy_mxfp8(v, fmt)
        mx_b = mx_b_all.copy()  # rows in no group: see note in the tests (spec is silent)
    for g, (s, e) in enumerate(bounds):
        blk = v[s:e]
        am[g] = amax(blk)
        if mode == MXFP8:
            if e > s:
                q, b = quantize_copy_mxfp8(blk, fmt)
                codes[s:e], mx_b[s:e] = q, b
            continue
        if mode == DELAYED:
            sc = np.float32(np.asarray(scale, np.float32)[g])
        else:
            sc = np.float32(scale_from_amax(am[g], fmt.max))
        si[g] = f32_recip(sc)
        if e > s:
            codes[s:e] = encode(mul32(blk, sc), fmt)
    grouped_rows = np.zeros(M, bool)
    for s, e in bounds:
        grouped_rows[s:e] = True
    out = dict(amax=am, bounds=bounds, grouped_rows=grouped_rows)
    rowwise = layout in ("rowwise", "both")
    colwise = layout in ("colwise", "both")
    if rowwise:
        out["data"] = codes
        out["scale_inv"] = mx_b if mode == MXFP8 else si
    if colwise:
        out["colwise_data"] = np.ascontiguousarray(codes.T)
        out["colwise_scale_inv"] = si.copy()
    return out


def grouped_quantize_block1d(x, group_sizes, q_dtype=None, *, eps: float = 0.0, pow2: bool = False):
    """Grouped BLOCK_1D (csrc/include/lowbit/block_scaling.h): dict(data (M, K), scale_inv
    (M * ceil(K/128),) per-group M-major, colwise_data (K, M), colwise_scale_inv (M//128 + G, K),
    amax (G,)). Every block is quantize_copy_fp8_block's 1x128 block of the same values."""
    v = to_f32(x)
    M, K = v.shape
    fmt = fmt_of(q_dtype) if q_dtype is not None else E4M3
    bounds = group_bounds(group_sizes, M)
    G, nkb = len(bounds), -(-K // 128)
    data = np.zeros((M, K), np.uint8)
    si = np.zeros(M * nkb, np.float32)
    cw = np.zeros((K, M), np.uint8)
    csi = np.ones((M // 128 + G, K), np.float32)
    am = np.array([amax(v[s:e]) if e > s else 0.0 for s, e in bounds], np.float32)
    covered = bounds[-1][1]
    si[covered * nkb :] = 1.0  # rows in no group: zero data, scale_inv 1.0
    for s, e in bounds:
        if e == s:
            continue
        q, sc = quantize_copy_fp8_block(v[s:e], BLOCK_1D, fmt, eps, pow2)
        data[s:e] = q
        si[s * nkb : e * nkb] = sc[:, : e - s].reshape(-1)
    for g, (s, e) in enumerate(bounds):
        if e == s:
            continue
        q, sc = quantize_copy_fp8_block(np.ascontiguousarray(v[s:e].T), BLOCK_1D, fmt, eps, pow2)
        cw[:, s:e] = q
        first = s // 128 + g
        csi[first : first + sc.shape[0]] = sc[:, :K]
    return dict(data=data, scale_inv=si, colwise_data=cw, colwise_scale_inv=csi, amax=am, bounds=bounds)


def grouped_block1d_decode(d, K: int, fmt: Fmt, layout: str = "rowwise") -> np.ndarray:
    """(M, K) float64 of a grouped_quantize_block1d result (rows in no group: 0)."""
    bounds = d["bounds"]
    nkb = -(-K // 128)
    if layout == "rowwise":
        q = decode(d["data"], fmt).astype(np.float64)
        M = q.shape[0]
        out = np.zeros((M, K))
        runs = bounds + [(bounds[-1][1], M)]
        for s, e in runs:
            n = e - s
            if n == 0:
                continue
            sc = d["scale_inv"][s * nkb : e * nkb].reshape(nkb, n).astype(np.float64)
            out[s:e] = q[s:e] * np.repeat(sc.T, 128, axis=1)[:, :K]
        return out
    q = decode(d["colwise_data"], fmt).astype(np.float64).T
    out = np.zeros_like(q)
    for g, (s, e) in enumerate(bounds):
        n = e - s
        if n == 0:
            continue
        first = s // 128 + g
        sc = d["colwise_scale_inv"][first : first + -(-n // 128)].astype(np.float64)
        out[s:e] = q[s:e] * np.repeat(sc, 128, axis=0)[:n]
    return out


# --------------------------------------------------------------------------------------------
def _self_check():
    # float32 arithmetic must honor subnormals (no FTZ/DAZ in this process).
    tiny = np.float32(2.0**-126)
    assert mul32(tiny, np.float32(0.5)) == np.float32(2.0**-127), "float32 flushes subnormals"
    # Every code decodes and re-encodes to itself (except NaN codes / -0 handled).
    for fmt, n in ((E4M3, 256), (E5M2, 256), (E2M1, 16)):
        c = np.arange(n)
        d = decode(c, fmt)
        ok = np.isfinite(d)
        assert np.array_equal(encode(d[ok].astype(np.float32), fmt), c[ok].astype(np.uint8)), fmt.name
    assert np.array_equal(e2m1_grid(), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert decode(0x7E, E4M3) == 448 and decode(0x7B, E5M2) == 57344 and decode(0x7, E2M1) == 6


_self_check()
