// Device helpers and kernel templates shared by the CUDA quantization kernels (quantize.cu,
// grouped_quantize.cu, dequantize.cu). The numerics follow docs/numerics.md bit for bit:
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
// The fused cast's tile: 128 rows x 64 columns, 512 threads (see cast_tile_kernel).
constexpr int kTileR = 128, kTileC = 64, kTileThreads = 512;

// Kinds of quantization the cast kernels specialise on.
enum Kind : int { kTensor = 0, kMx = 1, kNv1 = 2, kNv2 = 3 };
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
  static __device__ __forceinline__ float f(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
};
template <>
struct In<2> {
  using T = uint16_t;
  // Exact for every non-NaN half (subnormals included); a NaN stays NaN, which is all that the
  // quantizers look at (NO_SCALING goes through f16_to_float to keep payloads like the CPU).
  static __device__ __forceinline__ float f(uint16_t v) { return __half2float(__ushort_as_half(v)); }
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
  if constexpr (IN == 0) return __uint_as_float(word);
  else return In<IN>::f(uint16_t((k & 1) ? (word >> 16) : (word & 0xffffu)));
}

// float -> output dtype bits, with formats.h rounding (NaN rules included) so GPU and CPU agree.
template <int OUT>
__device__ __forceinline__ uint32_t out_bits(float v) {
  if constexpr (OUT == 0) return __float_as_uint(v);
  else if constexpr (OUT == 1) return float_to_bf16(v);
  else return float_to_f16(v);
}
template <int OUT>
__device__ __forceinline__ void store_out(void* p, int64_t i, float v) {
  if constexpr (OUT == 0) static_cast<float*>(p)[i] = v;
  else static_cast<uint16_t*>(p)[i] = uint16_t(out_bits<OUT>(v));
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
  if (a < 0x3f800000u) code = uint32_t(__float2int_rn(__uint_as_float(a) * 2.0f));
  else code = min(((a + 0x1fffffu + ((a >> 22) & 1u)) >> 22) - 252u, 7u);
  return a > 0x7f800000u ? 7u : (((u >> 28) & 8u) | code);  // NaN -> +6, as encode_rne
}

// NVFP4 element: round to nearest, or stochastic rounding with the element's hash bits.
__device__ __forceinline__ uint32_t enc_e2m1(float w, bool sr, uint64_t i, uint32_t s0, uint32_t s1) {
  return sr ? encode_e2m1_stochastic(w, sr_bits(i, s0, s1)) : e2m1_rn(w);
}

// MXFP8: x * 2^(127 - b) as apply_e8m0_encode, with the factor made once per block. Only b = 254
// needs apply_e8m0_encode's two-step product (2^-127 is a float32 subnormal).
__device__ __forceinline__ float mx_factor(uint8_t b) { return __uint_as_float(uint32_t(254 - b) << 23); }
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

// ---- what the cast kernels are told ----

struct CastArgs {
  const void* x = nullptr;
  int64_t R = 0, C = 0;
  bool rowwise = false, colwise = false;
  uint8_t* q_row = nullptr;  // (R, C) FP8 bytes or (R, C/2) packed FP4
  uint8_t* s_row = nullptr;  // block scales of the rowwise copy (MX e8m0 / NVFP4 e4m3)
  uint8_t* q_col = nullptr;  // (C, R) / (C, R/2)
  uint8_t* s_col = nullptr;
  // Tensor scale (FP8 tensor modes): delayed ? delayed[g] : scale_from_amax(amax_in[g], fmax),
  // g = 0, or the row's group when grouped.
  const float* delayed = nullptr;
  const float* amax_in = nullptr;   // also NVFP4: amax(x), the rowwise copy's tensor amax
  const float* amax_col = nullptr;  // NVFP4: the colwise copy's (Hadamard-transformed) amax
  const uint32_t* sr_seed = nullptr;
  bool rht = false;
  uint32_t rht_mask = 0;
  float* amax_out = nullptr;    // fused amax(x) (atomicMax; zeroed before; grouped: [G]), or null
  float* dbias_part = nullptr;  // [ceil(R/kTileR)][C] per-tile column sums, or null
  const int32_t* row_group = nullptr;  // grouped: each row's group, -1 for none
  uint32_t tiles_c = 0;                // tile columns (set by set_tiles)
};

