// CUDA quantize (+ fused dbias): docs/numerics.md. Stream-ordered, no host synchronisation, no
// allocation; scratch comes from p.workspace (quantize_workspace_bytes).
//
// Launch sequence:
//   memset amax (and the colwise RHT amax) -> [amax pass when the scale needs it first:
//   current scaling, NVFP4] -> finalize (scale_inv / global_scale_inv; zeroes the amax instead
//   of the memset when no amax pass runs) -> fused cast -> [dbias reduce]. The fused cast
//   (cast_kernels.cuh, cast_tile_kernel) reads x once and writes both copies; modes that do not
//   need the amax up front (delayed, MXFP8) fold the amax into it. FP8 block scaling (1x128 /
//   128x128): memset amax -> block cast (fp8_block_cast_kernel, both copies and amax(x) from one
//   read) -> [dbias]; shapes the fast kernel cannot take: memset amax -> amax -> fill scale
//   padding -> fp8_block_cast_generic_kernel -> [dbias].
#include "block_cast.cuh"
#include "cast_kernels.cuh"

namespace lowbit {
namespace cuda {
namespace {

// Workspace layout (bytes): [0, 256) scalars, [256, ...) dbias per-tile column sums.
constexpr size_t kScalarBytes = 256;
// What the fast kernels need of inputs given in parts (the generic ones read x whole).
constexpr const char* kPartsShapes =
    "quantize: inputs in parts need rows a multiple of 16, each part's columns a multiple of 64 "
    "and 16-byte aligned buffers";
constexpr int kWsAmaxCol = 0;  // float index: amax of the Hadamard-transformed colwise copy

// amax(x) and the amax of the colwise copy after the 16-point Hadamard transform, which runs
// along rows: thread = (16-row block, VEC adjacent columns); consecutive threads take consecutive
// columns, so each of the 16 row reads is coalesced across the warp (16-byte loads when VEC > 1).
template <int IN, int VEC>
__global__ void __launch_bounds__(256)
    amax_rht_kernel(const void* xv, int64_t R, int64_t C, uint32_t mask, float* amax_x,
                    float* amax_t) {
  using T = typename In<IN>::T;
  __shared__ float red_x[8], red_t[8];
  const T* x = static_cast<const T*>(xv);
  const int64_t cv = C / VEC, units = (R / 16) * cv;
  float mx = 0.0f, mt = 0.0f;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t rb = u / cv, c = (u - rb * cv) * VEC;
    if constexpr (VEC == 1) {
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = In<IN>::f(x[(rb * 16 + j) * C + c]);
      mx = fmaxf(mx, amax_n<16>(v));
      hadamard16_forward(v, mask);
      mt = fmaxf(mt, amax_n<16>(v));
    } else {
      uint4 raw[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        raw[j] = __ldg(reinterpret_cast<const uint4*>(x + (rb * 16 + j) * C + c));
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float v[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = chunk_elem<IN>(raw[j], k);
        mx = fmaxf(mx, amax_n<16>(v));
        hadamard16_forward(v, mask);
        mt = fmaxf(mt, amax_n<16>(v));
      }
    }
  }
  block_amax_to(mx, red_x, amax_x);
  block_amax_to(mt, red_t, amax_t);
}

struct FinalArgs {
  ScalingMode mode;
  float fmax;
  const float* delayed;
  const float* amax;
  const float* amax_col;
  float* si_row;
  float* si_col;
  float* gsi;
  float* zero;  // an amax the cast accumulates into, zeroed here instead of by a memset
};

// Tensor scale_inv outputs and NVFP4 tensor decode scales, from the same inputs the cast uses.
__global__ void finalize_kernel(const FinalArgs f) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (f.zero) *f.zero = 0.0f;
  if (f.mode == ScalingMode::kDelayedTensor || f.mode == ScalingMode::kCurrentTensor) {
    const float s = f.delayed ? *f.delayed : scale_from_amax(*f.amax, f.fmax);
    const float inv = 1.0f / s;
    if (f.si_row) *f.si_row = inv;
    if (f.si_col) *f.si_col = inv;
  } else if (f.mode == ScalingMode::kNvfp4_1d || f.mode == ScalingMode::kNvfp4_2d) {
    f.gsi[0] = 1.0f / nvfp4_tensor_scale(*f.amax);
    f.gsi[1] = 1.0f / nvfp4_tensor_scale(*f.amax_col);
  }
}

// NO_SCALING keeps x's dtype. The CPU kernel round-trips every element through float32
// (quieting bf16 NaNs, canonicalising f16 NaNs); do the same so the bits agree.
template <int IN>
__device__ __forceinline__ uint32_t roundtrip(typename In<IN>::T v) {
  if constexpr (IN == 0)
    return __float_as_uint(v);
  else if constexpr (IN == 1)
    return float_to_bf16(bf16_to_float(v));
  else
    return float_to_f16(f16_to_float(v));
}

template <int IN>
__global__ void noscale_copy_kernel(const void* xv, void* outv, int64_t n) {
  using T = typename In<IN>::T;
  const T* x = static_cast<const T*>(xv);
  T* out = static_cast<T*>(outv);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t b = roundtrip<IN>(x[i]);
    if constexpr (IN == 0)
      out[i] = __uint_as_float(b);
    else
      out[i] = uint16_t(b);
  }
}

// (R, C) -> (C, R) through a padded 32x33 shared tile: coalesced on both sides.
template <int IN>
__global__ void __launch_bounds__(256)
    noscale_transpose_kernel(const void* xv, void* outv, int64_t R, int64_t C) {
  using T = typename In<IN>::T;
  __shared__ T tile[32][33];
  const T* x = static_cast<const T*>(xv);
  T* out = static_cast<T*>(outv);
  const int64_t tiles_c = (C + 31) / 32;
  const int64_t tr = int64_t(blockIdx.x) / tiles_c, tc = int64_t(blockIdx.x) - tr * tiles_c;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int k = ty; k < 32; k += 8) {
    const int64_t r = tr * 32 + k, c = tc * 32 + tx;
    if (r < R && c < C) tile[k][tx] = x[r * C + c];
  }
  __syncthreads();
  for (int k = ty; k < 32; k += 8) {
    const int64_t c = tc * 32 + k, r = tr * 32 + tx;
    if (r < R && c < C) {
      const uint32_t b = roundtrip<IN>(tile[tx][k]);
      if constexpr (IN == 0)
        out[c * R + r] = __uint_as_float(b);
      else
        out[c * R + r] = uint16_t(b);
    }
  }
}

