// The cast kernels of the quantization ops (quantize.cu, grouped_quantize.cu): the fused
// 128x64 tile cast that writes the rowwise and colwise copies from one read, the generic
// rowwise / colwise kernels for any shape, and amax(x).
#pragma once

#include <type_traits>

#include "device_common.cuh"
#include "lowbit/block_scaling.h"

namespace lowbit {
namespace cuda {

// The fused cast's tile: 128 rows x 64 columns, 512 threads (see cast_tile_kernel).
constexpr int kTileR = 128, kTileC = 64, kTileThreads = 512;

// Kinds of quantization the cast kernels specialise on.
enum Kind : int { kTensor = 0, kMx = 1, kNv1 = 2, kNv2 = 3 };

// ---- what the cast kernels are told ----

struct CastArgs {
  const void* x = nullptr;
  int64_t R = 0, C = 0;
  bool rowwise = false, colwise = false;
  uint8_t* q_row = nullptr;  // (R, C) FP8 bytes or (R, C/2) packed FP4
  uint8_t* s_row = nullptr;  // block scales of the rowwise copy (MX e8m0 / NVFP4 e4m3)
  uint8_t* q_col = nullptr;  // (C, R) / (C, R/2)
  uint8_t* s_col = nullptr;
  // Tensor scale (FP8 tensor modes): delayed ? delayed[g] : scale_from_amax(amax_in[g], fmax),
  // g = 0, or the row's group when grouped.
  const float* delayed = nullptr;
  const float* amax_in = nullptr;   // also NVFP4: amax(x), the rowwise copy's tensor amax
  const float* amax_col = nullptr;  // NVFP4: the colwise copy's (Hadamard-transformed) amax
  const uint32_t* sr_seed = nullptr;
  bool rht = false;
  uint32_t rht_mask = 0;
  float* amax_out = nullptr;    // fused amax(x) (atomicMax; zeroed before; grouped: [G]), or null
  float* dbias_part = nullptr;  // [ceil(R/kTileR)][C] per-tile column sums, or null
  const int32_t* row_group = nullptr;  // grouped: each row's group, -1 for none
  uint32_t tiles_c = 0;                // tile columns (set by set_tiles)
  // x in parts (QuantizeParams::x_parts; the PARTS kernels): part i holds columns
  // [i * part_cols, (i + 1) * part_cols), row stride part_cols; part_cols is whole tiles.
  const void* parts[kMaxQuantizeParts] = {};
  int64_t part_cols = 0;
  // Grouped tile casts (kGroupTiles / kGroupRows below). Last, so that the non-grouped kernels'
  // parameter offsets stay as they were.
  const int2* tile_info = nullptr;      // per tile row: {group or kTileRowScales / kTileNoGroup,
                                        // bits of the group's tensor scale}
  const int32_t* rows_list = nullptr;   // the kTileRowScales tile rows, in any order
  const int32_t* rows_count = nullptr;  // how many
};

// Whether the fused cast takes an (R, C) input: whole 16-element chunks, 16-byte aligned rows of
// x (`x_ok`, the caller's check of its source buffers) and of the copies it writes (null: not
// written). quantize.cu and norm.cu (NormLoad) both ask this.
inline bool tile_cast_fits(int64_t R, int64_t C, bool x_ok, const void* q_row, const void* q_col) {
  return R % 16 == 0 && C % 16 == 0 && x_ok && (!q_row || aligned16(q_row)) &&
         (!q_col || aligned16(q_col));
}

// Tile count of the fused cast; false when it does not fit a 1-D grid.
inline bool set_tiles(CastArgs& a, int64_t* tiles) {
  const int64_t tr = (a.R + kTileR - 1) / kTileR, tc = (a.C + kTileC - 1) / kTileC;
  *tiles = tr * tc;
  if (*tiles > INT32_MAX || *tiles < 1) return false;
  a.tiles_c = uint32_t(tc);
  return true;
}

// Group g's tensor scale: delayed[g] (delayed scaling), else from amax[g]. One expression for the
// cast and grouped_quantize.cu's finalize (scale_inv, the one-group tiles' scale): same bits.
template <int FMT>
__device__ __forceinline__ float group_scale(const float* delayed, const float* amax, int64_t g) {
  return delayed ? delayed[g] : scale_from_amax(amax[g], fmt_max<FMT>());
}

template <int FMT>
__device__ __forceinline__ float tensor_scale(const CastArgs& a, int64_t g) {
  return group_scale<FMT>(a.delayed, a.amax_in, g);
}

// Scale byte of MXFP8 rows that belong to no group (grouped quantize): 2^0, like the CPU kernel.
constexpr uint8_t kMxEmptyScale = 127;

// ---- the fused cast: one 128x64 tile per block, both copies from one read ----
//
// 1. Each of the 512 threads loads PER 16-byte chunks of the tile (coalesced 128-byte row
//    segments), keeps them in registers for the rowwise copy and stores them to shared memory.
//    Shared memory is swizzled at 16-byte-chunk granularity: chunk j of row r is stored at chunk
//    j ^ ((r / 16) % 8), so the column reads below hit 8 different bank groups.
// 2. Column phase: the 8 lanes 8q..8q+7 of a warp own tile column 4*warp+q, lane 8q+g rows
//    16g..16g+15. That is one 16-byte FP8 store (8 for FP4) and the 8 lanes of a column write
//    one contiguous 128-byte (64-byte) run of the colwise copy; a 16-row slice is one NVFP4
//    block and lanes g, g^1 together one MX block; the block scales of a column are consecutive
//    bytes written by one warp instruction, so they coalesce into one request; dbias is reduced
//    across the 8 lanes with shuffles.
// 3. Rowwise phase from the registers: 8 (bf16/f16) or 4 (f32) elements per chunk; MX/NVFP4
//    block amaxes come from the neighbouring lanes that hold the rest of the block (shuffles).
// Why: scattered one-byte MXFP8 scale stores are expensive; this mapping turns a column's scale
// bytes and its colwise data into one request each.
// Grouped tile casts (grouped_quantize.cu) are two launches of the tile kernel. kGroupTiles: every
// tile whose rows below R are all in one group g >= 0 (tile_info.x = g; all tiles but at most one
// per group end) is cast exactly as a non-grouped tile, with g's scale (tile_info.y) and one amax
// atomic into amax_out[g]; a tile whose rows are in no group (kTileNoGroup) writes zeros; the
// others (kTileRowScales) exit. kGroupRows: a grid over rows_list, the kTileRowScales tiles, with
// each row's group from row_group (per-row scales, rows in no group written as zeros, one amax
// atomic per run of same-group rows in a warp). Why two kernels: in one, the per-row path's
// registers made the common tiles spill at 3 resident blocks, and at 2 the grouped cast ran at
// about half the non-grouped speed (H200 profile, issue 27).
enum TileGrouping : int { kUngrouped = 0, kGroupTiles = 1, kGroupRows = 2 };
constexpr int kTileRowScales = -1, kTileNoGroup = -2;

// kGroupTiles, a tile whose rows are all in no group: zero bytes in both copies (MXFP8: scale
// bytes kMxEmptyScale), with the thread-to-chunk mappings of the tile kernel's phases 2 and 3.
template <int KIND>
__device__ __forceinline__ void cast_tile_zeros(const CastArgs& a, int64_t r0, int64_t c0, int CH,
                                                int CPR, int PER) {
  static_assert(KIND == kTensor || KIND == kMx, "grouped quantize: FP8 kinds only");
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  if (a.rowwise)
    for (int i = 0; i < PER; ++i) {
      const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
      const int64_t gr = r0 + lr, gc = c0 + lc;
      if (gr >= a.R || gc >= a.C) continue;
      uint8_t* q = a.q_row + gr * a.C + gc;
      if (CH == 8)
        *reinterpret_cast<uint2*>(q) = make_uint2(0u, 0u);
      else
        *reinterpret_cast<uint32_t*>(q) = 0u;
      if (KIND == kMx && (lc & 31) == 0) a.s_row[gr * (a.C / 32) + gc / 32] = kMxEmptyScale;
    }
  if (a.colwise) {  // tensor scaling only (grouped MXFP8 is rowwise)
    const int64_t gc = c0 + warp * 4 + (lane >> 3), gr = r0 + 16 * (lane & 7);
    if (gc < a.C && gr < a.R)
      *reinterpret_cast<uint4*>(a.q_col + gc * a.R + gr) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// 16-bit inputs, FP8 kinds: ask for 3 resident blocks (<= 42 registers; faster than the
// compiler's own choice of 2). NVFP4 would spill there for no gain and f32 needs the registers;
// kGroupRows (per-row scales) would spill at 3, so it asks for 2.
template <int IN, int KIND, int GROUPED>
constexpr int tile_min_blocks() {
  return IN != 0 && (KIND == kTensor || KIND == kMx) ? (GROUPED == kGroupRows ? 2 : 3) : 1;
}
// What the tile kernel casts is what it loads, unless a Load functor maps each loaded chunk
// first (norm.cu's NormLoad: the LayerNorm output recomputed from x and the row statistics).
// `stage` fills the Load's shared memory for
// the tile at (r0, c0) (issued after the tile's own loads, so both are in flight together);
// `apply(shared, raw, tile_row, tile_col)` gets in-range chunks only (padding stays zero);
// `publish(scale)` runs once per launch (block 0, thread 0) with the tensor scale.
struct PlainLoad {
  struct Shared {};
  __device__ __forceinline__ void stage(Shared&, int64_t, int64_t, int64_t, int64_t, int) const {}
  template <int IN>
  __device__ __forceinline__ uint4 apply(const Shared&, uint4 raw, int, int) const {
    return raw;
  }
  __device__ __forceinline__ void publish(float) const {}
};

template <int IN, int KIND, int FMT, int GROUPED, bool PARTS = false, typename Load = PlainLoad>
__global__ void __launch_bounds__(kTileThreads, tile_min_blocks<IN, KIND, GROUPED>())
    cast_tile_kernel(const CastArgs a, const Load load = Load{}) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));           // elements per 16-byte chunk
  constexpr int CPR = kTileC / CH;                  // chunks per tile row (8 or 16)
  constexpr int PER = kTileR * CPR / kTileThreads;  // chunks per thread (2 or 4)
  constexpr int NW = kTileThreads / 32;             // warps (16)
  constexpr float FMAX = fmt_max<FMT>();
  static_assert(PER * kTileThreads == kTileR * CPR, "tile/threads mismatch");
  static_assert(NW * 4 == kTileC && kTileR == 8 * 16, "column-phase mapping");
  constexpr bool ROWS = GROUPED == kGroupRows, TILES = GROUPED == kGroupTiles;

