// Kernel-level interface of the GEMM family:
//
//   out(M, N) = (A(M, K) . B(N, K)^T) * a_scale_inv * b_scale_inv  (+ bias(N))
//
// Both operands are K-major (row-major, contraction axis last), the layout Hopper's FP8 tensor
// cores need. Operands are E4M3/E5M2 with float32 per-tensor decode scales, or BF16 without
// scales. FP8 operands may instead carry FP8 block scales (a_block / b_block: float32 scale per
// 1x128 block along K, or per 128x128 tile, in the layout of lowbit/block_scaling.h's
// fp8_block_scale_index for the operand's (rows, K) copy); then
//   out(m, n) = sum over K blocks kb of (sum_{k in kb} a(m,k) b(n,k)) * sa(m,kb) * sb(n,kb).
//   Products accumulate in float32; the output is rounded once to BF16 or F32.
// Pointers are host pointers for the CPU kernel and device pointers for the CUDA one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

// Workspace the CUDA GEMM asks cuBLASLt to use (an XLA result buffer, so CUDA-graph replays see
// a stable address). 32 MiB is what cuBLASLt's Hopper kernels use at most for split-K.
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

struct GemmParams {
  const void* a = nullptr;  // (m, k) row-major
  const void* b = nullptr;  // (n, k) row-major
  DType a_dtype = DType::kE4M3;
  DType b_dtype = DType::kE4M3;
  int64_t m = 0, n = 0, k = 0;

  // FP8 only: (1,) float32 decode scales (device pointers on CUDA: no host sync to read them),
  // or the block-scale arrays when a_block / b_block is set.
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  // FP8 block scaling of each operand (lowbit/abi.h): kGemmBlockNone per-tensor, kGemmBlock_1d
  // = 1x128 blocks (cuBLASLt VEC128_32F), kGemmBlock_2d = 128x128 tiles (BLK128x128_32F). Both
  // set or neither; never both 2D.
  int a_block = 0, b_block = 0;

  const void* bias = nullptr;  // optional (n,), BF16 or F32
  DType bias_dtype = DType::kBF16;

  void* out = nullptr;  // (m, n) row-major, BF16 or F32
  DType out_dtype = DType::kBF16;

  bool fast_accum = false;  // CUDA FP8 only: skip the periodic promotion of partial sums

  void* workspace = nullptr;  // CUDA only
  size_t workspace_bytes = 0;
};

inline bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// The ScalingMode of a GEMM operand's block field (lowbit/abi.h: kGemmBlock_1d or _2d).
inline ScalingMode gemm_block_mode(int block) {
  return block == abi::kGemmBlock_2d ? ScalingMode::kBlock2d : ScalingMode::kBlock1d;
}

// Checks shared by both backends; the Python side checks the same things first with clearer
// messages, so this only guards against misuse of the FFI target.
inline Status validate(const GemmParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0) return Status::Invalid("gemm: negative dimension");
  const bool fp8 = is_fp8(p.a_dtype) && is_fp8(p.b_dtype);
  const bool bf16 = p.a_dtype == DType::kBF16 && p.b_dtype == DType::kBF16;
  if (!fp8 && !bf16)
    return Status::Invalid("gemm: operands must both be FP8 (E4M3/E5M2) or both BF16");
  if (fp8 && p.a_dtype == DType::kE5M2 && p.b_dtype == DType::kE5M2)
    return Status::Invalid("gemm: E5M2 x E5M2 is not supported (use E4M3 for one operand)");
  if (fp8 && (p.a_scale_inv == nullptr || p.b_scale_inv == nullptr))
    return Status::Invalid("gemm: FP8 operands need a_scale_inv and b_scale_inv");
  constexpr int kNone = abi::kGemmBlockNone, k2d = abi::kGemmBlock_2d;
  if (p.a_block < kNone || p.a_block > k2d || p.b_block < kNone || p.b_block > k2d)
    return Status::Invalid("gemm: block mode must be 0, 1 or 2");
  if ((p.a_block == kNone) != (p.b_block == kNone))
    return Status::Invalid("gemm: both operands must be block-scaled, or neither");
  if (p.a_block == k2d && p.b_block == k2d)
    return Status::Invalid("gemm: 128x128 x 128x128 block scaling is not supported");
  if (p.a_block && !fp8) return Status::Invalid("gemm: block scaling needs FP8 operands");
  if (p.out_dtype != DType::kBF16 && p.out_dtype != DType::kF32)
    return Status::Invalid("gemm: output must be BF16 or F32");
  if (p.bias && p.bias_dtype != DType::kBF16 && p.bias_dtype != DType::kF32)
    return Status::Invalid("gemm: bias must be BF16 or F32");
  if ((p.m * p.n > 0) && p.out == nullptr) return Status::Invalid("gemm: missing output");
  return Status::Ok();
}

// CPU backend (csrc/kernels/cpu/gemm.cc).
Status gemm_cpu(const GemmParams& p);

// CUDA backend through cuBLASLt (csrc/kernels/cuda/gemm_cublaslt.cc). `stream` is a
// cudaStream_t. Never synchronizes and never allocates device memory.
Status gemm_cuda(const GemmParams& p, void* stream);

// Creates the current device's cuBLASLt handle now (it is otherwise created on first use, which
// may fall inside a CUDA-graph capture).
Status gemm_cuda_init();

}  // namespace lowbit