// dbias = column sums of x (generic path; also R == 0 gives zeros), in a fixed order. A block
// takes kDbiasCols columns, a lane two of them (32 apart: each warp load is one contiguous row
// run); the block's warps take interleaved rows, kDbiasUnroll loads in flight per column, and
// their partial sums add in warp order in shared memory. One thread per column over all rows was
// latency-bound: 3.75 ms for 8192 x 16384 bf16 on the H200 (the block recipe's dgelu dbias).
constexpr int kDbiasWarps = 8, kDbiasCols = 64, kDbiasUnroll = 8;

template <int IN>
__global__ void __launch_bounds__(32 * kDbiasWarps)
    dbias_generic_kernel(const void* xv, int64_t R, int64_t C, void* out) {
  using T = typename In<IN>::T;
  const T* x = static_cast<const T*>(xv);
  __shared__ float part[kDbiasWarps][kDbiasCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t c0 = int64_t(blockIdx.x) * kDbiasCols; c0 < C;
       c0 += int64_t(gridDim.x) * kDbiasCols) {
    float acc[2] = {0.0f, 0.0f};
    for (int h = 0; h < 2; ++h) {
      const int64_t c = c0 + h * 32 + lane;
      if (c >= C) continue;
      int64_t r = warp;
      for (; r + (kDbiasUnroll - 1) * kDbiasWarps < R; r += kDbiasUnroll * kDbiasWarps) {
        float v[kDbiasUnroll];
#pragma unroll
        for (int u = 0; u < kDbiasUnroll; ++u) v[u] = In<IN>::f(x[(r + u * kDbiasWarps) * C + c]);
#pragma unroll
        for (int u = 0; u < kDbiasUnroll; ++u) acc[h] += v[u];
      }
      for (; r < R; r += kDbiasWarps) acc[h] += In<IN>::f(x[r * C + c]);
    }
    part[warp][lane] = acc[0];
    part[warp][32 + lane] = acc[1];
    __syncthreads();
    if (threadIdx.x < kDbiasCols && c0 + threadIdx.x < C) {
      float s = 0.0f;
      for (int w = 0; w < kDbiasWarps; ++w) s += part[w][threadIdx.x];
      store_out<IN>(out, c0 + threadIdx.x, s);
    }
    __syncthreads();
  }
}