  __shared__ __align__(16) T tile[kTileR][kTileC];
  __shared__ float red[NW];
  __shared__ float tpart[NW][8];  // NVFP4 2-D: per warp and row group, amax of its 4 columns
  __shared__ float rscale[ROWS ? kTileR : 1];
  __shared__ int rok[ROWS ? kTileR : 1];
  __shared__ float rmax[ROWS ? kTileR : 1];  // grouped fused amax: each row's max over the tile
  __shared__ int2 tinfo;                     // kGroupTiles: tile_info of the tile

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t R = a.R, C = a.C;
  uint32_t tr = blockIdx.x / a.tiles_c, tc = blockIdx.x - tr * a.tiles_c;
  if constexpr (ROWS) {  // block-uniform
    if (tr >= uint32_t(*a.rows_count)) return;
    tr = uint32_t(a.rows_list[tr]);
  }
  const int64_t r0 = int64_t(tr) * kTileR, c0 = int64_t(tc) * kTileC;
  // The tile's source: x (row stride C), or the part that holds its columns.
  const T* __restrict__ x = static_cast<const T*>(a.x);
  int64_t ld = C, xc0 = 0;
  if constexpr (PARTS) {
    const int part = int(c0 / a.part_cols);
    x = static_cast<const T*>(a.parts[part]);
    ld = a.part_cols;
    xc0 = int64_t(part) * a.part_cols;
  }

