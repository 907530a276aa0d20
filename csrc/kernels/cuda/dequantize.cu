// CUDA dequantize: docs/numerics.md "Dequantize". Elementwise except the NVFP4 inverse Hadamard
// transform, which mixes the 16 elements of a block; so a thread owns U consecutive elements of
// a row (U = 16: one NVFP4 block, or 16 FP8 bytes = one 16-byte load), else U = 1.
#include "device_common.cuh"

namespace lowbit {
namespace cuda {
namespace {

struct DeqArgs {
  const uint8_t* q;
  int64_t R, C;
  ScalingMode mode;
  const void* scale_inv;
  const float* gsi;
  bool rht;
  uint32_t mask;
  void* out;
};

// QF: element format (kFmtE4M3 / kFmtE5M2 / kFmtE2M1); OUT: output dtype (0 f32, 1 bf16, 2 f16);
// VEC: 16-byte aligned rows, so loads and stores are vectors (else bytes/elements).
template <int QF, int OUT, int U, bool VEC>
__global__ void __launch_bounds__(256) dequant_kernel(const DeqArgs a) {
  constexpr SmallFloat F = QF == kFmtE4M3 ? kE4M3 : (QF == kFmtE5M2 ? kE5M2 : kE2M1);
  const int64_t C = a.C, per_row = C / U, units = a.R * per_row;
  const uint8_t* sbytes = static_cast<const uint8_t*>(a.scale_inv);
  // Tensor modes: one decode scale; NVFP4: the copy's tensor decode scale.
  const float tensor_si =
      (a.mode == ScalingMode::kDelayedTensor || a.mode == ScalingMode::kCurrentTensor)
          ? *static_cast<const float*>(a.scale_inv)
          : 0.0f;
  const float gsi = QF == kFmtE2M1 ? *a.gsi : 0.0f;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = u / per_row, c = (u - r * per_row) * U, i = r * C + c;
    uint32_t code[U];
    if constexpr (QF == kFmtE2M1) {
      static_assert(U == 16, "NVFP4 dequantizes whole blocks");
      uint2 w;  // even element in the low nibble
      if constexpr (VEC) {
        w = *reinterpret_cast<const uint2*>(a.q + i / 2);
      } else {
        w = make_uint2(0u, 0u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w.x |= uint32_t(a.q[i / 2 + j]) << (8 * j);
          w.y |= uint32_t(a.q[i / 2 + 4 + j]) << (8 * j);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        code[j] = (w.x >> (4 * j)) & 0xFu;
        code[8 + j] = (w.y >> (4 * j)) & 0xFu;
      }
    } else if constexpr (U == 16) {
      const uint4 w = *reinterpret_cast<const uint4*>(a.q + i);
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) code[j] = (ws[j >> 2] >> ((j & 3) * 8)) & 0xFFu;
    } else {
      code[0] = a.q[i];
    }
    float y[U];
    if constexpr (QF == kFmtE2M1) {
      // (decode(q) * decode(sb)) * global_scale_inv: two rounded float32 products.
      const float sb = decode(sbytes[r * (C / 16) + c / 16], kE4M3);
#pragma unroll
      for (int j = 0; j < 16; ++j) y[j] = __fmul_rn(__fmul_rn(decode(code[j], F), sb), gsi);
      if (a.rht) hadamard16_inverse(y, a.mask);
    } else if (a.mode == ScalingMode::kBlock1d || a.mode == ScalingMode::kBlock2d) {
      const float* sf = static_cast<const float*>(a.scale_inv);
#pragma unroll
      for (int j = 0; j < U; ++j)
        y[j] = __fmul_rn(decode(code[j], F), sf[fp8_block_scale_index(a.mode, a.R, C, r, c + j)]);
    } else if (a.mode == ScalingMode::kMxfp8_1d) {
#pragma unroll
      for (int j = 0; j < U; ++j)
        y[j] = __fmul_rn(decode(code[j], F), decode_e8m0(sbytes[r * (C / 32) + (c + j) / 32]));
    } else {
#pragma unroll
      for (int j = 0; j < U; ++j) y[j] = __fmul_rn(decode(code[j], F), tensor_si);
    }
    if constexpr (VEC) {
      if constexpr (OUT == 0) {
        float4* o = reinterpret_cast<float4*>(static_cast<float*>(a.out) + i);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          o[j] = make_float4(y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3]);
      } else {
        uint32_t h[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          h[j] = out_bits<OUT>(y[2 * j]) | (out_bits<OUT>(y[2 * j + 1]) << 16);
        uint4* o = reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.out) + i);
        o[0] = make_uint4(h[0], h[1], h[2], h[3]);
        o[1] = make_uint4(h[4], h[5], h[6], h[7]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < U; ++j) store_out<OUT>(a.out, i + j, y[j]);
    }
  }
}

template <int QF, int OUT>
Status launch(const DeqArgs& a, bool vec, cudaStream_t st) {
  const int64_t n = a.R * a.C;
  if constexpr (QF == kFmtE2M1) {
    if (vec)
      dequant_kernel<QF, OUT, 16, true><<<grid_for(n / 16, 256, 8192), 256, 0, st>>>(a);
    else
      dequant_kernel<QF, OUT, 16, false><<<grid_for(n / 16, 256, 8192), 256, 0, st>>>(a);
  } else {
    if (vec)
      dequant_kernel<QF, OUT, 16, true><<<grid_for(n / 16, 256, 8192), 256, 0, st>>>(a);
    else
      dequant_kernel<QF, OUT, 1, false><<<grid_for(n, 256, 8192), 256, 0, st>>>(a);
  }
  return launch_status("dequant_kernel");
}

template <int QF>
Status by_out(const DeqArgs& a, DType out, bool vec, cudaStream_t st) {
  switch (out) {
    case DType::kF32: return launch<QF, 0>(a, vec, st);
    case DType::kBF16: return launch<QF, 1>(a, vec, st);
    case DType::kF16: return launch<QF, 2>(a, vec, st);
    default: return Status::Invalid("dequantize: unsupported output dtype");
  }
}

}  // namespace
}  // namespace cuda

Status dequantize_cuda(const DequantizeParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t n = p.rows * p.cols;
  if (n == 0) return Status::Ok();
  if (!p.data || !p.out || !p.scale_inv) return Status::Invalid("dequantize: buffer missing");
  cuda::DeqArgs a{static_cast<const uint8_t*>(p.data),
                  p.rows,
                  p.cols,
                  p.mode,
                  p.scale_inv,
                  p.global_scale_inv,
                  is_nvfp4(p.mode) && p.rht,
                  p.rht_sign_mask & 0xFFFFu,
                  p.out};
  // Vector loads/stores when rows split into whole 16-byte pieces and the buffers are aligned.
  const bool vec = p.cols % 16 == 0 && cuda::aligned16(p.data) && cuda::aligned16(p.out);
  if (is_nvfp4(p.mode)) {
    if (p.cols % 16 != 0) return Status::Invalid("dequantize: NVFP4 needs cols % 16 == 0");
    if (!p.global_scale_inv) return Status::Invalid("dequantize: global_scale_inv missing");
    return cuda::by_out<cuda::kFmtE2M1>(a, p.out_dtype, vec, st);
  }
  if (p.q_dtype == DType::kE5M2) return cuda::by_out<cuda::kFmtE5M2>(a, p.out_dtype, vec, st);
  return cuda::by_out<cuda::kFmtE4M3>(a, p.out_dtype, vec, st);
}

}  // namespace lowbit
