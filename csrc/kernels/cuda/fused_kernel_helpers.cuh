// Helpers of the fused norm / activation / softmax kernels (norm.cu, activation.cu,
// softmax.cu): MUFU approximations, rounding to the input dtype, FP8 packing, the launch's FP8
// scale and the colwise (transposed) FP8 store.
#pragma once

#include "device_common.cuh"

namespace lowbit {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;

// MUFU approximations (2^x: ~2 ulp, 1/x: ~1 ulp); subnormal results flush to 0. Harmless where
// used: the activations only feed them to 1 + 2^x and x * 1/(1 + 2^x), the softmax only drops
// entries below 2^-126.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to the input dtype IN (1 bf16, 2 f16; hardware cvt, round to nearest
// even), packed; lo_f / hi_f read them back as floats.
template <int IN>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (IN == 1) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
template <int IN>
__device__ __forceinline__ float lo_f(uint32_t w) {
  if constexpr (IN == 1)
    return __uint_as_float(w << 16);
  else
    return __half2float(__ushort_as_half(uint16_t(w & 0xffffu)));
}
template <int IN>
__device__ __forceinline__ float hi_f(uint32_t w) {
  if constexpr (IN == 1)
    return __uint_as_float(w & 0xffff0000u);
  else
    return __half2float(__ushort_as_half(uint16_t(w >> 16)));
}

// E values rounded to the input dtype: the 16-byte vector of their bits, and their values `r`.
template <int IN, int E>
__device__ __forceinline__ uint4 round_vec(const float* v, float* r) {
  uint32_t w[4];
  if constexpr (IN == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = __float_as_uint(v[e]), r[e] = v[e];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = pack2<IN>(v[2 * j], v[2 * j + 1]);
      r[2 * j] = lo_f<IN>(w[j]);
      r[2 * j + 1] = hi_f<IN>(w[j]);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One value rounded as round_vec rounds it; `bits` gets its bits in the input dtype.
template <int IN>
__device__ __forceinline__ float round1(float v, uint32_t* bits) {
  if constexpr (IN == 0) {
    *bits = __float_as_uint(v);
    return v;
  } else {
    const uint32_t w = pack2<IN>(v, 0.0f);
    *bits = w & 0xffffu;
    return lo_f<IN>(w);
  }
}
template <int IN>
__device__ __forceinline__ float round1(float v) {
  if constexpr (IN == 0)
    return v;
  else
    return lo_f<IN>(pack2<IN>(v, 0.0f));
}

// E rounded values times the scale -> E FP8 bytes (little-endian words).
template <int FMT, int E>
__device__ __forceinline__ void fp8_vec(const float* r, float scale, uint32_t* w) {
#pragma unroll
  for (int h = 0; h < E / 4; ++h)
    w[h] = enc_fp8x2<FMT>(__fmul_rn(r[4 * h], scale), __fmul_rn(r[4 * h + 1], scale)) |
           (enc_fp8x2<FMT>(__fmul_rn(r[4 * h + 2], scale), __fmul_rn(r[4 * h + 3], scale)) << 16);
}

// One scaled value -> its FP8 code (E5M2 or E4M3).
__device__ __forceinline__ uint32_t enc1(float v, bool e5) {
  return (e5 ? enc_fp8x2<kFmtE5M2>(v, 0.0f) : enc_fp8x2<kFmtE4M3>(v, 0.0f)) & 0xffu;
}

// The launch's FP8 scale (1 when it does not quantize): the delayed `scale`, or the current one
// from the first pass's amax; thread 0 of the grid's first block writes the scale_inv outputs
// (GRID2D: the kernel runs on a 2-D grid, so the first block is (0, 0)). A is the kernel's
// argument struct (fp8, scale, amax_in, e5, si, csi).
template <bool GRID2D, typename A>
__device__ __forceinline__ float fused_launch_scale(const A& a) {
  if (!a.fp8) return 1.0f;
  const float s = a.scale ? *a.scale : scale_from_amax(*a.amax_in, a.e5 ? kE5M2Max : kE4M3Max);
  if (blockIdx.x == 0 && (!GRID2D || blockIdx.y == 0) && threadIdx.x == 0) {
    if (a.si) *a.si = 1.0f / s;
    if (a.csi) *a.csi = 1.0f / s;
  }
  return s;
}

// A 16-row x 4-column block of FP8 codes to the colwise (transposed) copy `q_col` (ld bytes per
// column). w[rr] holds row rr's 4 codes, column j in byte j; they belong to columns col0..col0+3
// and rows row0..row0+rows-1 (rows past `rows` are ignored). Column col's codes go to
// q_col + (col + col_offset) * ld + row0. The words are transposed with __byte_perm; each column
// is one 16-byte store when the block is whole and ld % 16 == 0 (row0 is a multiple of 16, so the
// store is aligned), byte stores at a ragged edge. RAGGED: skip columns >= col_end and empty
// blocks (rows == 0); without it the caller guarantees all 4 columns and rows > 0.
template <bool RAGGED>
__device__ __forceinline__ void store_colwise_16x4(const uint32_t (&w)[16], uint8_t* q_col,
                                                   int64_t ld, int64_t col0, int64_t col_end,
                                                   int64_t col_offset, int64_t row0, int rows) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t col = col0 + j;
    if (RAGGED && (col >= col_end || rows == 0)) continue;
    const uint32_t sel = uint32_t(j) | (uint32_t(j + 4) << 4);
    uint32_t o[4];
#pragma unroll
    for (int m = 0; m < 4; ++m)
      o[m] = __byte_perm(__byte_perm(w[4 * m], w[4 * m + 1], sel),
                         __byte_perm(w[4 * m + 2], w[4 * m + 3], sel), 0x5410);
    uint8_t* dst = q_col + (col + col_offset) * ld + row0;
    if (rows == 16 && ld % 16 == 0) {  // dst is 16-byte aligned
      *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
    } else {
      for (int rr = 0; rr < rows; ++rr) dst[rr] = uint8_t(o[rr >> 2] >> ((rr & 3) * 8));
    }
  }
}

}  // namespace cuda
}  // namespace lowbit
