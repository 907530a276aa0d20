// Block-scaling pieces shared by the CPU and CUDA kernels: the FP8 block scaling (1x128 /
// 128x128) scale layout and scale; NVFP4 block scales, stochastic rounding and the 16-point
// Hadamard transform, exactly as docs/numerics.md specifies them.
#pragma once

#include <cstdint>

#include "lowbit/formats.h"
#include "lowbit/tensor.h"

namespace lowbit {

// FP8 block scaling (kBlock1d / kBlock2d): the float32 scale_inv layout cuBLASLt's
// VEC128_32F / BLK128x128_32F scale modes read (docs/numerics.md), for a copy of (rows, cols)
// quantized along cols. 1D: (ceil(cols/128), round_up(rows, 4)), row-major, entry [j][r] is
// block (r, j): the rows dimension contiguous. 2D: (ceil(rows/128), round_up(ceil(cols/128), 4)),
// entry [i][j] is tile (i, j). Padding entries are written as 1.0.
LOWBIT_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
LOWBIT_HD int64_t round_up4(int64_t a) { return (a + 3) / 4 * 4; }
LOWBIT_HD int64_t fp8_block_scale_rows(ScalingMode m, int64_t rows, int64_t cols) {
  return m == ScalingMode::kBlock1d ? ceil_div(cols, 128) : ceil_div(rows, 128);
}
LOWBIT_HD int64_t fp8_block_scale_cols(ScalingMode m, int64_t rows, int64_t cols) {
  return m == ScalingMode::kBlock1d ? round_up4(rows) : round_up4(ceil_div(cols, 128));
}
// Index of the scale of element (r, c).
LOWBIT_HD int64_t fp8_block_scale_index(ScalingMode m, int64_t rows, int64_t cols, int64_t r,
                                        int64_t c) {
  const int64_t ld = fp8_block_scale_cols(m, rows, cols);
  return m == ScalingMode::kBlock1d ? (c / 128) * ld + r : (r / 128) * ld + c / 128;
}

// FP8 block scaling (1x128 / 128x128): encode scale of a block with amax `a` (NaN ignored):
// a' = max(a, eps); s = scale_from_amax(a', fmax) (fmax / a', 1 for a' zero or not finite, the
// largest float32 on overflow); with power-of-two scales, s rounded down to a power of two (its
// exponent bits). Never 0, Inf or NaN.
LOWBIT_HD float fp8_block_scale(float a, float fmax, float eps, bool pow2) {
  const float ae = a < eps ? eps : a;
  float s = scale_from_amax(ae, fmax);
  if (pow2) s = bits_float(float_bits(s) & 0x7f800000u);
  return s;
}

// Grouped FP8 block scaling (BLOCK_1D, grouped_quantize and the grouped GEMM). Groups are runs
// of rows [start_g, start_g + size_g) of an (M, K) tensor (clamped as lowbit/grouped_gemm.h
// says). The scale layouts are the per-group, M-major arrays CUTLASS's sm90 grouped blockwise
// GEMM reads (its per-group layout is derived from the group's extents: k-block stride = the
// group's rows), concatenated:
//  * rowwise copy (M, K), 1x128 blocks along K: (M * ceil(K/128),) float32; block kb of row
//    r = start_g + i sits at start_g * nkb + kb * size_g + i. The rows in no group form one
//    more run after the last group (zero data, scale_inv 1.0).
//  * colwise copy (K, M), 1x128 blocks along M *inside each group* (block j of group g holds the
//    group's tokens start_g + 128 j ..): (M / 128 + G, K) float32, block j of group g in row
//    start_g / 128 + g + j, element column c at [row][c]. The rows never overlap (each group
//    takes at most one more row than the 128-token boundaries it spans) and M / 128 + G rows
//    hold them all; rows of no block are 1.0.
LOWBIT_HD int64_t grouped_block_colwise_rows(int64_t m, int64_t groups) { return m / 128 + groups; }
LOWBIT_HD int64_t grouped_block_colwise_first(int64_t start, int64_t g) { return start / 128 + g; }

// NVFP4 tensor scale S = scale_from_amax(A, 448 * 6).
LOWBIT_HD float nvfp4_tensor_scale(float amax) {
  return scale_from_amax(amax, kE4M3Max * kE2M1Max);
}

// E4M3 block scale code for a block with amax `a` under tensor scale S.
LOWBIT_HD uint32_t nvfp4_block_scale_code(float a, float S) {
  return encode_rne((a / kE2M1Max) * S, kE4M3);
}

// Encode factor f = S / decode(sb), 0 when the block scale underflowed to 0.
LOWBIT_HD float nvfp4_encode_factor(uint32_t sb_code, float S) {
  const float d = decode(sb_code, kE4M3);
  return d != 0.0f ? S / d : 0.0f;
}

// The value E2M1 encodes: w = v * f, or (v * S) / decode(sb) when f = S / decode(sb) overflowed
// (a block whose amax is below ~1.8e-38: f ~ 6 / amax). |v * S| <= 448 * 6 never overflows.
LOWBIT_HD float nvfp4_scaled_value(float v, float f, uint32_t sb_code, float S) {
#ifdef __CUDA_ARCH__
  if (f <= 3.40282347e38f) return __fmul_rn(v, f);
  return __fdiv_rn(__fmul_rn(v, S), decode(sb_code, kE4M3));
#else
  if (f <= 3.40282347e38f) return v * f;
  return (v * S) / decode(sb_code, kE4M3);
#endif
}

LOWBIT_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// 24 random bits for element `i` of a copy under seed (s0, s1).
LOWBIT_HD uint32_t sr_bits(uint64_t i, uint32_t s0, uint32_t s1) {
  uint32_t h = fmix32((uint32_t(i) * 0x9E3779B1u) ^ s0);
  h = fmix32(h ^ s1 ^ uint32_t(i >> 32));
  return h >> 8;
}

// The seed's first word for the colwise copy, so its random bits differ from the rowwise copy's.
constexpr uint32_t kColwiseSeedXor = 0x9E3779B9u;

// E2M1 with stochastic rounding: round |w| up to the next grid point with probability equal to
// its distance from the lower one, using 24 random bits `u`.
LOWBIT_HD uint32_t encode_e2m1_stochastic(float w, uint32_t u) {
  const uint32_t wb = float_bits(w);
  if (is_nan_bits(wb)) return encode_rne(w, kE2M1);
  const uint32_t sign = (wb >> 31) << 3;
  const float a = bits_float(wb & 0x7fffffffu);
  if (a >= kE2M1Max) return sign | kE2M1.max_bits;
  // Grid: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); spacing 0.5 below 2, then 1, then 2.
  uint32_t lo_code;
  float lo, step;
  if (a < 2.0f) {
    lo_code = uint32_t(a * 2.0f);  // truncation: a < 2 so 0..3
    lo = float(lo_code) * 0.5f;
    step = 0.5f;
  } else if (a < 4.0f) {
    lo_code = a < 3.0f ? 4u : 5u;
    lo = a < 3.0f ? 2.0f : 3.0f;
    step = 1.0f;
  } else {
    lo_code = 6u;
    lo = 4.0f;
    step = 2.0f;
  }
  const float p = (a - lo) / step;  // exact: step is a power of two, a - lo exact (Sterbenz)
  const bool up = float(u) < p * 16777216.0f;
  return sign | (lo_code + (up ? 1u : 0u));
}

// In-place 16-point random Hadamard transform: signs, butterflies h = 1, 2, 4, 8, times 1/4.
LOWBIT_HD void hadamard16_forward(float* v, uint32_t sign_mask) {
  for (int j = 0; j < 16; ++j)
    if ((sign_mask >> j) & 1u) v[j] = -v[j];
  for (int h = 1; h < 16; h <<= 1)
    for (int j = 0; j < 16; ++j)
      if ((j & h) == 0) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  for (int j = 0; j < 16; ++j) v[j] *= 0.25f;
}

// Inverse: butterflies, times 1/4, then the signs.
LOWBIT_HD void hadamard16_inverse(float* v, uint32_t sign_mask) {
  for (int h = 1; h < 16; h <<= 1)
    for (int j = 0; j < 16; ++j)
      if ((j & h) == 0) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  for (int j = 0; j < 16; ++j) {
    v[j] *= 0.25f;
    if ((sign_mask >> j) & 1u) v[j] = -v[j];
  }
}

}  // namespace lowbit
