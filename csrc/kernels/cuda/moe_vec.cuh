// Helpers shared by the MoE CUDA files (moe.cu, moe_combine.cu): the float-dtype dispatch and
// 8-element vector loads / stores (16 bytes of bf16 / f16, 32 of float32) for the row kernels.
#pragma once

#include <type_traits>

#include "device_common.cuh"

namespace lowbit {
namespace cuda {

// Dispatch on a float dtype (0 f32, 1 bf16, 2 f16: DType's values).
template <typename F>
void with_in(DType t, F&& f) {
  if (t == DType::kF32)
    f(std::integral_constant<int, 0>{});
  else if (t == DType::kBF16)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{});
}

constexpr int kMoeVec = 8;  // elements per vector access

// Elements i .. i + 7 of a read-only array of dtype IN (i a multiple of 8, base 16-byte aligned).
template <int IN>
__device__ __forceinline__ void load8(const void* base, int64_t i, float* v) {
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const typename In<IN>::T*>(base) + i);
  unpack16<IN>(__ldg(p), v);
  if constexpr (IN == 0) unpack16<IN>(__ldg(p + 1), v + 4);
}

// v[0..7] rounded to dtype OUT (formats.h rounding, as store_out) into elements i .. i + 7.
template <int OUT>
__device__ __forceinline__ void store8(void* base, int64_t i, const float* v) {
  if constexpr (OUT == 0) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = out_bits<OUT>(v[2 * j]) | (out_bits<OUT>(v[2 * j + 1]) << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace cuda
}  // namespace lowbit