  // 1. load: all loads issued before any use; out-of-range chunks read as zeros.
  uint4 raw[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
    const int64_t gr = r0 + lr, gc = c0 + lc;
    raw[i] = (gr < R && gc < C) ? __ldg(reinterpret_cast<const uint4*>(x + gr * ld + (gc - xc0)))
                                : make_uint4(0u, 0u, 0u, 0u);
  }
  if constexpr (!std::is_same<Load, PlainLoad>::value) {
    __shared__ typename Load::Shared lsh;
    load.stage(lsh, r0, c0, R, C, t);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
      if (r0 + lr < R && c0 + lc < C) raw[i] = load.template apply<IN>(lsh, raw[i], lr, lc);
    }
  }
  if constexpr (TILES) {  // block-uniform
    const int2 ti = __ldg(&a.tile_info[tr]);
    if (ti.x == kTileNoGroup) cast_tile_zeros<KIND>(a, r0, c0, CH, CPR, PER);
    if (ti.x < 0) return;    // kTileRowScales: the kGroupRows launch's tile
    if (t == 0) tinfo = ti;  // read after the barrier: kept in registers, it made the tile spill
  }
  if constexpr (ROWS) {
    if (t < kTileR) {
      const int64_t gr = r0 + t;
      const int g = gr < R ? a.row_group[gr] : -1;
      rok[t] = g >= 0;
      rscale[t] = (KIND == kTensor && g >= 0) ? tensor_scale<FMT>(a, g) : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int id = i * kTileThreads + t, lr = id / CPR, ch = id % CPR;
    *reinterpret_cast<uint4*>(&tile[lr][(ch ^ ((lr >> 4) & 7)) * CH]) = raw[i];
  }
  if constexpr (ROWS) {
    // Fused per-group amax (amax_out[g], delayed scaling): each row's max over the tile (the
    // CPR lanes that share a row), then one atomic per run of same-group rows in each warp.
    if (a.amax_out) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        float v[CH];
        unpack16<IN>(raw[i], v);
        float m = amax_n<CH>(v);
#pragma unroll
        for (int o = 1; o < CPR; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
        if (t % CPR == 0) rmax[(i * kTileThreads + t) / CPR] = m;
      }
    }
  } else if (a.amax_out) {  // fused amax(x): the tile's max, one atomic per block (uniform branch)
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      float v[CH];
      unpack16<IN>(raw[i], v);
      m = fmaxf(m, amax_n<CH>(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    if (lane == 0) red[warp] = m;
  }
  __syncthreads();
  if constexpr (ROWS) {
    if (a.amax_out && t < kTileR) {  // warps 0..3: a segmented max-scan over their 32 rows
      const int64_t gr = r0 + t;
      const int g = gr < R ? a.row_group[gr] : -1;
      float m = rmax[t];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {  // groups are runs of rows: same group o back = same run
        const float mo = __shfl_up_sync(kFull, m, o);
        const int go = __shfl_up_sync(kFull, g, o);
        if (lane >= o && go == g) m = fmaxf(m, mo);
      }
      const int gn = __shfl_down_sync(kFull, g, 1);
      if (g >= 0 && (lane == 31 || gn != g)) atomic_max_nonneg(a.amax_out + g, m);
    }
  } else if (a.amax_out && t == 0) {
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) m = fmaxf(m, red[w]);
    atomic_max_nonneg(a.amax_out + (TILES ? tinfo.x : 0), m);
  }

  float scale = 1.0f, S_row = 1.0f, S_col = 1.0f;
  if constexpr (KIND == kTensor && GROUPED == kUngrouped) scale = tensor_scale<FMT>(a, 0);
  if constexpr (KIND == kTensor && TILES) scale = __int_as_float(tinfo.y);
  if (blockIdx.x == 0 && t == 0) load.publish(scale);
  if constexpr (KIND == kNv1 || KIND == kNv2) {
    S_row = nvfp4_tensor_scale(*a.amax_in);
    S_col = nvfp4_tensor_scale(*a.amax_col);
  }
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = sr ? a.sr_seed[0] : 0u, s1 = sr ? a.sr_seed[1] : 0u;

  // 2. column phase
  if (a.colwise || a.dbias_part != nullptr || KIND == kNv2) {
    const int g = lane & 7, c = warp * 4 + (lane >> 3);
    const int pc = (((c / CH) ^ g) * CH) + (c % CH);  // swizzled column of (16g + k, c)
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = In<IN>::f(tile[16 * g + k][pc]);
    const int64_t gc = c0 + c, gr = r0 + 16 * g;
    const bool active = gc < C && gr < R;

    if (a.dbias_part != nullptr) {
      // Rows beyond R were loaded as zeros, so they add nothing. Fixed order: deterministic.
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < 16; ++k) s += v[k];
      s += __shfl_xor_sync(kFull, s, 1);
      s += __shfl_xor_sync(kFull, s, 2);
      s += __shfl_xor_sync(kFull, s, 4);
      if (g == 0 && gc < C) a.dbias_part[int64_t(tr) * C + gc] = s;
    }

    float m2 = 0.0f;
    if constexpr (KIND == kNv2) {  // amax of each 16x16 sub-tile: 4 columns here, 4 warps wide
      m2 = amax_n<16>(v);
      m2 = fmaxf(m2, __shfl_xor_sync(kFull, m2, 8));
      m2 = fmaxf(m2, __shfl_xor_sync(kFull, m2, 16));
      if (lane < 8) tpart[warp][g] = m2;
      __syncthreads();
      const int w0 = (c >> 4) * 4;
      m2 = fmaxf(fmaxf(tpart[w0][g], tpart[w0 + 1][g]), fmaxf(tpart[w0 + 2][g], tpart[w0 + 3][g]));
    }

    if (a.colwise) {
      if constexpr (KIND == kTensor) {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2) {
          float sa = scale, sb = scale;
          if constexpr (ROWS) {
            sa = rscale[16 * g + k];
            sb = rscale[16 * g + k + 1];
          }
          uint32_t pr = enc_fp8x2<FMT>(__fmul_rn(v[k], sa), __fmul_rn(v[k + 1], sb));
          if constexpr (ROWS) {  // rows in no group are zero bytes
            if (!rok[16 * g + k]) pr &= 0xff00u;
            if (!rok[16 * g + k + 1]) pr &= 0x00ffu;
          }
          w[k >> 2] |= pr << ((k & 3) * 8);
        }
        if (active)
          *reinterpret_cast<uint4*>(a.q_col + gc * R + gr) = make_uint4(w[0], w[1], w[2], w[3]);
      } else if constexpr (KIND == kMx) {
        float m = amax_n<16>(v);
        m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));  // the other half of the 32-row block
        const uint8_t b = mx_scale_e8m0(m, FMAX);
        const float fb = mx_factor(b);
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; k += 2)
          w[k >> 2] |= enc_fp8x2<FMT>(mx_apply(v[k], b, fb), mx_apply(v[k + 1], b, fb))
                       << ((k & 3) * 8);
        if (active) {
          *reinterpret_cast<uint4*>(a.q_col + gc * R + gr) = make_uint4(w[0], w[1], w[2], w[3]);
          if ((g & 1) == 0) a.s_col[gc * (R / 32) + gr / 32] = b;
        }
      } else {  // NVFP4: this thread's 16 values are one block of the colwise copy
        if constexpr (KIND == kNv1) {
          if (a.rht) hadamard16_forward(v, a.rht_mask);
        }
        const float m = KIND == kNv1 ? amax_n<16>(v) : m2;
        const uint32_t sb = nvfp4_block_scale_code(m, S_col);
        const float f = nvfp4_encode_factor(sb, S_col);
        const uint64_t base = uint64_t(gc) * uint64_t(R) + uint64_t(gr);
        const uint32_t cs0 = s0 ^ kColwiseSeedXor;
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; ++k)
          w[k >> 3] |= enc_e2m1(nvfp4_scaled_value(v[k], f, sb, S_col), sr, base + k, cs0, s1)
                       << ((k & 7) * 4);
        if (active) {
          *reinterpret_cast<uint2*>(a.q_col + base / 2) = make_uint2(w[0], w[1]);
          a.s_col[gc * (R / 16) + gr / 16] = uint8_t(sb);
        }
      }
    }
  }

  // 3. rowwise phase (from registers)
  if (a.rowwise) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int id = i * kTileThreads + t, lr = id / CPR, lc = (id % CPR) * CH;
      const int64_t gr = r0 + lr, gc = c0 + lc;
      const bool valid = gr < R && gc < C;
      float v[CH];
      unpack16<IN>(raw[i], v);
      if constexpr (KIND == kTensor || KIND == kMx) {
        uint8_t b = 0;
        float sc = scale;
        if constexpr (KIND == kTensor && ROWS) sc = rscale[lr];
        if constexpr (KIND == kMx) {
          float m = amax_n<CH>(v);
#pragma unroll
          for (int o = 1; o < 32 / CH; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
          b = mx_scale_e8m0(m, FMAX);
        }
        const float fb = mx_factor(b);
        uint32_t w[CH / 4];
#pragma unroll
        for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
#pragma unroll
        for (int k = 0; k < CH; k += 2) {
          float ea, eb;
          if constexpr (KIND == kMx) {
            ea = mx_apply(v[k], b, fb);
            eb = mx_apply(v[k + 1], b, fb);
          } else {
            ea = __fmul_rn(v[k], sc);
            eb = __fmul_rn(v[k + 1], sc);
          }
          w[k >> 2] |= enc_fp8x2<FMT>(ea, eb) << ((k & 3) * 8);
        }
        if constexpr (ROWS) {
          if (!rok[lr]) {
#pragma unroll
            for (int k = 0; k < CH / 4; ++k) w[k] = 0u;
            b = kMxEmptyScale;
          }
        }
        if (valid) {
          uint8_t* q = a.q_row + gr * C + gc;
          if constexpr (CH == 8)
            *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
          else
            *reinterpret_cast<uint32_t*>(q) = w[0];
          if constexpr (KIND == kMx) {
            if ((lc & 31) == 0) a.s_row[gr * (C / 32) + gc / 32] = b;
          }
        }
      } else {  // NVFP4
        float m;
        if constexpr (KIND == kNv1) {
          m = amax_n<CH>(v);
#pragma unroll
          for (int o = 1; o < 16 / CH; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
        } else {
          const int w0 = (lc >> 4) * 4, gg = lr >> 4;
          m = fmaxf(fmaxf(tpart[w0][gg], tpart[w0 + 1][gg]),
                    fmaxf(tpart[w0 + 2][gg], tpart[w0 + 3][gg]));
        }
        const uint32_t sb = nvfp4_block_scale_code(m, S_row);
        const float f = nvfp4_encode_factor(sb, S_row);
        const uint64_t base = uint64_t(gr) * uint64_t(C) + uint64_t(gc);
        uint32_t w = 0u;
#pragma unroll
        for (int k = 0; k < CH; ++k)
          w |= enc_e2m1(nvfp4_scaled_value(v[k], f, sb, S_row), sr, base + k, s0, s1) << (k * 4);
        if (valid) {
          if constexpr (CH == 8)
            *reinterpret_cast<uint32_t*>(a.q_row + base / 2) = w;
          else
            *reinterpret_cast<uint16_t*>(a.q_row + base / 2) = uint16_t(w);
          if ((lc & 15) == 0) a.s_row[gr * (C / 16) + gc / 16] = uint8_t(sb);
        }
      }
    }
  }
}

