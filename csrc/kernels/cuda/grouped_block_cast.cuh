// The grouped FP8 block cast's fast kernel (BLOCK_1D, both copies): the tile mapping and scale
// layouts of grouped_quantize.cu's grouped_block1d_kernel (one block per 128-row tile of one
// group and 128 columns), with 16-byte loads all issued before use and the tile kept in shared
// memory in x's own dtype. The rowwise copy is encoded from the registers before the barrier (as
// block_cast.cuh's kernel does), the colwise one from the tile with cast_tile_kernel's column
// mapping: lane 8q + g holds tile rows 16g..16g+15 of two adjacent columns (one 4- or 8-byte
// shared read per row), the 8 lanes of a column reduce its 1x128 block amax with 3 shuffles and
// each writes its 16 bytes with one store. A warp per column (a 5-step shuffle chain per column,
// bytes staged in shared memory) left the kernel at about half the copy rate. The arithmetic is
// warp_block_encode's (amax ignoring NaN, fp8_block_scale, enc(v * s) with the product rounded,
// decode scale 1 / s), so the bytes and scales are the per-element kernel's. The tiles of rows in
// no group write both copies' zeros (no memset).
//
// Needs cols % 16 == 0 and 16-byte aligned x and outputs (the host checks). A lane's 16 colwise
// rows take one 16-byte store where they are all in the run and their address is 16-byte aligned
// (first row and M multiples of 16: the MoE dispatch's padded groups), single bytes otherwise.
#pragma once

#include "cast_kernels.cuh"
#include "lowbit/block_scaling.h"