template <int IN>
Status launch_dbias(const QuantizeParams& p, cudaStream_t st) {
  const int64_t blocks = (p.cols + kDbiasCols - 1) / kDbiasCols;
  dbias_generic_kernel<IN><<<unsigned(std::min<int64_t>(blocks, 65535)), 32 * kDbiasWarps, 0, st>>>(
      p.x, p.rows, p.cols, p.dbias);
  return launch_status("dbias_generic_kernel");
}

// dbias from the fused cast's per-tile column sums: fixed order, so deterministic.
template <int IN>
__global__ void dbias_reduce_kernel(const float* part, int64_t tiles_r, int64_t C, void* out) {
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < C;
       c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t t = 0; t < tiles_r; ++t) s += part[t * C + c];
    store_out<IN>(out, c, s);
  }
}

template <int IN>
Status launch_amax(const QuantizeParams& p, float* out, cudaStream_t st) {
  const int64_t n = p.rows * p.cols;
  if (n == 0) return Status::Ok();
  if (p.n_parts) {  // each part into the same amax
    const int64_t np = p.rows * p.part_cols;
    for (int i = 0; i < p.n_parts; ++i) {
      const void* xi = p.x_parts[i];
      amax_kernel<IN><<<grid_for(np / 8 + 1, 256, 2048), 256, 0, st>>>(xi, np, aligned16(xi), out);
      if (auto s = launch_status("amax_kernel"); !s.ok()) return s;
    }
    return Status::Ok();
  }
  amax_kernel<IN><<<grid_for(n / 8 + 1, 256, 2048), 256, 0, st>>>(p.x, n, aligned16(p.x), out);
  return launch_status("amax_kernel");
}

template <int IN>
Status run_noscale(const QuantizeParams& p, cudaStream_t st) {
  const int64_t R = p.rows, C = p.cols, n = R * C;
  if (auto s = api_status(cudaMemsetAsync(p.amax, 0, sizeof(float), st), "memset amax"); !s.ok())
    return s;
  if (auto s = launch_amax<IN>(p, p.amax, st); !s.ok()) return s;
  if (n > 0 && p.rowwise) {
    noscale_copy_kernel<IN><<<grid_for(n, 256, 8192), 256, 0, st>>>(p.x, p.data, n);
    if (auto s = launch_status("noscale_copy_kernel"); !s.ok()) return s;
  }
  if (n > 0 && p.colwise) {
    const int64_t tiles = ((R + 31) / 32) * ((C + 31) / 32);
    if (tiles > INT32_MAX) return Status::Invalid("quantize: tensor too large");
    noscale_transpose_kernel<IN><<<unsigned(tiles), 256, 0, st>>>(p.x, p.colwise_data, R, C);
    if (auto s = launch_status("noscale_transpose_kernel"); !s.ok()) return s;
  }
  if (p.dbias && C > 0) {
    if (auto s = launch_dbias<IN>(p, st); !s.ok()) return s;
  }
  return Status::Ok();
}

// The fast tile kernel needs whole 16-element chunks and 16-byte aligned rows.
bool fast_path(const QuantizeParams& p) {
  bool x_ok = aligned16(p.x);
  if (p.n_parts) {  // every part aligned, and each part whole tiles
    x_ok = p.part_cols % kTileC == 0;
    for (int i = 0; i < p.n_parts; ++i) x_ok = x_ok && aligned16(p.x_parts[i]);
  }
  return tile_cast_fits(p.rows, p.cols, x_ok, p.rowwise ? p.data : nullptr,
                        p.colwise ? p.colwise_data : nullptr);
}