// Tile count of the fused cast; false when it does not fit a 1-D grid.
inline bool set_tiles(CastArgs& a, int64_t* tiles) {
  const int64_t tr = (a.R + kTileR - 1) / kTileR, tc = (a.C + kTileC - 1) / kTileC;
  *tiles = tr * tc;
  if (*tiles > INT32_MAX || *tiles < 1) return false;
  a.tiles_c = uint32_t(tc);
  return true;
}

template <int FMT>
__device__ __forceinline__ float tensor_scale(const CastArgs& a, int64_t g) {
  return a.delayed ? a.delayed[g] : scale_from_amax(a.amax_in[g], fmt_max<FMT>());
}

// Scale byte of MXFP8 rows that belong to no group (grouped quantize): 2^0, like the CPU kernel.
constexpr uint8_t kMxEmptyScale = 127;

// ---- the fused cast: one 128x64 tile per block, both copies from one read ----
//
// 1. Each of the 512 threads loads PER 16-byte chunks of the tile (coalesced 128-byte row
//    segments), keeps them in registers for the rowwise copy and stores them to shared memory.
//    Shared memory is swizzled at 16-byte-chunk granularity: chunk j of row r is stored at chunk
//    j ^ ((r / 16) % 8), so the column reads below hit 8 different bank groups.
// 2. Column phase: the 8 lanes 8q..8q+7 of a warp own tile column 4*warp+q, lane 8q+g rows
//    16g..16g+15. That is one 16-byte FP8 store (8 for FP4) and the 8 lanes of a column write
//    one contiguous 128-byte (64-byte) run of the colwise copy; a 16-row slice is one NVFP4
//    block and lanes g, g^1 together one MX block; the block scales of a column are consecutive
//    bytes written by one warp instruction, so they coalesce into one request; dbias is reduced
//    across the 8 lanes with shuffles.
// 3. Rowwise phase from the registers: 8 (bf16/f16) or 4 (f32) elements per chunk; MX/NVFP4
//    block amaxes come from the neighbouring lanes that hold the rest of the block (shuffles).
// Why: on H100 (bf16, 8192x16384) leaving out the MXFP8 scale-byte stores of an earlier 64x64
// tile (one byte per lane, 16 columns per warp instruction) sped the cast up from 275 to 221 us.
// This mapping turns a column's scale bytes and its colwise data into one request each; by itself
// it measured about even (274 us), the gain came with 3 resident blocks (tile_min_blocks: 258 us).
// 16-bit inputs, FP8 kinds: ask for 3 resident blocks (<= 42 registers). Measured on H100 at
// 8192x16384 bf16: delayed 223 -> 203 us, MXFP8 274 -> 258 us against the compiler's own choice
// (62/50 registers, 2 blocks). NVFP4 would spill there for no gain and f32 needs the
// registers; the grouped variants (per-row scales) would spill at 3, so they ask for 2.
template <int IN, int KIND, bool GROUPED>
constexpr int tile_min_blocks() {
  return IN != 0 && (KIND == kTensor || KIND == kMx) ? (GROUPED ? 2 : 3) : 1;
}
template <int IN, int KIND, int FMT, bool GROUPED>
__global__ void __launch_bounds__(kTileThreads, tile_min_blocks<IN, KIND, GROUPED>()) cast_tile_kernel(const CastArgs a) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));           // elements per 16-byte chunk
  constexpr int CPR = kTileC / CH;                  // chunks per tile row (8 or 16)
  constexpr int PER = kTileR * CPR / kTileThreads;  // chunks per thread (2 or 4)
  constexpr int NW = kTileThreads / 32;             // warps (16)
  constexpr float FMAX = fmt_max<FMT>();
  static_assert(PER * kTileThreads == kTileR * CPR, "tile/threads mismatch");
  static_assert(NW * 4 == kTileC && kTileR == 8 * 16, "column-phase mapping");

  __shared__ __align__(16) T tile[kTileR][kTileC];
  __shared__ float red[NW];
  __shared__ float tpart[NW][8];  // NVFP4 2-D: per warp and row group, amax of its 4 columns
  __shared__ float rscale[GROUPED ? kTileR : 1];
  __shared__ int rok[GROUPED ? kTileR : 1];
  __shared__ float rmax[GROUPED ? kTileR : 1];  // grouped fused amax: each row's max over the tile

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t R = a.R, C = a.C;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const uint32_t tr = blockIdx.x / a.tiles_c, tc = blockIdx.x - tr * a.tiles_c;
  const int64_t r0 = int64_t(tr) * kTileR, c0 = int64_t(tc) * kTileC;

  // 1. load: all loads issued before any use; out-of-range chunks read as zeros.
  uint4 raw[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
    const int64_t gr = r0 + lr, gc = c0 + lc;
    raw[i] = (gr < R && gc < C) ? __ldg(reinterpret_cast<const uint4*>(x + gr * C + gc))
                                : make_uint4(0u, 0u, 0u, 0u);
  }
  if constexpr (GROUPED) {
    if (t < kTileR) {
      const int64_t gr = r0 + t;
      const int g = gr < R ? a.row_group[gr] : -1;
      rok[t] = g >= 0;
      rscale[t] = (KIND == kTensor && g >= 0) ? tensor_scale<FMT>(a, g) : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int id = i * kTileThreads + t, lr = id / CPR, ch = id % CPR;
    *reinterpret_cast<uint4*>(&tile[lr][(ch ^ ((lr >> 4) & 7)) * CH]) = raw[i];
  }
  if constexpr (GROUPED) {
    // Fused per-group amax (amax_out[g], delayed scaling): each row's max over the tile (the
    // CPR lanes that share a row), then one atomic per run of same-group rows in each warp.
    if (a.amax_out) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        float v[CH];
        unpack16<IN>(raw[i], v);
        float m = amax_n<CH>(v);
#pragma unroll
        for (int o = 1; o < CPR; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
        if (t % CPR == 0) rmax[(i * kTileThreads + t) / CPR] = m;
      }
    }
  } else if (a.amax_out) {  // fused amax(x): the tile's max, one atomic per block (uniform branch)
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      float v[CH];
      unpack16<IN>(raw[i], v);
      m = fmaxf(m, amax_n<CH>(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    if (lane == 0) red[warp] = m;
  }
  __syncthreads();
  if constexpr (GROUPED) {
    if (a.amax_out && t < kTileR) {  // warps 0..3: a segmented max-scan over their 32 rows
      const int64_t gr = r0 + t;
      const int g = gr < R ? a.row_group[gr] : -1;
      float m = rmax[t];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {  // groups are runs of rows: same group o back = same run
        const float mo = __shfl_up_sync(kFull, m, o);
        const int go = __shfl_up_sync(kFull, g, o);
        if (lane >= o && go == g) m = fmaxf(m, mo);
      }
      const int gn = __shfl_down_sync(kFull, g, 1);
      if (g >= 0 && (lane == 31 || gn != g)) atomic_max_nonneg(a.amax_out + g, m);
    }
  } else if (a.amax_out && t == 0) {
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) m = fmaxf(m, red[w]);
    atomic_max_nonneg(a.amax_out, m);
  }

  float scale = 1.0f, S_row = 1.0f, S_col = 1.0f;
  if constexpr (KIND == kTensor && !GROUPED) scale = tensor_scale<FMT>(a, 0);
  if constexpr (KIND == kNv1 || KIND == kNv2) {
    S_row = nvfp4_tensor_scale(*a.amax_in);
    S_col = nvfp4_tensor_scale(*a.amax_col);
  }
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = sr ? a.sr_seed[0] : 0u, s1 = sr ? a.sr_seed[1] : 0u;

  // 2. column phase
  if (a.colwise || a.dbias_part != nullptr || KIND == kNv2) {
    const int g = lane & 7, c = warp * 4 + (lane >> 3);
    const int pc = (((c / CH) ^ g) * CH) + (c % CH);  // swizzled column of (16g + k, c)
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = In<IN>::f(tile[16 * g + k][pc]);
    const int64_t gc = c0 + c, gr = r0 + 16 * g;
    const bool active = gc < C && gr < R;

    if (a.dbias_part != nullptr) {
      // Rows beyond R were loaded as zeros, so they add nothing. Fixed order: deterministic.
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < 16; ++k) s += v[k];
      s += __shfl_xor_sync(kFull, s, 1);
      s += __shfl_xor_sync(kFull, s, 2);
      s += __shfl_xor_sync(kFull, s, 4);
      if (g == 0 && gc < C) a.dbias_part[int64_t(tr) * C + gc] = s;
    }

    float m2 = 0.0f;
    if constexpr (KIND == kNv2) {  // amax of each 16x16 sub-tile: 4 columns here, 4 warps wide
      m2 = amax_n<16>(v);
      m2 = fmaxf(m2, __shfl_xor_sync(kFull, m2, 8));
      m2 = fmaxf(m2, __shfl_xor_sync(kFull, m2, 16));
      if (lane < 8) tpart[warp][g] = m2;
      __syncthreads();
      const int w0 = (c >> 4) * 4;
      m2 = fmaxf(fmaxf(tpart[w0][g], tpart[w0 + 1][g]), fmaxf(tpart[w0 + 2][g], tpart[w0 + 3][g]));
    }

    if (a.colwise) {
      if constexpr (KIND == kTensor) {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2) {
          float sa = scale, sb = scale;
          if constexpr (GROUPED) {
            sa = rscale[16 * g + k];
            sb = rscale[16 * g + k + 1];
          }
          uint32_t pr = enc_fp8x2<FMT>(__fmul_rn(v[k], sa), __fmul_rn(v[k + 1], sb));
          if constexpr (GROUPED) {  // rows in no group are zero bytes
            if (!rok[16 * g + k]) pr &= 0xff00u;
            if (!rok[16 * g + k + 1]) pr &= 0x00ffu;
          }
          w[k >> 2] |= pr << ((k & 3) * 8);
        }
        if (active) *reinterpret_cast<uint4*>(a.q_col + gc * R + gr) = make_uint4(w[0], w[1], w[2], w[3]);
      } else if constexpr (KIND == kMx) {
        float m = amax_n<16>(v);
        m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));  // the other half of the 32-row block
        const uint8_t b = mx_scale_e8m0(m, FMAX);
        const float fb = mx_factor(b);
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2)
          w[k >> 2] |= enc_fp8x2<FMT>(mx_apply(v[k], b, fb), mx_apply(v[k + 1], b, fb)) << ((k & 3) * 8);
        if (active) {
          *reinterpret_cast<uint4*>(a.q_col + gc * R + gr) = make_uint4(w[0], w[1], w[2], w[3]);
          if ((g & 1) == 0) a.s_col[gc * (R / 32) + gr / 32] = b;
        }
      } else {  // NVFP4: this thread's 16 values are one block of the colwise copy
        if constexpr (KIND == kNv1) {
          if (a.rht) hadamard16_forward(v, a.rht_mask);
        }
        const float m = KIND == kNv1 ? amax_n<16>(v) : m2;
        const uint32_t sb = nvfp4_block_scale_code(m, S_col);
        const float f = nvfp4_encode_factor(sb, S_col);
        const uint64_t base = uint64_t(gc) * uint64_t(R) + uint64_t(gr);
        const uint32_t cs0 = s0 ^ kColwiseSeedXor;
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; ++k)
          w[k >> 3] |= enc_e2m1(__fmul_rn(v[k], f), sr, base + k, cs0, s1) << ((k & 7) * 4);
        if (active) {
          *reinterpret_cast<uint2*>(a.q_col + base / 2) = make_uint2(w[0], w[1]);
          a.s_col[gc * (R / 16) + gr / 16] = uint8_t(sb);
        }
      }
    }
  }

  // 3. rowwise phase (from registers)
  if (a.rowwise) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
      const int64_t gr = r0 + lr, gc = c0 + lc;
      const bool valid = gr < R && gc < C;
      float v[CH];
      unpack16<IN>(raw[i], v);
      if constexpr (KIND == kTensor || KIND == kMx) {
        uint8_t b = 0;
        float sc = scale;
        if constexpr (KIND == kTensor && GROUPED) sc = rscale[lr];
        if constexpr (KIND == kMx) {
          float m = amax_n<CH>(v);
#pragma unroll
          for (int o = 1; o < 32 / CH; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
          b = mx_scale_e8m0(m, FMAX);
        }
        const float fb = mx_factor(b);
        uint32_t w[CH / 4];
#pragma unroll
        for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
#pragma unroll
        for (int k = 0; k < CH; k += 2) {
          float ea, eb;
          if constexpr (KIND == kMx) {
            ea = mx_apply(v[k], b, fb);
            eb = mx_apply(v[k + 1], b, fb);
          } else {
            ea = __fmul_rn(v[k], sc);
            eb = __fmul_rn(v[k + 1], sc);
          }
          w[k >> 2] |= enc_fp8x2<FMT>(ea, eb) << ((k & 3) * 8);
        }
        if constexpr (GROUPED) {
          if (!rok[lr]) {
#pragma unroll
            for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
            b = kMxEmptyScale;
          }
        }
        if (valid) {
          uint8_t* q = a.q_row + gr * C + gc;
          if constexpr (CH == 8) *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
          else *reinterpret_cast<uint32_t*>(q) = w[0];
          if constexpr (KIND == kMx) {
            if ((lc & 31) == 0) a.s_row[gr * (C / 32) + gc / 32] = b;
          }
        }
      } else {  // NVFP4
        float m;
        if constexpr (KIND == kNv1) {
          m = amax_n<CH>(v);
#pragma unroll
          for (int o = 1; o < 16 / CH; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
        } else {
          const int w0 = (lc >> 4) * 4, gg = lr >> 4;
          m = fmaxf(fmaxf(tpart[w0][gg], tpart[w0 + 1][gg]), fmaxf(tpart[w0 + 2][gg], tpart[w0 + 3][gg]));
        }
        const uint32_t sb = nvfp4_block_scale_code(m, S_row);
        const float f = nvfp4_encode_factor(sb, S_row);
        const uint64_t base = uint64_t(gr) * uint64_t(C) + uint64_t(gc);
        uint32_t w = 0u;
#pragma unroll
        for (int k = 0; k < CH; ++k) w |= enc_e2m1(__fmul_rn(v[k], f), sr, base + k, s0, s1) << (k * 4);
        if (valid) {
          if constexpr (CH == 8) *reinterpret_cast<uint32_t*>(a.q_row + base / 2) = w;
          else *reinterpret_cast<uint16_t*>(a.q_row + base / 2) = uint16_t(w);
          if ((lc & 15) == 0) a.s_row[gr * (C / 16) + gc / 16] = uint8_t(sb);
        }
      }
    }
  }
}