// ---- generic kernels: any shape and alignment, one thread per block of the copy ----
// Used when the fast tile kernel's conditions (rows, cols multiples of 16, 16-byte aligned
// pointers) do not hold. Simple and strided; correctness over speed.

template <int KIND>
__host__ __device__ constexpr int generic_block() {
  return KIND == kTensor ? 1 : (KIND == kMx ? 32 : 16);
}

// Rowwise copy: unit = B consecutive elements of a row.
template <int IN, int KIND, int FMT, bool GROUPED>
__global__ void rowwise_generic_kernel(const CastArgs a) {
  using T = typename In<IN>::T;
  constexpr int B = generic_block<KIND>();
  constexpr float FMAX = fmt_max<FMT>();
  const T* x = static_cast<const T*>(a.x);
  const int64_t R = a.R, C = a.C, nb = C / B, units = R * nb;
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = sr ? a.sr_seed[0] : 0u, s1 = sr ? a.sr_seed[1] : 0u;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = u / nb, c = (u - r * nb) * B;
    float v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) v[j] = In<IN>::f(x[r * C + c + j]);
    int g = 0;
    if constexpr (GROUPED) g = a.row_group[r];
    if constexpr (KIND == kTensor) {
      const float sc = g >= 0 ? tensor_scale<FMT>(a, g) : 0.0f;
      a.q_row[r * C + c] = g >= 0 ? uint8_t(enc_fp8<FMT>(__fmul_rn(v[0], sc))) : uint8_t(0);
    } else if constexpr (KIND == kMx) {
      const uint8_t b = g >= 0 ? mx_scale_e8m0(amax_n<B>(v), FMAX) : kMxEmptyScale;
#pragma unroll
      for (int j = 0; j < B; ++j)
        a.q_row[r * C + c + j] =
            g >= 0 ? uint8_t(enc_fp8<FMT>(apply_e8m0_encode(v[j], b))) : uint8_t(0);
      a.s_row[r * nb + c / B] = b;
    } else {
      const float S = nvfp4_tensor_scale(*a.amax_in);
      float m = 0.0f;
      if constexpr (KIND == kNv1) {
        m = amax_n<B>(v);
      } else {  // the 16x16 tile holding this block
        const int64_t rt = r - r % 16;
        for (int64_t rr = rt; rr < rt + 16; ++rr)
          for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(In<IN>::f(x[rr * C + c + j])));
      }
      const uint32_t sb = nvfp4_block_scale_code(m, S);
      const float f = nvfp4_encode_factor(sb, S);
      const uint64_t base = uint64_t(r) * uint64_t(C) + uint64_t(c);