namespace lowbit {
namespace cuda {

constexpr int kGfb = 128, kGfbThreads = 256;
// The tile, kGfb x kGfb in x's dtype, unpadded: 16-byte chunk j of tile row r sits at chunk
// gfb_chunk(r, j). A row (256 or 512 bytes) is whole 128-byte bank rows, so a 4-byte word's bank
// is 4 * (chunk % 8) + (word in chunk). Column reads (one instruction: lane 8q + g reads row
// 16g + k): bf16, 4-byte words: the 4 q read words 0..3 of one chunk j, the 8 g chunk j ^ g:
// banks 4 * ((j ^ g) % 8) + q, all 32 distinct. f32, 8-byte words: q = 0, 1 (2, 3) read chunk j
// (j + 1) whole, at (j ^ g) % 8 distinct over g: every bank twice, the two wavefronts a 256-byte
// request takes anyway. Row stores (16 bytes; 8 consecutive lanes write chunks 8i..8i+7 of one
// row r): (j ^ (r / 16)) % 8 distinct.
__device__ __forceinline__ int gfb_chunk(int r, int j) { return j ^ ((r >> 4) & 7); }
template <int IN>
constexpr size_t gfb_smem() {
  return size_t(kGfb) * kGfb * sizeof(typename In<IN>::T);
}
// 16-bit inputs: 4 resident blocks (<= 64 registers); f32 holds twice the registers per chunk.
template <int IN>
constexpr int gfb_min_blocks() {
  return IN != 0 ? 4 : 2;
}

struct GroupedBlockTile {
  int64_t g, run_start, run_size, r0;  // g < 0: rows in no group
};

// Which tile row blockIdx's tile row b is (the colwise scale rows' numbering, see
// grouped_quantize.cu): a group's block, or (b >= M/128 + G) a tile of the rows in no group.
// Warp-collective (b warp-uniform): g + 1 = the first g with first_g > b (first_g strictly
// increases, first_0 = 0 <= b) by a 32-way search (a lane loads one starts / ends pair a round):
// 2 dependent rounds up to 1024 groups, where a binary search waited log2(G) + 1 loads before
// the tile's first load of x.
__device__ __forceinline__ GroupedBlockTile grouped_block_tile(int64_t b, int64_t M, int64_t G,
                                                               const int64_t* starts,
                                                               const int64_t* ends) {
  GroupedBlockTile t;
  const int64_t grouped_rows = M / 128 + G;
  if (b < grouped_rows) {
    const int lane = threadIdx.x & 31;
    int64_t lo = 0, hi = G;  // the first g with first_g > b is in [lo, hi]
    int64_t s = 0, e = 0;    // starts / ends of lo - 1 (the last g seen with first_g <= b)
    while (lo < hi) {
      const int64_t step = (hi - lo + 31) / 32, i = lo + lane * step;
      int64_t si = 0, ei = 0;
      bool le = false;
      if (i < hi) {
        si = starts[i];
        ei = ends[i];
        le = grouped_block_colwise_first(si, i) <= b;
      }
      const int k = __popc(__ballot_sync(kFull, le));  // lanes 0..k-1: first_i <= b
      if (k == 0) {
        hi = lo;
      } else {
        s = __shfl_sync(kFull, si, k - 1);
        e = __shfl_sync(kFull, ei, k - 1);
        hi = lo + k * step < hi ? lo + k * step : hi;
        lo += (k - 1) * step + 1;
      }
    }
    t.g = lo - 1;
    t.run_start = s;
    t.run_size = e - s;
    t.r0 = s + (b - grouped_block_colwise_first(s, t.g)) * kGfb;
  } else {
    t.g = -1;
    t.run_start = G > 0 ? ends[G - 1] : 0;
    t.run_size = M - t.run_start;
    t.r0 = t.run_start + (b - grouped_rows) * kGfb;
  }
  return t;
}

// Writes bytes 0..n-1 of w (a lane's 16 colwise rows, n: how many are in the run) to q: one
// 16-byte store when all 16 are and q is 16-byte aligned, else byte by byte.
__device__ __forceinline__ void store_col16(uint8_t* q, const uint4& w, int n) {
  if (n >= 16 && (reinterpret_cast<uintptr_t>(q) & 15) == 0) {
    *reinterpret_cast<uint4*>(q) = w;
  } else {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < n) q[k] = uint8_t(ws[k >> 2] >> ((k & 3) * 8));
  }
}

template <int IN, int FMT, typename Args>
__global__ void __launch_bounds__(kGfbThreads, gfb_min_blocks<IN>())
    grouped_block1d_fast_kernel(const Args a) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));        // elements per 16-byte chunk
  constexpr int CPR = kGfb / CH;                 // chunks per tile row
  constexpr int PER = kGfb * CPR / kGfbThreads;  // chunks per thread
  constexpr int NW = kGfbThreads / 32;
  // Column phase: a warp pass covers 4 column pairs; 2 passes cover the tile's 128 columns.
  static_assert(NW * 2 * 8 == kGfb && kGfb == 8 * 16, "column-phase mapping");
  extern __shared__ uint4 smem[];  // the tile [kGfb][kGfb] in T, swizzled (gfb_chunk)
  T* tile = reinterpret_cast<T*>(smem);
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const int64_t b = int64_t(blockIdx.x) / a.tiles_c, tc = int64_t(blockIdx.x) - b * a.tiles_c;
  const GroupedBlockTile gt = grouped_block_tile(b, a.M, a.G, a.starts, a.ends);
  const int64_t run_end = gt.run_start + gt.run_size, r0 = gt.r0;
  if (r0 >= run_end) return;  // block-uniform
  const int64_t c0 = tc * kGfb;
  const int nr = int(run_end - r0 < kGfb ? run_end - r0 : kGfb);
  const int nc = int(a.K - c0 < kGfb ? a.K - c0 : kGfb);  // a multiple of 16
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t srow = gt.run_start * a.nkb + tc * gt.run_size + (r0 - gt.run_start);
  if (gt.g < 0) {  // rows in no group: zero data in both copies, rowwise scale_inv 1.0 (the
                   // colwise scale rows of no block are preset)
    if (a.q_row)
      for (int i = threadIdx.x; i < nr * (nc / 16); i += kGfbThreads) {
        const int rr = i / (nc / 16), j = i - rr * (nc / 16);
        *reinterpret_cast<uint4*>(a.q_row + (r0 + rr) * a.K + c0 + 16 * j) = make_uint4(0, 0, 0, 0);
      }
    if (a.s_row)
      for (int rr = threadIdx.x; rr < nr; rr += kGfbThreads) a.s_row[srow + rr] = 1.0f;
    if (a.q_col)  // 16 rows of one column per thread, as the column phase writes them
      for (int i = threadIdx.x; i < nc * 8; i += kGfbThreads) {
        const int cc = i >> 3, rr = 16 * (i & 7);
        if (rr < nr)
          store_col16(a.q_col + (c0 + cc) * a.M + r0 + rr, make_uint4(0, 0, 0, 0), nr - rr);
      }
    return;
  }
  // 1. Load: every chunk of this thread issued before any is used; rows past nr and columns
  // past nc read as zeros (zeros never raise an amax).
  uint4 raw[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = threadIdx.x + i * kGfbThreads, rr = c / CPR, cj = c - rr * CPR;
    raw[i] = (rr < nr && cj * CH < nc)
                 ? __ldg(reinterpret_cast<const uint4*>(x + (r0 + rr) * a.K + c0 + cj * CH))
                 : make_uint4(0u, 0u, 0u, 0u);
  }
  float tmax = 0.0f, cm[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = threadIdx.x + i * kGfbThreads, rr = c / CPR, cj = c - rr * CPR;
    float v[CH];
    unpack16<IN>(raw[i], v);
    cm[i] = amax_n<CH>(v);  // NaN ignored, as every amax
    tmax = fmaxf(tmax, cm[i]);
    *reinterpret_cast<uint4*>(tile + rr * kGfb + gfb_chunk(rr, cj) * CH) = raw[i];
  }
  // 2. Rowwise copy from the registers, before the barrier: a 1x128 block is CPR consecutive
  // lanes of one chunk index; lane L computes the scale of chunk (L % CPR) / LPS (one division
  // per lane) and fetches the others' with a shuffle; each chunk goes out as one store.
  if (a.q_row) {
    constexpr int LPS = CPR / PER;  // lanes per row scale
    const int base = lane & ~(CPR - 1);
    int mine;
    const float sm = row_block_scale<CPR, PER>(cm, fmt_max<FMT>(), a.eps, a.pow2, &mine);
    if (lane % LPS == 0) {
      const int rr = (threadIdx.x + mine * kGfbThreads) / CPR;
      if (rr < nr) a.s_row[srow + rr] = 1.0f / sm;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const float sc = __shfl_sync(kFull, sm, base + i * LPS);
      const int c = threadIdx.x + i * kGfbThreads, rr = c / CPR, cj = c - rr * CPR;
      float v[CH];
      unpack16<IN>(raw[i], v);
      uint32_t w[CH / 4];
#pragma unroll
      for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
#pragma unroll
      for (int k = 0; k < CH; k += 2)
        w[k >> 2] |= enc_fp8x2<FMT>(__fmul_rn(v[k], sc), __fmul_rn(v[k + 1], sc)) << ((k & 3) * 8);
      if (rr < nr && cj * CH < nc) {
        uint8_t* q = a.q_row + (r0 + rr) * a.K + c0 + cj * CH;
        if constexpr (CH == 8)
          *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
        else
          *reinterpret_cast<uint32_t*>(q) = w[0];
      }
    }
  }
  {
    __shared__ float red[NW];
    block_amax_to(tmax, red, a.amax + gt.g);  // its barrier also completes the tile
  }
  // 3. Colwise copy: in pass h, lane 8q + g of warp w holds tile rows 16g..16g+15 of columns
  // cc, cc + 1 (cc = 2 * (4 * (2w + h) + q)); the 8 lanes of a column hold its 1x128 block.
  // Rows past nr are zeros in the tile and never stored.
  if (a.q_col) {
    const int g = lane & 7;
#pragma unroll 1
    for (int h = 0; h < 2; ++h) {
      const int cc = 2 * (4 * (2 * warp + h) + (lane >> 3));
      const T* src = tile + 16 * g * kGfb + gfb_chunk(16 * g, cc / CH) * CH + cc % CH;
      float v[2][16];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        if constexpr (sizeof(T) == 2) {
          const uint32_t w = *reinterpret_cast<const uint32_t*>(src + k * kGfb);
          v[0][k] = In<IN>::f(uint16_t(w & 0xffffu));
          v[1][k] = In<IN>::f(uint16_t(w >> 16));
        } else {
          const float2 w = *reinterpret_cast<const float2*>(src + k * kGfb);
          v[0][k] = w.x;
          v[1][k] = w.y;
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float bm = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) bm = fmaxf(bm, fabsf(v[e][k]));  // NaN ignored
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, o));
        const float s = fp8_block_scale(bm, fmt_max<FMT>(), a.eps, a.pow2);
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2)
          w[k >> 2] |= enc_fp8x2<FMT>(__fmul_rn(v[e][k], s), __fmul_rn(v[e][k + 1], s))
                       << ((k & 3) * 8);
        if (cc < nc && 16 * g < nr) {
          store_col16(a.q_col + (c0 + cc + e) * a.M + r0 + 16 * g,
                      make_uint4(w[0], w[1], w[2], w[3]), nr - 16 * g);
          if (g == 0) a.s_col[b * a.K + c0 + cc + e] = 1.0f / s;
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace lowbit
