// The fast FP8 block-scaling cast (1x128 blocks / 128x128 tiles, float32 scales): one read of
// the input, both copies and their scales. quantize.cu runs it on x; the fused norm (norm.cu) and
// activation (activation.cu) kernels run it with a Load functor that computes their output per
// chunk, so their block-scaled copies are this kernel's encode of the same values.
#pragma once

#include <type_traits>

#include "cast_kernels.cuh"

namespace lowbit {
namespace cuda {

// ---- FP8 block scaling (1x128 blocks / 128x128 tiles, float32 scales) ----
//
// Floor (bytes moved, one read of x): read R*C*sizeof(x) + write R*C (rowwise FP8) + R*C
// (colwise FP8) + scales (1D: 4 B per 128 elements per copy; 2D: 4 B per 128x128 tile per copy).
// bf16 8192x16384, both copies, 1D: 268.4 + 134.2 + 134.2 + 4.2 + 4.2 = 545 MB (4.06 B/elem),
// 0.187 ms at the H100's measured 2.92 TB/s copy rate; 2D: 537 MB (4.0 B/elem), 0.184 ms.
// The tensor amax (p.amax) is folded into the cast (one atomic per tile), so the fast path reads
// x exactly once.
//
// fp8_block_cast_kernel (fast path: rows and cols multiples of 16, 16-byte aligned pointers):
// one block of 512 threads per 128x128 tile.
// 1. Load: each thread issues all of its PER 16-byte chunks before using any (a warp reads two
//    (bf16) or one (f32) contiguous 256/512-byte row segments per instruction); out-of-range
//    chunks read as zeros (zeros never raise an amax). Chunk amaxes come from the registers; the
//    chunks go to shared memory in x's own dtype (32 KB for bf16/f16), swizzled at
//    16-byte-chunk granularity: chunk j of row r at j ^ ((r / 16) % 8) (conflict-free both ways).
// 2. Rowwise copy: a tile row is CPR consecutive lanes, so a 1x128 block's amax is a shuffle
//    reduction over those lanes; each thread re-reads its own chunks from shared memory (no
//    barrier; the tile is then not live in registers across the scale divisions, whose slow path
//    is a call that made ptxas spill), encodes CH values and writes them with one 8-byte (bf16,
//    f16) / 4-byte (f32) store, a warp writing whole 128-byte rows. 1D runs before the barrier.
// 3. Column phase from shared memory: lane 8q+g of warp w reads 32-bit word q of chunk column w
//    (CPW = 2 or 1 tile columns) in rows 16g..16g+15 (conflict-free thanks to the swizzle); a
//    column's 1x128 amax is a shuffle reduction over its 8 lanes, and each lane writes its 16
//    FP8 bytes of the column with one 16-byte store, the 8 lanes of a column one contiguous
//    128-byte run of the (C, R) copy.
// The scale and encode arithmetic is the CPU kernel's, element for element: max of |v| ignoring
// NaN, s = fp8_block_scale(amax, fmax, eps, pow2), q = enc(v * s) (product rounded, not fused),
// scale_inv = 1 / s. fp8_block_cast_generic_kernel below takes every other shape.
// DBIAS: the column phase also sums each of its columns over the tile's 128 rows (the values it
// already holds: 0 extra bytes read): its 16 rows in order, then the 8 row groups by a shuffle
// butterfly (every lane ends with the same bits), one float per column to a.dbias_part.
constexpr int kBlk = 128, kBlkThreads = 512;

struct BlockCastArgs {
  const void* x;
  int64_t R, C;
  uint8_t* q_row;  // (R, C) or null
  float* s_row;    // fp8_block_scale layout of the (R, C) copy
  uint8_t* q_col;  // (C, R) or null
  float* s_col;    // layout of the (C, R) copy
  float eps;
  bool pow2;
  int64_t tiles_c;
  float* amax_out;  // fast kernel: amax(x) folded in (atomicMax, zeroed before), or null
  // Fast kernel with DBIAS: this tile's column sums of x (float32) at [tile row][column] of a
  // (ceil(R / 128), C) array; launch_dbias_reduce sums them over the tile rows.
  float* dbias_part = nullptr;
};

// Dynamic shared memory of the fast kernel: the 128x128 tile in x's dtype.
template <int IN>
constexpr size_t blk_fast_smem() {
  return size_t(kBlk) * kBlk * sizeof(typename In<IN>::T);
}

// Element e of a 32-bit word of the staged tile (two 16-bit values, low one first, or one f32).
template <int IN>
__device__ __forceinline__ float word_elem(uint32_t w, int e) {
  if constexpr (IN == 0)
    return __uint_as_float(w);
  else
    return In<IN>::f(uint16_t(e ? (w >> 16) : (w & 0xffffu)));
}

// 16-bit inputs: 3 resident blocks of 512 threads (<= 40 registers, no spills: the registers that
// hold the tile are dead at the scale divisions, whose slow path is a call); f32: 2.
template <int IN>
constexpr int blk_min_blocks() {
  return IN != 0 ? 3 : 2;
}

// What the block cast quantizes is x itself (PlainBlockLoad), or values a Load functor computes
// per 16-byte chunk from its own sources (the fused norm and activation kernels: norm.cu's
// NormBlockLoad, activation.cu's ActBlockLoad), so the fused outputs are this kernel's encode of
// the same values, bit for bit. A Load has:
//   kLoads           16-byte source chunks per output chunk;
//   kMinBlocks       resident blocks to ask for (its sources stay in registers while loading);
//   Shared           the shared memory it stages per tile;
//   fetch<IN>(gr, gc, src)            issues the loads of output chunk (gr, gc) (in range only);
//   stage(shared, r0, c0, R, C, t)    fills Shared for the tile at (r0, c0) (all threads);
//   apply<IN>(shared, src, gc, lr, lc) -> the chunk's values in x's dtype.
struct PlainBlockLoad {
  static constexpr int kLoads = 0;
  struct Shared {};
};

// x given as n_parts column parts, each (R, pc) row-major (quantize_parts: dq, dk, dv of a fused
// QKV projection), read where they lie. pc is a multiple of 64, so no 16-byte chunk straddles two
// parts; the bytes are those of PlainBlockLoad on the concatenation.
template <int IN>
struct PartsBlockLoad {
  static constexpr int kLoads = 1;
  static constexpr int kMinBlocks = blk_min_blocks<IN>();
  struct Shared {};
  const void* p0;
  const void* p1;
  const void* p2;  // null with two parts
  int64_t pc;