#pragma unroll
      for (int j = 0; j < B; j += 2) {
        const uint32_t lo = enc_e2m1(nvfp4_scaled_value(v[j], f, sb, S), sr, base + j, s0, s1);
        const uint32_t hi =
            enc_e2m1(nvfp4_scaled_value(v[j + 1], f, sb, S), sr, base + j + 1, s0, s1);
        a.q_row[(base + j) / 2] = uint8_t(lo | (hi << 4));
      }
      a.s_row[r * nb + c / B] = uint8_t(sb);
    }
  }
}

// Colwise copy (C, R): unit = B consecutive rows of one column; consecutive threads take
// consecutive units of the output, so the writes are the coalesced side.
template <int IN, int KIND, int FMT, bool GROUPED>
__global__ void colwise_generic_kernel(const CastArgs a) {
  using T = typename In<IN>::T;
  constexpr int B = generic_block<KIND>();
  constexpr float FMAX = fmt_max<FMT>();
  const T* x = static_cast<const T*>(a.x);
  const int64_t R = a.R, C = a.C, nb = R / B, units = C * nb;
  const bool sr = a.sr_seed != nullptr;
  const uint32_t s0 = (sr ? a.sr_seed[0] : 0u) ^ kColwiseSeedXor, s1 = sr ? a.sr_seed[1] : 0u;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = u / nb, r = (u - c * nb) * B;
    float v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) v[j] = In<IN>::f(x[(r + j) * C + c]);
    if constexpr (KIND == kTensor) {
      int g = 0;
      if constexpr (GROUPED) g = a.row_group[r];
      const float sc = g >= 0 ? tensor_scale<FMT>(a, g) : 0.0f;
      a.q_col[c * R + r] = g >= 0 ? uint8_t(enc_fp8<FMT>(__fmul_rn(v[0], sc))) : uint8_t(0);
    } else if constexpr (KIND == kMx) {
      const uint8_t b = mx_scale_e8m0(amax_n<B>(v), FMAX);
#pragma unroll
      for (int j = 0; j < B; ++j)
        a.q_col[c * R + r + j] = uint8_t(enc_fp8<FMT>(apply_e8m0_encode(v[j], b)));
      a.s_col[c * nb + r / B] = b;
    } else {
      const float S = nvfp4_tensor_scale(*a.amax_col);
      float m = 0.0f;
      if constexpr (KIND == kNv1) {
        if (a.rht) hadamard16_forward(v, a.rht_mask);
        m = amax_n<B>(v);
      } else {
        const int64_t ct = c - c % 16;
        for (int j = 0; j < 16; ++j)
          for (int64_t cc = ct; cc < ct + 16; ++cc)
            m = fmaxf(m, fabsf(In<IN>::f(x[(r + j) * C + cc])));
      }
      const uint32_t sb = nvfp4_block_scale_code(m, S);
      const float f = nvfp4_encode_factor(sb, S);
      const uint64_t base = uint64_t(c) * uint64_t(R) + uint64_t(r);
#pragma unroll
      for (int j = 0; j < B; j += 2) {
        const uint32_t lo = enc_e2m1(nvfp4_scaled_value(v[j], f, sb, S), sr, base + j, s0, s1);
        const uint32_t hi =
            enc_e2m1(nvfp4_scaled_value(v[j + 1], f, sb, S), sr, base + j + 1, s0, s1);
        a.q_col[(base + j) / 2] = uint8_t(lo | (hi << 4));
      }
      a.s_col[c * nb + r / B] = uint8_t(sb);
    }
  }
}