// ---- generic kernels: any shape and alignment, one thread per block of the copy ----
// Used when the fast tile kernel's conditions (rows, cols multiples of 16, 16-byte aligned
// pointers) do not hold. Simple and strided; correctness over speed.

template <int KIND>
__host__ __device__ constexpr int generic_block() {
  return KIND == kTensor ? 1 : (KIND == kMx ? 32 : 16);
}

// Rowwise copy: unit = B consecutive elements of a row.
template <int IN, int KIND, int FMT, bool GROUPED>
__global__ void rowwise_generic_kernel(const CastArgs a) {
  using T = typename In<IN>::T;
  constexpr int B = generic_block<KIND>();
  constexpr float FMAX = fmt_max<FMT>();
  const T* x = static_cast<const T*>(a.x);
  const int64_t R = a.R, C = a.C, nb = C / B, units = R * nb;
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = sr ? a.sr_seed[0] : 0u, s1 = sr ? a.sr_seed[1] : 0u;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = u / nb, c = (u - r * nb) * B;
    float v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) v[j] = In<IN>::f(x[r * C + c + j]);
    int g = 0;
    if constexpr (GROUPED) g = a.row_group[r];
    if constexpr (KIND == kTensor) {
      const float sc = g >= 0 ? tensor_scale<FMT>(a, g) : 0.0f;
      a.q_row[r * C + c] = g >= 0 ? uint8_t(enc_fp8<FMT>(__fmul_rn(v[0], sc))) : uint8_t(0);
    } else if constexpr (KIND == kMx) {
      const uint8_t b = g >= 0 ? mx_scale_e8m0(amax_n<B>(v), FMAX) : kMxEmptyScale;
#pragma unroll
      for (int j = 0; j < B; ++j)
        a.q_row[r * C + c + j] = g >= 0 ? uint8_t(enc_fp8<FMT>(apply_e8m0_encode(v[j], b))) : uint8_t(0);
      a.s_row[r * nb + c / B] = b;
    } else {
      const float S = nvfp4_tensor_scale(*a.amax_in);
      float m = 0.0f;
      if constexpr (KIND == kNv1) {
        m = amax_n<B>(v);
      } else {  // the 16x16 tile holding this block
        const int64_t rt = r - r % 16;
        for (int64_t rr = rt; rr < rt + 16; ++rr)
          for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(In<IN>::f(x[rr * C + c + j])));
      }
      const uint32_t sb = nvfp4_block_scale_code(m, S);
      const float f = nvfp4_encode_factor(sb, S);
      const uint64_t base = uint64_t(r) * uint64_t(C) + uint64_t(c);