  template <int IN_>
  __device__ __forceinline__ void fetch(int64_t gr, int64_t gc, uint4 (&src)[1]) const {
    using T = typename In<IN_>::T;
    const int64_t i = gc / pc;
    const void* part = i == 0 ? p0 : i == 1 ? p1 : p2;  // no indexed parameter array: no local copy
    src[0] = __ldg(
        reinterpret_cast<const uint4*>(static_cast<const T*>(part) + gr * pc + (gc - i * pc)));
  }
  __device__ __forceinline__ void stage(Shared&, int64_t, int64_t, int64_t, int64_t, int) const {}
  template <int IN_>
  __device__ __forceinline__ uint4 apply(const Shared&, const uint4 (&src)[1], int64_t, int,
                                         int) const {
    return src[0];
  }
};

template <int IN, typename Load>
constexpr int blk_min_blocks_of() {
  if constexpr (std::is_same<Load, PlainBlockLoad>::value)
    return blk_min_blocks<IN>();
  else
    return Load::kMinBlocks;
}

template <int IN, int FMT, bool TWO_D, typename Load = PlainBlockLoad, bool DBIAS = false>
__global__ void __launch_bounds__(kBlkThreads, blk_min_blocks_of<IN, Load>())
    fp8_block_cast_kernel(const BlockCastArgs a, const Load load = Load{}) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));        // elements per 16-byte chunk (8 or 4)
  constexpr int CPR = kBlk / CH;                 // chunks per tile row (16 or 32)
  constexpr int PER = kBlk * CPR / kBlkThreads;  // chunks per thread (4 or 8)
  constexpr int NW = kBlkThreads / 32;           // warps (16)
  constexpr int CPW = 4 / int(sizeof(T));        // tile columns per 32-bit word (2 or 1)
  constexpr int PASSES = CPR / NW;               // column-phase passes (1 or 2)
  constexpr int LPS = CPR / PER;                 // 1D rowwise: lanes per row scale (4)
  constexpr float FMAX = fmt_max<FMT>();
  static_assert(PER * kBlkThreads == kBlk * CPR && PASSES * NW == CPR, "tile/threads mismatch");
  static_assert(CPR <= 32 && LPS * PER == CPR && kBlk == 8 * 16, "row/column-phase mapping");

  extern __shared__ uint4 tile[];  // [kBlk][CPR] chunks, swizzled
  __shared__ float red[NW];

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t R = a.R, C = a.C;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const uint32_t tiles_c = uint32_t(a.tiles_c);
  const uint32_t tr = blockIdx.x / tiles_c, tc = blockIdx.x - tr * tiles_c;
  const int64_t r0 = int64_t(tr) * kBlk, c0 = int64_t(tc) * kBlk;
  // Chunk i of this thread: tile row i * (kBlkThreads / CPR) + t / CPR, chunk column t % CPR.
  const int lr0 = t / CPR, ch = t % CPR;
  auto slot = [&](int lr) { return lr * CPR + (ch ^ ((lr >> 4) & 7)); };

  // 1. load: all loads issued before any use.
  uint4 raw[PER];
  if constexpr (std::is_same<Load, PlainBlockLoad>::value) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int64_t gr = r0 + lr0 + i * (kBlkThreads / CPR), gc = c0 + ch * CH;
      raw[i] = (gr < R && gc < C) ? __ldg(reinterpret_cast<const uint4*>(x + gr * C + gc))
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
  } else {  // the Load's sources, its staged tile data, then the values (padding stays zero)
    __shared__ typename Load::Shared lsh;
    uint4 src[PER][Load::kLoads];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int64_t gr = r0 + lr0 + i * (kBlkThreads / CPR), gc = c0 + ch * CH;
      if (gr < R && gc < C) load.template fetch<IN>(gr, gc, src[i]);
    }
    load.stage(lsh, r0, c0, R, C, t);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int lr = lr0 + i * (kBlkThreads / CPR);
      const int64_t gr = r0 + lr, gc = c0 + ch * CH;
      raw[i] = (gr < R && gc < C) ? load.template apply<IN>(lsh, src[i], gc, lr, ch * CH)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // Each chunk's amax; the thread's max feeds the fused amax(x) and the 2-D tile amax.
  float cm[PER], m = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    tile[slot(lr0 + i * (kBlkThreads / CPR))] = raw[i];
    float v[CH];
    unpack16<IN>(raw[i], v);
    cm[i] = amax_n<CH>(v);
    m = fmaxf(m, cm[i]);
  }

  // Rowwise copy of chunk i with scale s: re-read from shared memory (this thread's own store,
  // so no barrier; keeps the tile out of registers across the divisions), encode, one store.
  auto row_store = [&](int i, float s) {
    const int lr = lr0 + i * (kBlkThreads / CPR);
    const int64_t gr = r0 + lr, gc = c0 + ch * CH;
    float v[CH];
    unpack16<IN>(tile[slot(lr)], v);
    uint32_t w[CH / 4];
#pragma unroll
    for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
#pragma unroll
    for (int k = 0; k < CH; k += 2)
      w[k >> 2] |= enc_fp8x2<FMT>(__fmul_rn(v[k], s), __fmul_rn(v[k + 1], s)) << ((k & 3) * 8);
    if (gr < R && gc < C) {
      uint8_t* q = a.q_row + gr * C + gc;
      if constexpr (CH == 8)
        *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
      else
        *reinterpret_cast<uint32_t*>(q) = w[0];
    }
  };

  // 2. (1D) rowwise copy, before the barrier (it needs nothing from other warps): a 1x128
  // block is CPR consecutive lanes of one chunk index. Lane L computes the scale of its
  // chunk (L % CPR) / LPS (LPS lanes compute the same one) and writes its scale_inv; every
  // lane fetches the scale of each of its chunks with a shuffle: one division per lane, not PER.
  if constexpr (!TWO_D) {
    if (a.q_row) {
      const int base = lane & ~(CPR - 1);
      int mine;
      const float sm = row_block_scale<CPR, PER>(cm, FMAX, a.eps, a.pow2, &mine);
      if (lane % LPS == 0) {
        const int64_t gr = r0 + lr0 + mine * (kBlkThreads / CPR);
        if (gr < R) a.s_row[tc * round_up4(R) + gr] = 1.0f / sm;
      }
#pragma unroll
      for (int i = 0; i < PER; ++i) row_store(i, __shfl_sync(kFull, sm, base + i * LPS));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  float tm = 0.0f;  // the tile's amax
#pragma unroll
  for (int w = 0; w < NW; ++w) tm = fmaxf(tm, red[w]);
  if (a.amax_out && t == 0) atomic_max_nonneg(a.amax_out, tm);

  float s2 = 1.0f;
  if constexpr (TWO_D) {
    s2 = fp8_block_scale(tm, FMAX, a.eps, a.pow2);
    if (t == 0) {
      // This tile's scale_inv, and the padding entries (1.0) after the last tile of its row of
      // tiles (rowwise copy) / column of tiles (colwise copy).
      const float inv = 1.0f / s2;
      const int64_t tiles_r = (R + kBlk - 1) / kBlk, ldr = round_up4(tiles_c),
                    ldc = round_up4(tiles_r);
      if (a.s_row) {
        a.s_row[tr * ldr + tc] = inv;
        if (tc == tiles_c - 1)
          for (int64_t j = tc + 1; j < ldr; ++j) a.s_row[tr * ldr + j] = 1.0f;
      }
      if (a.s_col) {
        a.s_col[tc * ldc + tr] = inv;
        if (tr == tiles_r - 1)
          for (int64_t j = tr + 1; j < ldc; ++j) a.s_col[tc * ldc + j] = 1.0f;
      }
    }
    if (a.q_row) {
#pragma unroll
      for (int i = 0; i < PER; ++i) row_store(i, s2);
    }
  }

  // 3. column phase: lane 8q+g, word q of chunk column cu, rows 16g..16g+15 (chunk cu of those
  // rows sits at cu ^ g: the 8 row groups hit 8 different bank groups).
  if (DBIAS || a.q_col) {
    const uint32_t* tw = reinterpret_cast<const uint32_t*>(tile);
    const int q = lane >> 3, g = lane & 7;
    const int64_t gr = r0 + 16 * g;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int cu = warp + p * NW;  // chunk column of the tile
      auto word = [&](int k) { return tw[((16 * g + k) * CPR + (cu ^ g)) * 4 + q]; };
      // 1D: a column's 1x128 amax over its 8 lanes; lane g computes the scale of the word's
      // column g % CPW and writes its scale_inv (g < CPW); the others fetch it (shuffle). The
      // words are read again for the encode, so none is live across the division.
      float sc = s2;
      if (!TWO_D && a.q_col) {  // uniform over the block
        float bm = 0.0f;
#pragma unroll
        for (int e = 0; e < CPW; ++e) {
          float v = 0.0f;
#pragma unroll
          for (int k = 0; k < 16; ++k) v = fmaxf(v, fabsf(word_elem<IN>(word(k), e)));
          v = fmaxf(v, __shfl_xor_sync(kFull, v, 1));
          v = fmaxf(v, __shfl_xor_sync(kFull, v, 2));
          v = fmaxf(v, __shfl_xor_sync(kFull, v, 4));
          if (g % CPW == e) bm = v;
        }
        sc = fp8_block_scale(bm, FMAX, a.eps, a.pow2);
        const int64_t gc = c0 + cu * CH + q * CPW + g;
        if (g < CPW && gc < C) a.s_col[int64_t(tr) * round_up4(C) + gc] = 1.0f / sc;
        __syncwarp();  // keep the words' second read after the division
      }
      uint32_t w[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) w[k] = word(k);
      if constexpr (DBIAS) {  // lane g < CPW writes the sum of the word's column g
        float mine = 0.0f;
#pragma unroll
        for (int e = 0; e < CPW; ++e) {
          float v = 0.0f;
#pragma unroll
          for (int k = 0; k < 16; ++k) v = __fadd_rn(v, word_elem<IN>(w[k], e));
          v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 1));
          v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 2));
          v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 4));
          if (g == e) mine = v;
        }
        const int64_t gc = c0 + cu * CH + q * CPW + g;
        if (g < CPW && gc < C) a.dbias_part[int64_t(tr) * C + gc] = mine;
      }
      if (!a.q_col) continue;