// ---- amax(x): grid-stride, 16-byte loads four deep, one atomic per block ----
template <int IN>
__global__ void __launch_bounds__(256)
    amax_kernel(const void* xv, int64_t n, bool vec, float* out) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));
  __shared__ float red[8];
  const T* x = static_cast<const T*>(xv);
  const int64_t nv = vec ? n / CH : 0;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4* xv4 = reinterpret_cast<const uint4*>(x);
  float m = 0.0f;
  int64_t i = tid;
  for (; i + 3 * stride < nv; i += 4 * stride) {
    uint4 r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = __ldg(xv4 + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float v[CH];
      unpack16<IN>(r[k], v);
      m = fmaxf(m, amax_n<CH>(v));
    }
  }
  for (; i < nv; i += stride) {
    float v[CH];
    unpack16<IN>(__ldg(xv4 + i), v);
    m = fmaxf(m, amax_n<CH>(v));
  }
  for (int64_t j = nv * CH + tid; j < n; j += stride) m = fmaxf(m, fabsf(In<IN>::f(x[j])));
  block_amax_to(m, red, out);
}

// ---- FP8 block scaling (1x128 / 128x128): shared pieces of the block cast kernels ----

// One warp quantizes one 1x128 block: element e (e < n) is read(e), lane l holding elements l,
// l+32, l+64, l+96 (read gives zero past n). Each encoded byte goes out through store(e, byte);
// returns the block's decode scale 1/s.
template <int FMT, typename Read, typename Store>
__device__ __forceinline__ float warp_block_encode_read(Read read, int n, float eps, bool pow2,
                                                        Store store) {
  const int lane = threadIdx.x & 31;
  float v[4], bm = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] = read(lane + 32 * k);
    bm = fmaxf(bm, fabsf(v[k]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, o));
  const float s = fp8_block_scale(bm, fmt_max<FMT>(), eps, pow2);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = lane + 32 * k;
    if (e < n) store(e, uint8_t(enc_fp8<FMT>(__fmul_rn(v[k], s))));
  }
  return 1.0f / s;
}