template <int IN, int KIND, int FMT>
Status run_cast(const QuantizeParams& p, cudaStream_t st) {
  const int64_t R = p.rows, C = p.cols, n = R * C;
  float* ws = static_cast<float*>(p.workspace);
  const bool nv = KIND == kNv1 || KIND == kNv2;
  const bool rht_amax = KIND == kNv1 && p.rht && p.colwise && n > 0;
  const bool fast = n > 0 && fast_path(p);
  const bool dbias_fast = fast && p.dbias != nullptr;
  if ((rht_amax || dbias_fast) && ws == nullptr)
    return Status::Invalid("quantize: workspace missing");
  if (p.n_parts && n > 0 && !fast) return Status::Invalid(kPartsShapes);
  if (n > 0 && ((p.rowwise && p.data == nullptr) || (p.colwise && p.colwise_data == nullptr)))
    return Status::Invalid("quantize: output missing");
  // The amax is needed before the cast for current scaling and NVFP4; otherwise the fast cast
  // computes it on the way (one read of x fewer).
  const bool amax_first = nv || p.mode == ScalingMode::kCurrentTensor || !fast;

  // Without an amax pass (delayed scaling's fast cast computes the amax on the way), finalize
  // zeroes the amax: a memset and its ~4 us launch bubble fewer per quantize.
  const bool zero_in_finalize = !amax_first && !rht_amax;
  if (!zero_in_finalize) {
    if (auto s = api_status(cudaMemsetAsync(p.amax, 0, sizeof(float), st), "memset amax"); !s.ok())
      return s;
  }
  float* amax_col = p.amax;
  if (rht_amax) {
    amax_col = ws + kWsAmaxCol;
    if (auto s = api_status(cudaMemsetAsync(amax_col, 0, sizeof(float), st), "memset amax");
        !s.ok())
      return s;
    constexpr int VEC = 16 / int(sizeof(typename In<IN>::T));
    if (C % VEC == 0 && aligned16(p.x))
      amax_rht_kernel<IN, VEC><<<grid_for((R / 16) * (C / VEC), 256, 2048), 256, 0, st>>>(
          p.x, R, C, p.rht_sign_mask, p.amax, amax_col);
    else
      amax_rht_kernel<IN, 1><<<grid_for((R / 16) * C, 256, 2048), 256, 0, st>>>(
          p.x, R, C, p.rht_sign_mask, p.amax, amax_col);
    if (auto s = launch_status("amax_rht_kernel"); !s.ok()) return s;
  } else if (amax_first) {
    if (auto s = launch_amax<IN>(p, p.amax, st); !s.ok()) return s;
  }

  FinalArgs f{p.mode,
              fmt_max<FMT>(),
              p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr,
              p.amax,
              amax_col,
              p.rowwise && KIND == kTensor ? static_cast<float*>(p.scale_inv) : nullptr,
              p.colwise && KIND == kTensor ? static_cast<float*>(p.colwise_scale_inv) : nullptr,
              p.global_scale_inv,
              zero_in_finalize ? p.amax : nullptr};
  finalize_kernel<<<1, 32, 0, st>>>(f);
  if (auto s = launch_status("finalize_kernel"); !s.ok()) return s;

  if (n > 0) {
    CastArgs a;
    a.x = p.x;
    a.R = R;
    a.C = C;
    for (int i = 0; i < p.n_parts; ++i) a.parts[i] = p.x_parts[i];
    a.part_cols = p.part_cols;
    a.rowwise = p.rowwise;
    a.colwise = p.colwise;
    a.q_row = static_cast<uint8_t*>(p.data);
    a.s_row = static_cast<uint8_t*>(p.scale_inv);
    a.q_col = static_cast<uint8_t*>(p.colwise_data);
    a.s_col = static_cast<uint8_t*>(p.colwise_scale_inv);
    a.delayed = p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr;
    a.amax_in = p.amax;
    a.amax_col = amax_col;
    a.sr_seed = nv ? p.sr_seed : nullptr;
    a.rht = KIND == kNv1 && p.rht;
    a.rht_mask = p.rht_sign_mask & 0xFFFFu;
    if (fast) {
      int64_t tiles = 0;
      if (!set_tiles(a, &tiles)) return Status::Invalid("quantize: tensor too large");
      const int64_t tiles_r = (R + kTileR - 1) / kTileR;
      a.amax_out = amax_first ? nullptr : p.amax;
      a.dbias_part = dbias_fast
                         ? reinterpret_cast<float*>(static_cast<char*>(p.workspace) + kScalarBytes)
                         : nullptr;
      if constexpr (KIND == kTensor) {
        if (p.n_parts)
          cast_tile_kernel<IN, KIND, FMT, false, true><<<unsigned(tiles), kTileThreads, 0, st>>>(a);
        else
          cast_tile_kernel<IN, KIND, FMT, false><<<unsigned(tiles), kTileThreads, 0, st>>>(a);
      } else {
        cast_tile_kernel<IN, KIND, FMT, false><<<unsigned(tiles), kTileThreads, 0, st>>>(a);
      }
      if (auto s = launch_status("cast_tile_kernel"); !s.ok()) return s;
      if (dbias_fast) {
        dbias_reduce_kernel<IN>
            <<<grid_for(C, 256), 256, 0, st>>>(a.dbias_part, tiles_r, C, p.dbias);
        if (auto s = launch_status("dbias_reduce_kernel"); !s.ok()) return s;
      }
      return Status::Ok();
    }
    constexpr int B = generic_block<KIND>();
    if (p.rowwise) {
      rowwise_generic_kernel<IN, KIND, FMT, false><<<grid_for(n / B, 256, 8192), 256, 0, st>>>(a);
      if (auto s = launch_status("rowwise_generic_kernel"); !s.ok()) return s;
    }
    if (p.colwise) {
      colwise_generic_kernel<IN, KIND, FMT, false><<<grid_for(n / B, 256, 8192), 256, 0, st>>>(a);
      if (auto s = launch_status("colwise_generic_kernel"); !s.ok()) return s;
    }
  }
  if (p.dbias && C > 0) {  // generic path, or R == 0 (zeros)
    if (auto s = launch_dbias<IN>(p, st); !s.ok()) return s;
  }
  return Status::Ok();
}

