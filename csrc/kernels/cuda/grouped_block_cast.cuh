// The grouped FP8 block cast's fast kernel (BLOCK_1D, both copies): the tile mapping and scale
// layouts of grouped_quantize.cu's grouped_block1d_kernel (one block per 128-row tile of one
// group and 128 columns), with 16-byte loads all issued before use, the tile kept in shared
// memory in x's own dtype (half the float32 tile: 4 resident blocks, not 2) and the encoded
// bytes staged there for 16-byte stores. The per-element kernel (one 2-byte load and one 1-byte
// store per element, a float32 tile) ran at a third of the copy rate: 0.91 ms for G64's tokens
// and gradient (floor ~0.29 ms), 2.3 ms at G8; 16-byte accesses alone did not move it (0.91 ms:
// two resident blocks per SM serialize their load, encode and store phases). The rowwise copy is
// encoded from the registers before the barrier (as block_cast.cuh's kernel does), the colwise one
// from the tile. The arithmetic is warp_block_encode's, element for element (amax ignoring NaN,
// fp8_block_scale, enc(v * s) with the product rounded), so the bytes and scales are the
// per-element kernel's. The tiles of rows in no group write both copies' zeros (no memset).
//
// Needs cols % 16 == 0 and 16-byte aligned x and outputs (the host checks); a colwise run of
// a tile takes 16-byte stores where its first row and M are multiples of 16 (the MoE dispatch's
// padded groups), single bytes otherwise.
#pragma once

#include "cast_kernels.cuh"
#include "lowbit/block_scaling.h"

namespace lowbit {
namespace cuda {

constexpr int kGfb = 128, kGfbThreads = 256;
// Row stride of the tile in elements: a 1x128 column read (lane l: row l + 32k) walks 32 banks
// (odd in 32-bit words), and 16-bit rows stay word-aligned.
template <typename T>
constexpr int gfb_ld() {
  return sizeof(T) == 2 ? kGfb + 2 : kGfb + 1;
}
// The tile in x's dtype plus a byte staging tile (16-byte aligned after the tile).
template <typename T>
constexpr size_t gfb_tile_bytes() {
  return (size_t(kGfb) * gfb_ld<T>() * sizeof(T) + 15) / 16 * 16;
}
template <int IN>
constexpr size_t gfb_smem() {
  return gfb_tile_bytes<typename In<IN>::T>() + size_t(kGfb) * kGfb;
}

struct GroupedBlockTile {
  int64_t g, run_start, run_size, r0;  // g < 0: rows in no group
};

// Which tile row blockIdx's tile row b is (the colwise scale rows' numbering, see
// grouped_quantize.cu): a group's block, or (b >= M/128 + G) a tile of the rows in no group.
__device__ __forceinline__ GroupedBlockTile grouped_block_tile(int64_t b, int64_t M, int64_t G,
                                                               const int64_t* starts,
                                                               const int64_t* ends) {
  GroupedBlockTile t;
  const int64_t grouped_rows = M / 128 + G;
  if (b < grouped_rows) {
    int64_t lo = 0, hi = G;  // first g with first_g > b
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (grouped_block_colwise_first(starts[mid], mid) <= b)
        lo = mid + 1;
      else
        hi = mid;
    }
    t.g = lo - 1;  // >= 0: first_0 = 0
    t.run_start = starts[t.g];
    t.run_size = ends[t.g] - t.run_start;
    t.r0 = t.run_start + (b - grouped_block_colwise_first(t.run_start, t.g)) * kGfb;
  } else {
    t.g = -1;
    t.run_start = G > 0 ? ends[G - 1] : 0;
    t.run_size = M - t.run_start;
    t.r0 = t.run_start + (b - grouped_rows) * kGfb;
  }
  return t;
}

// Writes n (<= 128) staged bytes to dst with 16-byte stores where dst is 16-byte aligned (the
// tail, or an unaligned dst, byte by byte); lanes of one warp.
__device__ __forceinline__ void store_run(uint8_t* dst, const uint8_t* src, int n, int lane) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    const int full = n / 16;
    if (lane < full)
      *reinterpret_cast<uint4*>(dst + 16 * lane) = *reinterpret_cast<const uint4*>(src + 16 * lane);
    for (int e = full * 16 + lane; e < n; e += 32) dst[e] = src[e];
  } else {
    for (int e = lane; e < n; e += 32) dst[e] = src[e];
  }
}

template <int IN, int FMT, typename Args>
__global__ void __launch_bounds__(kGfbThreads) grouped_block1d_fast_kernel(const Args a) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));        // elements per 16-byte chunk
  constexpr int CPR = kGfb / CH;                 // chunks per tile row
  constexpr int PER = kGfb * CPR / kGfbThreads;  // chunks per thread
  constexpr int NW = kGfbThreads / 32;
  constexpr int LD = gfb_ld<T>();
  extern __shared__ uint4 smem[];  // tile [kGfb][LD] in T, then bytes [kGfb][kGfb]
  T* tile = reinterpret_cast<T*>(smem);
  uint8_t* stage = reinterpret_cast<uint8_t*>(smem) + gfb_tile_bytes<T>();
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
    if (a.q_col)
      for (int i = threadIdx.x; i < nc * nr; i += kGfbThreads) {
        const int cc = i / nr, rr = i - cc * nr;
        a.q_col[(c0 + cc) * a.M + r0 + rr] = 0;
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
    // 32-bit stores (a 16-bit row is word-aligned, not 16-byte aligned)
    uint32_t* dst = reinterpret_cast<uint32_t*>(tile + rr * LD + cj * CH);
    dst[0] = raw[i].x, dst[1] = raw[i].y, dst[2] = raw[i].z, dst[3] = raw[i].w;
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
  // 3. Colwise copy: a warp encodes a column (1x128 along the group's rows) and stores its run.
  if (a.q_col)
    for (int cc = warp; cc < nc; cc += NW) {
      uint8_t* s = stage + cc * kGfb;
      const T* col = tile + cc;
      const float d =
          warp_block_encode_read<FMT>([&](int rr) { return In<IN>::f(col[rr * LD]); }, nr, a.eps,
                                      a.pow2, [&](int rr, uint8_t byte) { s[rr] = byte; });
      if (lane == 0) a.s_col[b * a.K + c0 + cc] = d;
      __syncwarp();
      store_run(a.q_col + (c0 + cc) * a.M + r0, s, nr, lane);
    }
}

}  // namespace cuda
}  // namespace lowbit