// The same over a float32 shared-memory tile: element e at tile[e * stride].
template <int FMT, typename Store>
__device__ __forceinline__ float warp_block_encode(const float* tile, int stride, int n, float eps,
                                                   bool pow2, Store store) {
  return warp_block_encode_read<FMT>([&](int e) { return tile[e * stride]; }, n, eps, pow2, store);
}

// 1x128 rowwise scales of a tile held in registers as PER 16-byte chunks per lane, a tile row
// being CPR consecutive lanes of one chunk index (cm: the chunks' amaxes). Lane L computes the
// scale of its chunk mine = (L % CPR) / (CPR / PER) (one division per lane, not PER); the others
// fetch chunk i's with __shfl_sync(kFull, s, (L & ~(CPR - 1)) + i * (CPR / PER)).
template <int CPR, int PER>
__device__ __forceinline__ float row_block_scale(const float (&cm)[PER], float fmax, float eps,
                                                 bool pow2, int* mine) {
  constexpr int LPS = CPR / PER;  // lanes per row scale
  static_assert(LPS >= 1 && LPS * PER == CPR && CPR <= 32, "row mapping");
  const int lane = threadIdx.x & 31;
  *mine = (lane % CPR) / LPS;
  float bm = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    float b = cm[i];
#pragma unroll
    for (int o = 1; o < CPR; o <<= 1) b = fmaxf(b, __shfl_xor_sync(kFull, b, o));
    if (i == *mine) bm = b;
  }
  return fp8_block_scale(bm, fmax, eps, pow2);
}

// Fills n floats with v (scale padding of the block layouts); static: one copy per unit.
static __global__ void __launch_bounds__(256) fill_f32_kernel(float* p, int64_t n, float v) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

}  // namespace cuda
}  // namespace lowbit