// FP8 block scaling: the fast kernel and its notes are in block_cast.cuh.
//
// Any shape and alignment (the fast kernel's conditions do not hold): the tile staged in shared
// memory as float32 (one read of x), the rowwise copy written row by row and the colwise copy
// column by column, one byte per store. 1-D: a warp takes a 128-element row (or column) of the
// tile, 4 values per lane, and reduces its amax with shuffles; 2-D: one amax and scale for the
// whole tile. Partial tiles at the edges are padded with zeros in shared memory and never stored.
constexpr int kBlkLd = kBlk + 1, kBlkGenericThreads = 256;
constexpr size_t kBlkSmem = size_t(kBlk) * kBlkLd * sizeof(float);

template <int IN, int FMT, bool TWO_D>
__global__ void __launch_bounds__(kBlkGenericThreads)
    fp8_block_cast_generic_kernel(const BlockCastArgs a) {
  using T = typename In<IN>::T;
  extern __shared__ float ftile[];  // [kBlk][kBlkLd]
  __shared__ float red[kBlkGenericThreads / 32];
  const T* x = static_cast<const T*>(a.x);
  const int64_t tr = int64_t(blockIdx.x) / a.tiles_c, tc = int64_t(blockIdx.x) - tr * a.tiles_c;
  const int64_t r0 = tr * kBlk, c0 = tc * kBlk;
  const int nr = int(a.R - r0 < kBlk ? a.R - r0 : kBlk),
            nc = int(a.C - c0 < kBlk ? a.C - c0 : kBlk);
  const float fmax = fmt_max<FMT>();
  float m = 0.0f;
  for (int i = threadIdx.x; i < kBlk * kBlk; i += kBlkGenericThreads) {
    const int rr = i / kBlk, cc = i - rr * kBlk;
    const float v = (rr < nr && cc < nc) ? In<IN>::f(x[(r0 + rr) * a.C + c0 + cc]) : 0.0f;
    ftile[rr * kBlkLd + cc] = v;
    m = fmaxf(m, fabsf(v));
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (TWO_D) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kBlkGenericThreads / 32; ++w) t = fmaxf(t, red[w]);
    const float s = fp8_block_scale(t, fmax, a.eps, a.pow2);
    if (threadIdx.x == 0) {
      const float inv = 1.0f / s;
      const int64_t tiles_r = (a.R + kBlk - 1) / kBlk;
      if (a.s_row) a.s_row[tr * round_up4(a.tiles_c) + tc] = inv;
      if (a.s_col) a.s_col[tc * round_up4(tiles_r) + tr] = inv;
    }
    if (a.q_row)
      for (int i = threadIdx.x; i < kBlk * kBlk; i += kBlkGenericThreads) {
        const int rr = i / kBlk, cc = i - rr * kBlk;
        if (rr < nr && cc < nc)
          a.q_row[(r0 + rr) * a.C + c0 + cc] =
              uint8_t(enc_fp8<FMT>(__fmul_rn(ftile[rr * kBlkLd + cc], s)));
      }
    if (a.q_col)
      for (int i = threadIdx.x; i < kBlk * kBlk; i += kBlkGenericThreads) {
        const int cc = i / kBlk, rr = i - cc * kBlk;
        if (rr < nr && cc < nc)
          a.q_col[(c0 + cc) * a.R + r0 + rr] =
              uint8_t(enc_fp8<FMT>(__fmul_rn(ftile[rr * kBlkLd + cc], s)));
      }
  } else {
    if (a.q_row)
      for (int rr = warp; rr < nr; rr += kBlkGenericThreads / 32) {
        uint8_t* q = a.q_row + (r0 + rr) * a.C + c0;
        const float d = warp_block_encode<FMT>(ftile + rr * kBlkLd, 1, nc, a.eps, a.pow2,
                                               [&](int cc, uint8_t byte) { q[cc] = byte; });
        if (lane == 0) a.s_row[tc * round_up4(a.R) + r0 + rr] = d;
      }
    if (a.q_col)
      for (int cc = warp; cc < nc; cc += kBlkGenericThreads / 32) {
        uint8_t* q = a.q_col + (c0 + cc) * a.R + r0;
        const float d = warp_block_encode<FMT>(ftile + cc, kBlkLd, nr, a.eps, a.pow2,
                                               [&](int rr, uint8_t byte) { q[rr] = byte; });
        if (lane == 0) a.s_col[tr * round_up4(a.C) + c0 + cc] = d;
      }
  }
}