#pragma unroll
      for (int e = 0; e < CPW; ++e) {
        const int64_t gc = c0 + cu * CH + q * CPW + e;
        const float s = TWO_D ? s2 : __shfl_sync(kFull, sc, (lane & ~7) | e);
        uint32_t o[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2)
          o[k >> 2] |= enc_fp8x2<FMT>(__fmul_rn(word_elem<IN>(w[k], e), s),
                                      __fmul_rn(word_elem<IN>(w[k + 1], e), s))
                       << ((k & 3) * 8);
        if (gc < C && gr < R)
          *reinterpret_cast<uint4*>(a.q_col + gc * R + gr) = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  }
}

// Whether the fast block cast takes an (R, C) output: the fused tile cast's conditions (whole
// 16-element chunks, 16-byte aligned rows of the sources `x_ok` and of the copies written).
inline bool block_cast_fits(int64_t R, int64_t C, bool x_ok, const void* q_row, const void* q_col) {
  return R > 0 && tile_cast_fits(R, C, x_ok, q_row, q_col);
}

// Launches the fast block cast over the (a.R, a.C) output with `load` (a.tiles_c set here); the
// scale padding needs no fill (the kernel writes it for whole 16-row/column chunks).
// DBIAS: also the per-tile column sums into a.dbias_part (needed non-null).
template <int IN, int FMT, bool DBIAS = false, typename Load>
Status launch_fp8_block_cast(BlockCastArgs a, bool two_d, const Load& load, cudaStream_t st) {
  a.tiles_c = (a.C + kBlk - 1) / kBlk;
  const int64_t tiles = ((a.R + kBlk - 1) / kBlk) * a.tiles_c;
  if (tiles > INT32_MAX || tiles < 1)
    return Status::Invalid("block cast: tensor too large or empty");
  if (DBIAS && a.dbias_part == nullptr)
    return Status::Invalid("block cast: dbias workspace missing");
  auto kernel = two_d ? fp8_block_cast_kernel<IN, FMT, true, Load, DBIAS>
                      : fp8_block_cast_kernel<IN, FMT, false, Load, DBIAS>;
  const size_t smem = blk_fast_smem<IN>();
  // Only above the 48 KB default (f32): a host-side call, legal during capture.
  if (smem > 48 * 1024)
    if (auto s = api_status(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
            "cudaFuncSetAttribute");
        !s.ok())
      return s;
  kernel<<<unsigned(tiles), kBlkThreads, smem, st>>>(a, load);
  return launch_status("fp8_block_cast_kernel");
}