#pragma unroll
      for (int j = 0; j < B; j += 2) {
        const uint32_t lo = enc_e2m1(__fmul_rn(v[j], f), sr, base + j, s0, s1);
        const uint32_t hi = enc_e2m1(__fmul_rn(v[j + 1], f), sr, base + j + 1, s0, s1);
        a.q_row[(base + j) / 2] = uint8_t(lo | (hi << 4));
      }
      a.s_row[r * nb + c / B] = uint8_t(sb);
    }
  }
}

// Colwise copy (C, R): unit = B consecutive rows of one column; consecutive threads take
// consecutive units of the output, so the writes are the coalesced side.
template <int IN, int KIND, int FMT, bool GROUPED>
__global__ void colwise_generic_kernel(const CastArgs a) {
  using T = typename In<IN>::T;
  constexpr int B = generic_block<KIND>();
  constexpr float FMAX = fmt_max<FMT>();
  const T* x = static_cast<const T*>(a.x);
  const int64_t R = a.R, C = a.C, nb = R / B, units = C * nb;
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = (sr ? a.sr_seed[0] : 0u) ^ kColwiseSeedXor, s1 = sr ? a.sr_seed[1] : 0u;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = u / nb, r = (u - c * nb) * B;
    float v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) v[j] = In<IN>::f(x[(r + j) * C + c]);
    if constexpr (KIND == kTensor) {
      int g = 0;
      if constexpr (GROUPED) g = a.row_group[r];
      const float sc = g >= 0 ? tensor_scale<FMT>(a, g) : 0.0f;
      a.q_col[c * R + r] = g >= 0 ? uint8_t(enc_fp8<FMT>(__fmul_rn(v[0], sc))) : uint8_t(0);
    } else if constexpr (KIND == kMx) {
      const uint8_t b = mx_scale_e8m0(amax_n<B>(v), FMAX);
#pragma unroll
      for (int j = 0; j < B; ++j) a.q_col[c * R + r + j] = uint8_t(enc_fp8<FMT>(apply_e8m0_encode(v[j], b)));
      a.s_col[c * nb + r / B] = b;
    } else {
      const float S = nvfp4_tensor_scale(*a.amax_col);
      float m = 0.0f;
      if constexpr (KIND == kNv1) {
        if (a.rht) hadamard16_forward(v, a.rht_mask);
        m = amax_n<B>(v);
      } else {
        const int64_t ct = c - c % 16;
        for (int j = 0; j < 16; ++j)
          for (int64_t cc = ct; cc < ct + 16; ++cc) m = fmaxf(m, fabsf(In<IN>::f(x[(r + j) * C + cc])));
      }
      const uint32_t sb = nvfp4_block_scale_code(m, S);
      const float f = nvfp4_encode_factor(sb, S);
      const uint64_t base = uint64_t(c) * uint64_t(R) + uint64_t(r);
#pragma unroll
      for (int j = 0; j < B; j += 2) {
        const uint32_t lo = enc_e2m1(__fmul_rn(v[j], f), sr, base + j, s0, s1);
        const uint32_t hi = enc_e2m1(__fmul_rn(v[j + 1], f), sr, base + j + 1, s0, s1);
        a.q_col[(base + j) / 2] = uint8_t(lo | (hi << 4));
      }
      a.s_col[c * nb + r / B] = uint8_t(sb);
    }
  }
}

