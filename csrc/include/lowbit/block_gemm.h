// FP8 block-scaled GEMM on the GPU (Float8BlockScaling: lowbit/gemm.h's a_block / b_block set),
// from the backends chosen per shape by measurement:
//  * cuBLASLt's VEC128_32F / BLK128x128_32F kernels (gemm_cublaslt, csrc/kernels/cuda/
//    gemm_cublaslt.cc),
//  * lowbit's sm_90a kernels on CUTLASS's blockwise-scaling collective (block_gemm_cutlass.cuh):
//    A 1x128 with B 128x128 (fprop, dgrad) or B 1x128 (wgrad), BF16 or F32 output, the bias
//    added in the epilogue, several tile shapes and schedules ("variants"), and
//  * lowbit's own sm_90a kernel for 1x128 x 128x128 and 1x128 x 1x128 (block_gemm_sm90.cu,
//    "sm90own").
//
// gemm_cuda sends block-scaled calls to block_gemm_cuda. At the first call for a (device, shape,
// dtypes, block modes, bias, alignment) key that is not inside a CUDA-graph capture, every
// candidate runs a few times on the caller's stream between events, and the fastest is kept in
// a process-wide table (one mutex; entries per device). LOWBIT_BLOCK_GEMM picks the backend:
// "auto" (default: the measurement), "cublaslt", "cutlass" (the fastest CUTLASS variant),
// "cutlass:<variant>" (that variant, e.g. for benchmarks), "sm90own" (lowbit's own kernel,
// block_gemm_sm90 below: the fastest of its configurations) or "sm90own:<config>" (one of them:
// n128/group8, n128/group16, n128_mc/group8, ..., n192_mc/group16). LOWBIT_BLOCK_GEMM_LOG=1 prints
// each measurement to stderr.
//
// Scale layouts are lowbit's (lowbit/block_scaling.h) as they are: the 1x128 array
// (ceil(K/128), round_up(rows, 4)) is CUTLASS's M/N-major scale layout with k-block stride
// round_up(rows, 4); the 128x128 array (ceil(N/128), round_up(ceil(K/128), 4)) its K-major one.
// The CUTLASS kernels need K a multiple of 16, N a multiple of 8 (BF16 out) or 4 (F32 out) and
// 16-byte aligned pointers; M, N, K need not be multiples of the tile.
#pragma once

#include <cstddef>

#include "lowbit/gemm.h"

namespace lowbit {

// cuBLASLt (every GEMM gemm_cuda takes; block-scaled calls without bias only).
Status gemm_cublaslt(const GemmParams& p, void* stream);

// The device a stream belongs to (gemm_cublaslt.cc; the current device for the legacy stream).
int gemm_stream_device(void* stream);

// The routed block-scaled GEMM (see above). With a bias, cuBLASLt counts as a candidate for F32
// outputs only (its result plus a bias pass); a BF16 output with a bias needs a CUTLASS variant
// (cuBLASLt would round twice).
Status block_gemm_cuda(const GemmParams& p, void* stream);

// Whether this build has the CUTLASS kernels (so callers may pass a bias with a BF16 output).
bool block_gemm_cutlass_built();

// The CUTLASS variants for p's dtypes and block modes (0 when none, or built without CUTLASS),
// their names, and one run of variant `v` with tile-scheduler swizzle `swizzle` (1, 2, 4 or 8).
// The run takes a float32 copy of a BF16 bias (N floats) and CUTLASS's few bytes from
// p.workspace (kGemmWorkspaceBytes is plenty).
int block_gemm_cutlass_variants(const GemmParams& p);
const char* block_gemm_cutlass_name(const GemmParams& p, int v);
Status block_gemm_cutlass(const GemmParams& p, int v, int swizzle, void* stream);

// lowbit's own sm_90a kernel (block_gemm_sm90.cu; "sm90own"): 1x128 E4M3/E5M2 A x 128x128 E4M3 B,
// persistent over 128 x block_n tiles (block_n 128 or 192) in runs of `group` M tiles per N tile;
// `multicast`: clusters of two CTAs sharing A's tile through TMA multicast. Eligible on compute
// capability 9.x with K % 16 == 0, N % 8 (BF16 out) or % 4 (F32) and 16-byte aligned A, B, out
// and A's scales; no workspace.
struct BlockGemmSm90Config {
  int block_n = 128;
  bool multicast = false;
  int group = 8;
};
bool block_gemm_sm90_eligible(const GemmParams& p);
Status block_gemm_sm90(const GemmParams& p, const BlockGemmSm90Config& c, void* stream);

}  // namespace lowbit