// dbias from the block cast's per-tile column sums, rounded once to x's dtype. A block takes 32
// columns; its 8 warps take contiguous runs of tile rows (8 loads in flight per lane, each warp
// load one 128-byte row segment) and their sums add in warp order: a fixed order, deterministic.
// tiles == 0 (no rows) writes zeros. Floor: 4 B per tile row and column (64 x 16384: 4 MB, read
// right after the cast wrote it, mostly from L2), ~2-3 us with 512 blocks; one thread per column
// would give 64 blocks of 256 for 132 SMs, each thread 64 dependent adds.
constexpr int kDbiasRedWarps = 8, kDbiasRedUnroll = 8;

template <int IN>
__global__ void __launch_bounds__(32 * kDbiasRedWarps)
    block_dbias_reduce_kernel(const float* __restrict__ part, int64_t tiles, int64_t C, void* out) {
  __shared__ float red[kDbiasRedWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  const int64_t per = (tiles + kDbiasRedWarps - 1) / kDbiasRedWarps;
  const int64_t t1 = min(tiles, (warp + 1) * per);
  float s = 0.0f;
  if (c < C) {
    int64_t t = warp * per;
    for (; t + kDbiasRedUnroll <= t1; t += kDbiasRedUnroll) {
      float v[kDbiasRedUnroll];
#pragma unroll
      for (int u = 0; u < kDbiasRedUnroll; ++u) v[u] = part[(t + u) * C + c];
#pragma unroll
      for (int u = 0; u < kDbiasRedUnroll; ++u) s = __fadd_rn(s, v[u]);
    }
    for (; t < t1; ++t) s = __fadd_rn(s, part[t * C + c]);
  }
  red[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && c < C) {
    float r = 0.0f;
#pragma unroll
    for (int w = 0; w < kDbiasRedWarps; ++w) r = __fadd_rn(r, red[w][lane]);
    store_out<IN>(out, c, r);
  }
}

// dbias (C,) in x's dtype from the (ceil(R / 128), C) partials of a DBIAS block cast of R rows.
template <int IN>
Status launch_dbias_reduce(const float* part, int64_t R, int64_t C, void* dbias, cudaStream_t st) {
  if (C <= 0) return Status::Ok();
  const int64_t blocks = (C + 31) / 32;
  if (blocks > INT32_MAX) return Status::Invalid("block dbias: too many columns");
  block_dbias_reduce_kernel<IN>
      <<<unsigned(blocks), 32 * kDbiasRedWarps, 0, st>>>(part, (R + kBlk - 1) / kBlk, C, dbias);
  return launch_status("block_dbias_reduce_kernel");
}

}  // namespace cuda
}  // namespace lowbit
