// Device helpers every CUDA kernel of lowbit uses: launch/status helpers, input and output
// element types, the element encoders and block-wide amax. The cast kernels build on it in
// cast_kernels.cuh, the fused norm / activation / softmax kernels in fused_kernel_helpers.cuh.
// The numerics follow docs/numerics.md bit for bit:
//  * every float32 product that could meet an addition is written __fmul_rn, so the compiler
//    cannot contract it into an FMA (the CPU reference rounds each product);
//  * divisions are IEEE (no fast math), subnormals are honored (no -ftz);
//  * the element encoders are the integer ones of formats.h / block_scaling.h, except FP8, where
//    the hardware cvt is used when LOWBIT_HW_FP8 is set (it was checked bit-identical to
//    encode_rne over all 2^32 float32 inputs: see `check_quantize_cuda cvtcheck`).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "lowbit/block_scaling.h"
#include "lowbit/error.h"
#include "lowbit/formats.h"
#include "lowbit/quantize.h"

#ifndef LOWBIT_HW_FP8
#define LOWBIT_HW_FP8 1
#endif

namespace lowbit {
namespace cuda {

constexpr unsigned kFull = 0xffffffffu;

// Sum over the warp's lanes (butterfly: every lane gets the same value, added in the same order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
// Element formats: 0 E4M3, 1 E5M2, 2 E2M1.
enum Fmt : int { kFmtE4M3 = 0, kFmtE5M2 = 1, kFmtE2M1 = 2 };

inline Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Invalid(std::string(what) + ": " + cudaGetErrorString(e));
}
inline Status api_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  return Status::Invalid(std::string(what) + ": " + cudaGetErrorString(e));
}

// Grid for a grid-stride loop over `units` work items: enough blocks to fill the GPU, capped so
// the per-block epilogues (atomics) stay few.
inline unsigned grid_for(int64_t units, int threads, int64_t cap = 4096) {
  int64_t b = (units + threads - 1) / threads;
  if (b > cap) b = cap;
  return unsigned(b < 1 ? 1 : b);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- input / output element types (IN/OUT: 0 f32, 1 bf16, 2 f16, as DType) ----

template <int IN>
struct In;
template <>
struct In<0> {
  using T = float;
  static __device__ __forceinline__ float f(float v) { return v; }
};
template <>
struct In<1> {
  using T = uint16_t;
  static __device__ __forceinline__ float f(uint16_t v) {
    return __uint_as_float(uint32_t(v) << 16);
  }
};
template <>
struct In<2> {
  using T = uint16_t;
  // Exact for every non-NaN half (subnormals included); a NaN stays NaN, which is all that the
  // quantizers look at (NO_SCALING goes through f16_to_float to keep payloads like the CPU).
  static __device__ __forceinline__ float f(uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
};

// 16 bytes of input -> 16/sizeof(T) floats.
template <int IN>
__device__ __forceinline__ void unpack16(const uint4& r, float* out) {
  if constexpr (IN == 0) {
    out[0] = __uint_as_float(r.x);
    out[1] = __uint_as_float(r.y);
    out[2] = __uint_as_float(r.z);
    out[3] = __uint_as_float(r.w);
  } else {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[2 * j] = In<IN>::f(uint16_t(w[j] & 0xffffu));
      out[2 * j + 1] = In<IN>::f(uint16_t(w[j] >> 16));
    }
  }
}

// Element k (a compile-time constant after unrolling) of a 16-byte chunk.
template <int IN>
__device__ __forceinline__ float chunk_elem(const uint4& r, int k) {
  constexpr int per_word = 4 / int(sizeof(typename In<IN>::T));
  const int wi = k / per_word;
  const uint32_t word = wi == 0 ? r.x : (wi == 1 ? r.y : (wi == 2 ? r.z : r.w));
  if constexpr (IN == 0)
    return __uint_as_float(word);
  else
    return In<IN>::f(uint16_t((k & 1) ? (word >> 16) : (word & 0xffffu)));
}

// float -> output dtype bits, with formats.h rounding (NaN rules included) so GPU and CPU agree.
template <int OUT>
__device__ __forceinline__ uint32_t out_bits(float v) {
  if constexpr (OUT == 0)
    return __float_as_uint(v);
  else if constexpr (OUT == 1)
    return float_to_bf16(v);
  else
    return float_to_f16(v);
}
template <int OUT>
__device__ __forceinline__ void store_out(void* p, int64_t i, float v) {
  if constexpr (OUT == 0)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = uint16_t(out_bits<OUT>(v));
}

// ---- element encoders ----

template <int FMT>
__host__ __device__ constexpr float fmt_max() {
  return FMT == kFmtE4M3 ? kE4M3Max : (FMT == kFmtE5M2 ? kE5M2Max : kE2M1Max);
}

// Two float32 -> two FP8 codes (a in the low byte). The hardware cvt with satfinite rounds to
// nearest even, keeps the sign of zero, saturates Inf to +-max and maps NaN to 0x7F: exactly
// encode_rne (verified exhaustively on sm_90 by `check_quantize_cuda cvtcheck`).
template <int FMT>
__device__ __forceinline__ uint32_t enc_fp8x2(float a, float b) {
#if LOWBIT_HW_FP8
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                           FMT == kFmtE4M3 ? __NV_E4M3 : __NV_E5M2));
#else
  constexpr SmallFloat f = FMT == kFmtE4M3 ? kE4M3 : kE5M2;
  return encode_rne(a, f) | (encode_rne(b, f) << 8);
