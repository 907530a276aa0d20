// The grouped GEMM's second backend for block-scaled FP8 ragged-M calls (fprop, dgrad; 1x128 A x
// 128x128 B scales): lowbit's own sm_90a kernel (block_gemm_sm90_kernel.cuh, grouped form; host
// side grouped_gemm_sm90.cu), and the router between it and CUTLASS (grouped_gemm_select.cc).
#pragma once

#include <cuda_runtime.h>

#include "lowbit/grouped_gemm.h"

namespace lowbit {
namespace gg {

// The groups' tables live in the kernel's shared memory (8 bytes a group).
constexpr int64_t kSm90MaxGroups = 1024;

struct Sm90GroupedConfig {
  bool multicast = false;  // clusters of 2 CTAs on N-adjacent tiles share A's tile
  int group = 8;           // M tiles per run of the tile order (L2 reuse of B)
};

// sm_90 device, ragged M, FP8 1x128 x 128x128 (A E4M3 / E5M2, B E4M3), K-major A and B, BF16
// out, K > 0 and % 16, N % 8, 16-byte aligned pointers and strides, at most kSm90MaxGroups.
bool sm90_grouped_eligible(const GroupedGemmParams& p);
// One launch, no workspace: the tiles of every group and the zero rows no group covers.
Status sm90_grouped(const GroupedGemmParams& p, const Sm90GroupedConfig& c, cudaStream_t stream);

// The CUTLASS path (grouped_gemm.cu): setup, CUTLASS, fallback kernels; p already validated.
Status cutlass_grouped(const GroupedGemmParams& p, cudaStream_t stream);

// grouped_gemm.cu: the SM count of the current device (cached); a Status from a CUDA error.
int current_sm_count();
Status cuda_status(cudaError_t e, const char* what);

// Whether LOWBIT_GROUPED_BLOCK_GEMM concerns the call (block-scaled ragged M, 128x128 B), and the
// routed run of such a call (grouped_gemm_select.cc).
bool block_route_applies(const GroupedGemmParams& p);
Status route_block(const GroupedGemmParams& p, cudaStream_t stream);

}  // namespace gg
}  // namespace lowbit
