// lowbit's own sm_90a block-scaled GEMM (block_gemm_sm90_kernel.cuh): its tile constants, shared
// memory plan, arguments and the dense tile walk.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "block_gemm_sm90_ptx.cuh"

namespace lowbit {
namespace {

constexpr int kBM = 128, kBK = 128;
constexpr uint32_t kATile = kBM * kBK;     // 1-byte elements
constexpr uint32_t kScaleBytes = kBM * 4;  // A's scales of one K block
constexpr uint32_t kThreads = 384;         // producer + 2 consumer warpgroups
constexpr uint32_t kConsumerWarps = 8;

// BLOCK_N 128 or 192 (a 192-column tile straddles two of B's 128-row scale blocks); as many
// stages as fit in 227 KB of shared memory (+ 1 KB alignment slack). kB1d: B's column scales too.
// The epilogue's staging area follows the barriers: per consumer warp 16 rows of one pass's 128
// output bytes, the row pitch padded so that the accumulator-layout writes hit 32 distinct banks
// (BF16: 8 rows x 4 words a row, pitch 36 words; F32: 4 rows x 8 words per half-warp phase, 40).
template <int kBN, bool kB1d, bool kF32Out>
struct Tiles {
  static constexpr uint32_t kBTile = kBN * kBK;
  static constexpr uint32_t kSbBytes = kB1d ? kBN * 4 : 0;  // B's scales of one K block
  static constexpr int kStages = kBN == 128 ? 6 : 5;
  static constexpr int kAcc = kBN / 2;  // accumulator registers per thread (per set)
  static constexpr uint32_t kOutBytes = kF32Out ? 4 : 2;
  static constexpr int kPassCols = 128 / kOutBytes;  // output columns per staging pass
  static constexpr int kPasses = kBN / kPassCols;
  static constexpr uint32_t kPitch = 128 + 8 * kOutBytes;
  static constexpr uint32_t kStaging = kConsumerWarps * 16 * kPitch;
  static constexpr uint32_t kPipeBytes =
      kStages * (kATile + kBTile + kScaleBytes + kSbBytes) + 2 * kStages * sizeof(uint64_t);
  static constexpr size_t kSmem = size_t(kPipeBytes) + kStaging + 1024;
  static_assert(kPipeBytes % 16 == 0, "staging area 16-byte aligned");
  static_assert(kSmem <= 227 * 1024, "shared memory");
};

struct Args {
  int m, n, num_m, num_n, nkb, group;  // num_n: BLOCK_N tiles
  int ld_sb, sb_rows;                  // B's 128x128 scales: round_up4(nkb), ceil(N / 128)
  const float* sb;                     // (sb_rows, ld_sb); 1Dx1D: through tma_sb instead
  const void* bias;
  int bias_f32;
  void* out;
  // Grouped only: sb is (groups, nkb, sb_rows); A's scales the grouped rowwise layout.
  const int32_t* group_sizes;
  const float* sa;
  int groups;
};

// A tile of the walk: output rows [row0, row0 + 128) clipped at row_end, N tile nb, group g.
struct Tile {
  int row0, row_end, nb, g;
};

// The tiles a CTA walks. Unicast: tile t of num_m x num_n from blockIdx.x in steps of gridDim.x.
// Multicast (clusters of 2 along N): cluster blockIdx.x / 2 walks pairs of N tiles (num_m x
// ceil(num_n / 2)), CTA rank r taking N tile 2 * pair + r (past N for the last pair of an odd
// num_n: it loads zeros and stores nothing, but keeps its peer's barriers going). Both orders are
// grouped: runs of `group` M tiles, N tile (pair) by N tile (pair).
template <bool kMc>
struct Walk {
  int first, step, count, cols, rank;
  // (The grouped walk's tables: unused.)
  __device__ __forceinline__ Walk(const Args& a, const int*, const int*) {
    cols = kMc ? (a.num_n + 1) / 2 : a.num_n;
    count = a.num_m * cols;
    first = kMc ? blockIdx.x / 2 : blockIdx.x;
    step = kMc ? gridDim.x / 2 : gridDim.x;
    rank = kMc ? blockIdx.x % 2 : 0;
  }
  __device__ __forceinline__ void coords(int t, const Args& a, int& mb, int& nb) const {
    const int per = a.group * cols;
    const int g = t / per, first_m = g * a.group;
    const int size = min(a.num_m - first_m, a.group);
    const int local = t - g * per;
    mb = first_m + local % size;
    nb = local / size;
    if (kMc) nb = 2 * nb + rank;
  }
  __device__ __forceinline__ Tile tile(int t, const Args& a) const {
    int mb, nb;
    coords(t, a, mb, nb);
    return Tile{mb * kBM, a.m, nb, 0};
  }
};

}  // namespace
}  // namespace lowbit