// ---- amax(x): grid-stride, 16-byte loads four deep, one atomic per block ----
template <int IN>
__global__ void __launch_bounds__(256) amax_kernel(const void* xv, int64_t n, bool vec, float* out) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));
  __shared__ float red[8];
  const T* x = static_cast<const T*>(xv);
  const int64_t nv = vec ? n / CH : 0;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4* xv4 = reinterpret_cast<const uint4*>(x);
  float m = 0.0f;
  int64_t i = tid;
  for (; i + 3 * stride < nv; i += 4 * stride) {
    uint4 r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = __ldg(xv4 + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float v[CH];
      unpack16<IN>(r[k], v);
      m = fmaxf(m, amax_n<CH>(v));
    }
  }
  for (; i < nv; i += stride) {
    float v[CH];
    unpack16<IN>(__ldg(xv4 + i), v);
    m = fmaxf(m, amax_n<CH>(v));
  }
  for (int64_t j = nv * CH + tid; j < n; j += stride) m = fmaxf(m, fabsf(In<IN>::f(x[j])));
  block_amax_to(m, red, out);
}

// ---- shared by the fused norm / activation / softmax kernels ----

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
  if constexpr (IN == 1) return __uint_as_float(w << 16);
  else return __half2float(__ushort_as_half(uint16_t(w & 0xffffu)));
}
template <int IN>
__device__ __forceinline__ float hi_f(uint32_t w) {
  if constexpr (IN == 1) return __uint_as_float(w & 0xffff0000u);
  else return __half2float(__ushort_as_half(uint16_t(w >> 16)));
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
  if constexpr (IN == 0) return v;
  else return lo_f<IN>(pack2<IN>(v, 0.0f));
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

}  // namespace cuda
}  // namespace lowbit