#endif
}
template <int FMT>
__device__ __forceinline__ uint32_t enc_fp8(float a) {
  return enc_fp8x2<FMT>(a, 0.0f) & 0xffu;
}

// E2M1 round to nearest even, equal to encode_rne(w, kE2M1) for every float32 (checked over all
// 2^32 inputs by `check_quantize_cuda cvtcheck`), in about a third of the instructions:
// |w| < 1 lands on 0, 0.5 or 1 = rint(2|w|) (2|w| is exact); from 1 up, rounding the float32 to
// one mantissa bit on its bits leaves (biased exponent, mantissa bit) = code + 252, saturated.
__device__ __forceinline__ uint32_t e2m1_rn(float w) {
  const uint32_t u = __float_as_uint(w), a = u & 0x7fffffffu;
  uint32_t code;
  if (a < 0x3f800000u)
    code = uint32_t(__float2int_rn(__uint_as_float(a) * 2.0f));
  else
    code = min(((a + 0x1fffffu + ((a >> 22) & 1u)) >> 22) - 252u, 7u);
  return a > 0x7f800000u ? 7u : (((u >> 28) & 8u) | code);  // NaN -> +6, as encode_rne
}

// NVFP4 element: round to nearest, or stochastic rounding with the element's hash bits.
__device__ __forceinline__ uint32_t enc_e2m1(float w, bool sr, uint64_t i, uint32_t s0,
                                             uint32_t s1) {
  return sr ? encode_e2m1_stochastic(w, sr_bits(i, s0, s1)) : e2m1_rn(w);
}

// MXFP8: x * 2^(127 - b) as apply_e8m0_encode, with the factor made once per block. Only b = 254
// needs apply_e8m0_encode's two-step product (2^-127 is a float32 subnormal).
__device__ __forceinline__ float mx_factor(uint8_t b) {
  return __uint_as_float(uint32_t(254 - b) << 23);
}
__device__ __forceinline__ float mx_apply(float x, uint8_t b, float f) {
  return b != 254 ? __fmul_rn(x, f) : apply_e8m0_encode(x, b);
}

// max |v| ignoring NaN (fmaxf returns the non-NaN operand; |v| keeps Inf).
template <int N>
__device__ __forceinline__ float amax_n(const float* v) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(v[j]));
  return m;
}

// Non-negative float max as unsigned max on the bits (the order of non-negative floats).
__device__ __forceinline__ void atomic_max_nonneg(float* p, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(p), __float_as_uint(v));
}

// Block-wide max, then one atomic per block. `red` holds blockDim/32 floats. All threads call.
__device__ __forceinline__ void block_amax_to(float m, float* red, float* out) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = 0.0f;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) r = fmaxf(r, red[w]);
    atomic_max_nonneg(out, r);
  }
}

}  // namespace cuda
}  // namespace lowbit
