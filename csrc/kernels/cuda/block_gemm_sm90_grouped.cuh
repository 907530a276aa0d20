// The grouped (ragged-M) pieces of lowbit's own sm_90a block-scaled GEMM (the kGrouped kernel of
// block_gemm_sm90_kernel.cuh; see its header comment): the group table, the walk over every
// group's tiles, A's per-group scales and the rows no group covers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "block_gemm_sm90_tiles.cuh"

namespace lowbit {
namespace {

// Grouped: shared memory after the staging area holds tp[0..G] (the exclusive prefix of the
// groups' M tile counts; tp[G] the total) and st[0..G] (their first rows; st[G] = the rows covered,
// st[g + 1] = start_g + size_g). Ranges as the grouped GEMM's setup kernel clamps them: sizes to
// [0, M], starts = the int64 exclusive sum clamped to M. All threads; ends with a barrier.
__device__ __forceinline__ void build_groups(const Args& a, int* tp, int* st) {
  const int G = a.groups;
  for (int g = threadIdx.x; g < G; g += blockDim.x) tp[g] = min(max(a.group_sizes[g], 0), a.m);
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0: each lane a contiguous run of groups, two warp scans (rows, then tiles).
    const int lane = threadIdx.x, per = (G + 31) / 32;
    const int lo = min(lane * per, G), hi = min(lo + per, G);
    int64_t rows = 0;
    for (int g = lo; g < hi; ++g) rows += tp[g];
    int64_t rows_incl = rows;
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, rows_incl, d);
      if (lane >= d) rows_incl += u;
    }
    int64_t off = rows_incl - rows;
    int tiles = 0;
    for (int g = lo; g < hi; ++g) {
      const int start = int(off < a.m ? off : int64_t(a.m));
      const int size = min(tp[g], a.m - start);
      off += tp[g];
      st[g] = start;
      tp[g] = (size + kBM - 1) / kBM;
      tiles += tp[g];
    }
    int tiles_incl = tiles;
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, tiles_incl, d);
      if (lane >= d) tiles_incl += u;
    }
    int toff = tiles_incl - tiles;
    for (int g = lo; g < hi; ++g) {
      const int c = tp[g];
      tp[g] = toff;
      toff += c;
    }
    if (lane == 31) {
      tp[G] = tiles_incl;
      st[G] = int(rows_incl < a.m ? rows_incl : int64_t(a.m));
    }
  }
  __syncthreads();
}

// The grouped walk: Walk's order over (all groups' M tiles) x N tiles; a tile's group is the last
// g with tp[g] <= its M tile (empty groups share their successor's prefix and are skipped).
template <bool kMc>
struct GroupedWalk {
  int first, step, count, cols, rank, num_m;
  const int* tp;
  const int* st;
  __device__ __forceinline__ GroupedWalk(const Args& a, const int* tp_, const int* st_)
      : tp(tp_), st(st_) {
    num_m = tp[a.groups];
    cols = kMc ? (a.num_n + 1) / 2 : a.num_n;
    count = num_m * cols;
    first = kMc ? blockIdx.x / 2 : blockIdx.x;
    step = kMc ? gridDim.x / 2 : gridDim.x;
    rank = kMc ? blockIdx.x % 2 : 0;
  }
  __device__ __forceinline__ Tile tile(int t, const Args& a) const {
    const int per = a.group * cols;
    const int run = t / per, first_m = run * a.group;
    const int size = min(num_m - first_m, a.group);
    const int local = t - run * per;
    const int mt = first_m + local % size;
    int nb = local / size;
    if (kMc) nb = 2 * nb + rank;
    int lo = 0, hi = a.groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tp[mid] <= mt)
        lo = mid;
      else
        hi = mid - 1;
    }
    return Tile{st[lo] + (mt - tp[lo]) * kBM, st[lo + 1], nb, lo};
  }
};

// Grouped, warp 1 of the producer warpgroup: A's 128 scales of each stage, lane l rows l + 32 j
// of the tile (coalesced), by cp.async into the stage's scale slot once the stage is free, each
// lane's arrival on the full barrier when its copies have landed. Group g's scale of row r (within
// the group) and K block kb is sa[start_g * nkb + kb * size_g + r]; rows past the group read its
// last row's (finite, never stored).
template <int kStages, class W>
__device__ __forceinline__ void load_grouped_sa(const W& walk, const Args& a, const int* st,
                                                uint32_t sa0, uint32_t bar0) {
  using namespace sm90;
  const int lane = threadIdx.x % 32;
  int s = 0;
  uint32_t ph = 0;
  for (int t = walk.first; t < walk.count; t += walk.step) {
    const Tile tl = walk.tile(t, a);
    const int start = st[tl.g], size = tl.row_end - start;
    const float* src[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      src[j] = a.sa + int64_t(start) * a.nkb + min(tl.row0 - start + lane + 32 * j, size - 1);
    for (int kb = 0; kb < a.nkb; ++kb) {
      mbar_wait(bar0 + 8u * (kStages + s), ph ^ 1);  // empty(s)
      const uint32_t dst = sa0 + s * kScaleBytes + 4u * lane;
      const int64_t k_off = int64_t(kb) * size;
#pragma unroll
      for (int j = 0; j < 4; ++j) cp_async_4(dst + 128u * j, src[j] + k_off);
      cp_async_mbar_arrive(bar0 + 8u * s);  // full(s)
      if (++s == kStages) s = 0, ph ^= 1;
    }
  }
  cp_async_wait_all();
}

// Grouped, warps 2 and 3 of the producer warpgroup (`nthreads` threads, this one `tid`): zeros in
// the output rows [covered, M) no group covers, 16-byte stores spread over the grid (N * 2 bytes
// a row is a multiple of 16).
__device__ __forceinline__ void zero_uncovered_rows(const Args& a, int covered, int tid,
                                                    int nthreads) {
  uint4* const out =
      reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.out) + int64_t(covered) * a.n * 2);
  const int64_t chunks = (int64_t(a.m) - covered) * a.n / 8;
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int64_t i = int64_t(blockIdx.x) * nthreads + tid; i < chunks;
       i += int64_t(gridDim.x) * nthreads)
    out[i] = z;
}

}  // namespace
}  // namespace lowbit