// Padding entries of a block-scale array hold 1.0 (the cast writes every real entry after).
Status fill_scales(float* s, ScalingMode m, int64_t rows, int64_t cols, cudaStream_t st) {
  const int64_t n = fp8_block_scale_rows(m, rows, cols) * fp8_block_scale_cols(m, rows, cols);
  if (!s || n == 0) return Status::Ok();
  fill_f32_kernel<<<grid_for(n, 256), 256, 0, st>>>(s, n, 1.0f);
  return launch_status("fill_f32_kernel");
}

template <int IN>
PartsBlockLoad<IN> parts_load(const QuantizeParams& p) {
  return PartsBlockLoad<IN>{p.x_parts[0], p.x_parts[1], p.n_parts > 2 ? p.x_parts[2] : nullptr,
                            p.part_cols};
}

template <int IN, int FMT>
Status run_fp8_block(const QuantizeParams& p, cudaStream_t st) {
  const int64_t R = p.rows, C = p.cols, n = R * C;
  // Fast kernel: amax(x) folded in, scale padding written by the kernel (1D has none there: rows
  // and cols are multiples of 16). Otherwise: amax pass, padding fill, generic kernel.
  const bool fast = n > 0 && fast_path(p);
  const bool dbias_fused = fast && p.dbias != nullptr && C > 0;
  if (p.n_parts && n > 0 && !fast) return Status::Invalid(kPartsShapes);
  if (dbias_fused && p.workspace == nullptr) return Status::Invalid("quantize: workspace missing");
  if (auto s = api_status(cudaMemsetAsync(p.amax, 0, sizeof(float), st), "memset amax"); !s.ok())
    return s;
  if (!fast) {
    if (auto s = launch_amax<IN>(p, p.amax, st); !s.ok()) return s;
    if (p.rowwise)
      if (auto s = fill_scales(static_cast<float*>(p.scale_inv), p.mode, R, C, st); !s.ok())
        return s;
    if (p.colwise)
      if (auto s = fill_scales(static_cast<float*>(p.colwise_scale_inv), p.mode, C, R, st); !s.ok())
        return s;
  }
  if (n > 0) {
    BlockCastArgs a;
    a.x = p.x;
    a.R = R;
    a.C = C;
    a.q_row = p.rowwise ? static_cast<uint8_t*>(p.data) : nullptr;
    a.s_row = p.rowwise ? static_cast<float*>(p.scale_inv) : nullptr;
    a.q_col = p.colwise ? static_cast<uint8_t*>(p.colwise_data) : nullptr;
    a.s_col = p.colwise ? static_cast<float*>(p.colwise_scale_inv) : nullptr;
    a.eps = p.amax_epsilon;
    a.pow2 = p.power_2_scale;
    a.tiles_c = (C + kBlk - 1) / kBlk;
    a.amax_out = fast ? p.amax : nullptr;
    const bool two_d = p.mode == ScalingMode::kBlock2d;
    if (fast) {
      // One pass over x (whole or in parts): both copies, amax(x) and, with a dbias, the column
      // sums per 128-row tile, then a reduce over the tiles (a separate column-sum kernel re-read
      // x with one block per 64 columns: 0.55 ms of the block layer's step on the H200).
      auto cast = [&](const auto& load) {
        if (!dbias_fused) return launch_fp8_block_cast<IN, FMT>(a, two_d, load, st);
        a.dbias_part = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + kScalarBytes);
        const Status s = launch_fp8_block_cast<IN, FMT, true>(a, two_d, load, st);
        return s.ok() ? launch_dbias_reduce<IN>(a.dbias_part, R, C, p.dbias, st) : s;
      };
      return p.n_parts ? cast(parts_load<IN>(p)) : cast(PlainBlockLoad{});
    }
    const int64_t tiles = ((R + kBlk - 1) / kBlk) * a.tiles_c;
    if (tiles > INT32_MAX) return Status::Invalid("quantize: tensor too large");
    auto kernel = two_d ? fp8_block_cast_generic_kernel<IN, FMT, true>
                        : fp8_block_cast_generic_kernel<IN, FMT, false>;
    if (auto s = api_status(cudaFuncSetAttribute(
                                kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBlkSmem)),
                            "cudaFuncSetAttribute");
        !s.ok())
      return s;
    kernel<<<unsigned(tiles), kBlkGenericThreads, kBlkSmem, st>>>(a);
    if (auto s = launch_status("fp8_block_cast_generic_kernel"); !s.ok()) return s;
  }
  if (p.dbias && C > 0) {
    if (auto s = launch_dbias<IN>(p, st); !s.ok()) return s;
  }
  return Status::Ok();
}

template <int IN>
Status dispatch_mode(const QuantizeParams& p, cudaStream_t st) {
  const bool e5 = p.q_dtype == DType::kE5M2;
  switch (p.mode) {
    case ScalingMode::kNoScaling: return run_noscale<IN>(p, st);
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      return e5 ? run_cast<IN, kTensor, kFmtE5M2>(p, st) : run_cast<IN, kTensor, kFmtE4M3>(p, st);
    case ScalingMode::kMxfp8_1d:
      return e5 ? run_cast<IN, kMx, kFmtE5M2>(p, st) : run_cast<IN, kMx, kFmtE4M3>(p, st);
    case ScalingMode::kNvfp4_1d: return run_cast<IN, kNv1, kFmtE2M1>(p, st);
    case ScalingMode::kNvfp4_2d: return run_cast<IN, kNv2, kFmtE2M1>(p, st);
    case ScalingMode::kBlock1d:
    case ScalingMode::kBlock2d:
      return e5 ? run_fp8_block<IN, kFmtE5M2>(p, st) : run_fp8_block<IN, kFmtE4M3>(p, st);
  }
  return Status::Invalid("quantize: unknown scaling mode");
}

}  // namespace
}  // namespace cuda

size_t quantize_workspace_bytes(const QuantizeParams& p) {
  size_t bytes = cuda::kScalarBytes;
  if (p.dbias != nullptr && p.rows > 0 && p.cols > 0)
    bytes += size_t((p.rows + cuda::kTileR - 1) / cuda::kTileR) * size_t(p.cols) * sizeof(float);
  return bytes;
}

Status quantize_cuda(const QuantizeParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.x_dtype) {
    case DType::kF32: return cuda::dispatch_mode<0>(p, st);
    case DType::kBF16: return cuda::dispatch_mode<1>(p, st);
    case DType::kF16: return cuda::dispatch_mode<2>(p, st);
    default: return Status::Invalid("quantize: unsupported input dtype");
  }
}

}  // namespace lowbit
