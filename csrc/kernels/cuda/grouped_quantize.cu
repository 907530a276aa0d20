// CUDA grouped quantize: docs/numerics.md "Grouped quantize". group_sizes stays on the device;
// everything derived from it is computed there:
//   offsets (one block: exclusive scan of max(size, 0), clamped to M; zeroes amax) -> row ->
//   group map and each 128-row tile's group if it has one (binary search per row) -> per-group
//   amax (atomicMax per row; delayed scaling: fused into the cast) -> per-group scale_inv and the
//   one-group tiles' scales -> fused cast (the tile kernel of cast_kernels.cuh: a one-group tile
//   is cast as a non-grouped one with its group's scale, the others with per-row scales; rows in
//   no group are zeros).
// BLOCK_1D: offsets -> one kernel over 128x128 tiles of each group (grouped_block1d_kernel: the
//   block casts of both copies and the per-group amax from one read of x).
#include "cast_kernels.cuh"
#include "grouped_block_cast.cuh"
#include "lowbit/block_scaling.h"

namespace lowbit {
namespace cuda {
namespace {

// Workspace layout: [0, 256) header (int32 at 0: the number of kTileRowScales tile rows) |
// starts int64[G] | ends int64[G] | row_group int32[M] | (16-byte aligned) tile_info
// int2[TR] | rows_list int32[TR] (TR = ceil(M / kTileR); cast_kernels.cuh's kGroupTiles).
constexpr size_t kHeader = 256;
size_t starts_off() { return kHeader; }
size_t ends_off(int64_t G) { return kHeader + size_t(G) * 8; }
size_t rowgroup_off(int64_t G) { return kHeader + size_t(G) * 16; }
size_t tileinfo_off(int64_t G, int64_t M) {
  return (rowgroup_off(G) + size_t(M) * sizeof(int32_t) + 15) & ~size_t(15);
}
__host__ __device__ int64_t tile_rows(int64_t M) { return (M + kTileR - 1) / kTileR; }
size_t rowslist_off(int64_t G, int64_t M) {
  return tileinfo_off(G, M) + size_t(tile_rows(M)) * sizeof(int2);
}

// Group g owns rows [starts[g], ends[g]): the exclusive / inclusive cumulative sums of the sizes
// (negative sizes count as 0), clamped to M. One block of 1024 threads walks the groups in
// chunks, carrying the running total; 64-bit sums cannot overflow. Also zeroes amax[G] (what a
// memset did, one launch fewer) and the count of rows_list.
__global__ void __launch_bounds__(1024)
    group_offsets_kernel(const int32_t* sizes, int64_t G, int64_t M, int64_t* starts, int64_t* ends,
                         float* amax, int32_t* rows_count) {
  __shared__ long long warp_sum[32];
  __shared__ long long carry;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  if (t == 0) {
    carry = 0;
    *rows_count = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < G; base += 1024) {
    const int64_t g = base + t;
    const long long n = g < G ? (sizes[g] > 0 ? sizes[g] : 0) : 0;
    long long v = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long y = __shfl_up_sync(kFull, v, o);
      if (lane >= o) v += y;
    }
    if (lane == 31) warp_sum[warp] = v;
    __syncthreads();
    if (warp == 0) {
      long long w = warp_sum[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(kFull, w, o);
        if (lane >= o) w += y;
      }
      warp_sum[lane] = w;
    }
    __syncthreads();
    const long long incl = carry + v + (warp > 0 ? warp_sum[warp - 1] : 0);
    if (g < G) {
      starts[g] = (incl - n) < M ? (incl - n) : M;
      ends[g] = incl < M ? incl : M;
      amax[g] = 0.0f;
    }
    __syncthreads();  // everyone has read carry and warp_sum
    if (t == 1023) carry = incl;
    __syncthreads();
  }
}

// Row m's group: the last g with starts[g] <= m, if m < ends[g] (an empty group there means
// every earlier group ended before m too); -1 for rows after the last group.
__device__ int32_t group_of_row(const int64_t* starts, const int64_t* ends, int64_t G, int64_t m) {
  int64_t lo = 0, hi = G;  // first g with starts[g] > m
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (starts[mid] <= m)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int64_t g = lo - 1;
  return (g >= 0 && m < ends[g]) ? int32_t(g) : -1;
}

// row_group[M], and tile_info[tile row].x: g when the tile's first and last rows (below M) are
// both in group g (groups are runs of consecutive rows and the rows in no group come after all
// of them, so every row between is in g too; g = -1: kTileNoGroup), else kTileRowScales, and
// such a tile row is appended to rows_list (at most one per group end: at most G of them).
// .y (the scale) is set by grouped_finalize_kernel.
__global__ void row_group_kernel(const int64_t* starts, const int64_t* ends, int64_t G, int64_t M,
                                 int32_t* row_group, int2* tile_info, int32_t* rows_list,
                                 int32_t* rows_count) {
  const int64_t TR = tile_rows(M);
  for (int64_t m = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; m < M + TR;
       m += int64_t(gridDim.x) * blockDim.x) {
    if (m < M) {
      row_group[m] = group_of_row(starts, ends, G, m);
    } else {
      const int64_t r0 = (m - M) * kTileR, rl = (r0 + kTileR < M ? r0 + kTileR : M) - 1;
      const int32_t g = group_of_row(starts, ends, G, r0);
      const bool one = group_of_row(starts, ends, G, rl) == g;
      tile_info[m - M] = make_int2(one ? (g >= 0 ? g : kTileNoGroup) : kTileRowScales, 0);
      if (!one) rows_list[atomicAdd(rows_count, 1)] = int32_t(m - M);
    }
  }
}

// The warp's max of mx into *out (all lanes call).
__device__ __forceinline__ void warp_amax_to(float mx, float* out) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
  if ((threadIdx.x & 31) == 0) atomic_max_nonneg(out, mx);
}

// Per-group amax (current scaling): each warp reads a contiguous run of rows, a row at a time
// (16-byte loads when rows are aligned), and adds one atomic per group it meets. It was a warp
// per row with one atomic per row: the rows of a group, read together, all hit one address.
template <int IN>
__global__ void __launch_bounds__(256)
    grouped_amax_kernel(const void* xv, int64_t M, int64_t K, bool vec, const int32_t* row_group,
                        float* amax) {
  using T = typename In<IN>::T;
  constexpr int CH = 16 / int(sizeof(T));
  const T* x = static_cast<const T*>(xv);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t w = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t per = (M + warps - 1) / warps, m0 = w * per, m1 = m0 + per < M ? m0 + per : M;
  int gcur = -1, gnext = m0 < m1 ? row_group[m0] : -1;  // warp-uniform
  float mx = 0.0f;  // this lane's max over the rows of group gcur so far
  for (int64_t m = m0; m < m1; ++m) {
    const int g = gnext;
    if (m + 1 < m1) gnext = row_group[m + 1];  // in flight with this row's loads
    if (g != gcur) {
      if (gcur >= 0) warp_amax_to(mx, amax + gcur);
      gcur = g;
      mx = 0.0f;
    }
    if (g < 0) continue;
    const T* row = x + m * K;
    if (vec) {
      const uint4* r4 = reinterpret_cast<const uint4*>(row);
#pragma unroll 4
      for (int64_t i = lane; i < K / CH; i += 32) {
        float v[CH];
        unpack16<IN>(__ldg(r4 + i), v);
        mx = fmaxf(mx, amax_n<CH>(v));
      }
    } else {
      for (int64_t i = lane; i < K; i += 32) mx = fmaxf(mx, fabsf(In<IN>::f(row[i])));
    }
  }
  if (gcur >= 0) warp_amax_to(mx, amax + gcur);
}

// Per-group scale_inv of the tensor modes (an empty group has amax 0, hence scale 1), and the
// scale of each one-group tile (tile_info[i].y for i < TR), both by group_scale.
template <int FMT>
__global__ void grouped_finalize_kernel(int64_t G, const float* delayed, const float* amax,
                                        float* si_row, float* si_col, int2* tile_info, int64_t TR) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < G || i < TR;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (i < G) {
      const float inv = 1.0f / group_scale<FMT>(delayed, amax, i);
      if (si_row) si_row[i] = inv;
      if (si_col) si_col[i] = inv;
    }
    if (i < TR) {
      const int g = tile_info[i].x;
      if (g >= 0) tile_info[i].y = __float_as_int(group_scale<FMT>(delayed, amax, g));
    }
  }
}

// ---- BLOCK_1D (lowbit/block_scaling.h's grouped layouts) ----
// One block per 128-row tile of one group (or of the rows in no group) and 128 columns: the tile
// is read once into shared memory, then the rowwise copy (1x128 along the columns) is written row
// by row and the colwise copy (1x128 along the group's rows) column by column. Tile rows are
// numbered as the colwise scale rows: b in [0, M/128 + G) is block b - first_g of the group g
// with first_g = start_g / 128 + g <= b (first_g strictly increases with g); the ceil(M/128)
// tile rows after those cover the rows in no group (rowwise copy: zero data, scale_inv 1.0).
// Tiles past a group's end exit at once. Each tile of a group also adds its amax to the group's
// (the only read of x).
constexpr int kGb = 128, kGbLd = kGb + 1, kGbThreads = 256;
constexpr size_t kGbSmem = size_t(kGb) * kGbLd * sizeof(float);

struct GroupedBlockArgs {
  const void* x;
  int64_t M, K, G, tiles_c, nkb;
  const int64_t* starts;
  const int64_t* ends;
  uint8_t* q_row;  // (M, K) or null
  float* s_row;    // (M * nkb,)
  uint8_t* q_col;  // (K, M) or null
  float* s_col;    // (M / 128 + G, K)
  float* amax;     // (G,), zeroed: each tile of a group adds its max (one read of x in all)
  float eps;
  bool pow2;
};

template <int IN, int FMT>
__global__ void __launch_bounds__(kGbThreads) grouped_block1d_kernel(const GroupedBlockArgs a) {
  using T = typename In<IN>::T;
  extern __shared__ float tile[];  // [kGb][kGbLd]
  const T* x = static_cast<const T*>(a.x);
  const int64_t b = int64_t(blockIdx.x) / a.tiles_c, tc = int64_t(blockIdx.x) - b * a.tiles_c;
  const GroupedBlockTile gt = grouped_block_tile(b, a.M, a.G, a.starts, a.ends);
  const int64_t g = gt.g, run_start = gt.run_start, run_size = gt.run_size, r0 = gt.r0;
  const int64_t run_end = run_start + run_size;
  if (r0 >= run_end) return;  // block-uniform
  const int64_t c0 = tc * kGb;
  const int nr = int(run_end - r0 < kGb ? run_end - r0 : kGb);
  const int nc = int(a.K - c0 < kGb ? a.K - c0 : kGb);
  if (g < 0) {  // rows in no group: zero data, scale_inv 1.0 (rowwise; colwise is preset)
    if (a.q_row)
      for (int i = threadIdx.x; i < kGb * kGb; i += kGbThreads) {
        const int rr = i / kGb, cc = i - rr * kGb;
        if (rr < nr && cc < nc) a.q_row[(r0 + rr) * a.K + c0 + cc] = 0;
      }
    if (a.s_row)
      for (int rr = threadIdx.x; rr < nr; rr += kGbThreads)
        a.s_row[run_start * a.nkb + tc * run_size + (r0 - run_start) + rr] = 1.0f;
    return;
  }
  float tmax = 0.0f;
  for (int i = threadIdx.x; i < kGb * kGb; i += kGbThreads) {
    const int rr = i / kGb, cc = i - rr * kGb;
    const float v = (rr < nr && cc < nc) ? In<IN>::f(x[(r0 + rr) * a.K + c0 + cc]) : 0.0f;
    tile[rr * kGbLd + cc] = v;
    tmax = fmaxf(tmax, fabsf(v));  // NaN ignored, as every amax
  }
  {
    __shared__ float red[kGbThreads / 32];
    block_amax_to(tmax, red, a.amax + g);  // its barrier also completes the tile
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (a.q_row)
    for (int rr = warp; rr < nr; rr += kGbThreads / 32) {
      uint8_t* q = a.q_row + (r0 + rr) * a.K + c0;
      const float d = warp_block_encode<FMT>(tile + rr * kGbLd, 1, nc, a.eps, a.pow2,
                                             [&](int cc, uint8_t byte) { q[cc] = byte; });
      if (lane == 0) a.s_row[run_start * a.nkb + tc * run_size + (r0 - run_start) + rr] = d;
    }
  if (a.q_col)
    for (int cc = warp; cc < nc; cc += kGbThreads / 32) {
      uint8_t* q = a.q_col + (c0 + cc) * a.M + r0;
      const float d = warp_block_encode<FMT>(tile + cc, kGbLd, nr, a.eps, a.pow2,
                                             [&](int rr, uint8_t byte) { q[rr] = byte; });
      if (lane == 0) a.s_col[b * a.K + c0 + cc] = d;
    }
}

template <int IN, int FMT>
Status run_grouped_block1d(const GroupedQuantizeParams& p, cudaStream_t st, const int64_t* starts,
                           const int64_t* ends) {
  const int64_t M = p.rows, K = p.cols, G = p.num_groups;
  if ((p.rowwise && !(p.data && p.scale_inv)) ||
      (p.colwise && !(p.colwise_data && p.colwise_scale_inv)))
    return Status::Invalid("grouped_quantize: output missing");
  auto aligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  // The fast kernel (grouped_block_cast.cuh) where its 16-byte accesses are aligned.
  const bool fast = K % 16 == 0 && aligned(p.x) && aligned(p.rowwise ? p.data : nullptr) &&
                    aligned(p.colwise ? p.colwise_data : nullptr);
  if (p.colwise) {
    // Colwise data outside every group is zero (the fast kernel's tiles of those rows write
    // them); scale rows of no block hold 1.0.
    if (!fast)
      if (auto s = api_status(cudaMemsetAsync(p.colwise_data, 0, size_t(M * K), st), "memset");
          !s.ok())
        return s;
    const int64_t n = grouped_block_colwise_rows(M, G) * K;
    if (n > 0) {
      fill_f32_kernel<<<grid_for(n, 256, 4096), 256, 0, st>>>(
          static_cast<float*>(p.colwise_scale_inv), n, 1.0f);
      if (auto s = launch_status("fill_f32_kernel"); !s.ok()) return s;
    }
  }
  if (M == 0 || K == 0) return Status::Ok();
  GroupedBlockArgs a;
  a.x = p.x;
  a.M = M;
  a.K = K;
  a.G = G;
  a.tiles_c = (K + kGb - 1) / kGb;
  a.nkb = a.tiles_c;
  a.starts = starts;
  a.ends = ends;
  a.q_row = p.rowwise ? static_cast<uint8_t*>(p.data) : nullptr;
  a.s_row = p.rowwise ? static_cast<float*>(p.scale_inv) : nullptr;
  a.q_col = p.colwise ? static_cast<uint8_t*>(p.colwise_data) : nullptr;
  a.s_col = p.colwise ? static_cast<float*>(p.colwise_scale_inv) : nullptr;
  a.amax = p.amax;
  a.eps = p.amax_epsilon;
  a.pow2 = p.power_2_scale;
  const int64_t tile_rows = grouped_block_colwise_rows(M, G) + (M + kGb - 1) / kGb;
  const int64_t blocks = tile_rows * a.tiles_c;
  if (blocks > INT32_MAX) return Status::Invalid("grouped_quantize: tensor too large");
  auto kernel = fast ? grouped_block1d_fast_kernel<IN, FMT, GroupedBlockArgs>
                     : grouped_block1d_kernel<IN, FMT>;
  const size_t smem = fast ? gfb_smem<IN>() : kGbSmem;
  const int threads = fast ? kGfbThreads : kGbThreads;
  if (auto s = api_status(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute");
      !s.ok())
    return s;
  // clang-format off
  kernel<<<unsigned(blocks), threads, smem, st>>>(a);
  // clang-format on
  return launch_status(fast ? "grouped_block1d_fast_kernel" : "grouped_block1d_kernel");
}

template <int IN, int KIND, int FMT>
Status run_grouped(const GroupedQuantizeParams& p, cudaStream_t st) {
  const int64_t M = p.rows, K = p.cols, G = p.num_groups, n = M * K;
  char* ws = static_cast<char*>(p.workspace);
  if (ws == nullptr) return Status::Invalid("grouped_quantize: workspace missing");
  if (G > INT32_MAX) return Status::Invalid("grouped_quantize: too many groups");
  int64_t* starts = reinterpret_cast<int64_t*>(ws + starts_off());
  int64_t* ends = reinterpret_cast<int64_t*>(ws + ends_off(G));
  int32_t* row_group = reinterpret_cast<int32_t*>(ws + rowgroup_off(G));
  int2* tile_info = reinterpret_cast<int2*>(ws + tileinfo_off(G, M));
  int32_t* rows_list = reinterpret_cast<int32_t*>(ws + rowslist_off(G, M));
  int32_t* rows_count = reinterpret_cast<int32_t*>(ws);
  const int64_t TR = tile_rows(M);
  const bool tensor = KIND == kTensor;

  if (G > 0) {
    group_offsets_kernel<<<1, 1024, 0, st>>>(p.group_sizes, G, M, starts, ends, p.amax, rows_count);
    if (auto s = launch_status("group_offsets_kernel"); !s.ok()) return s;
  }
  const bool block = p.mode == ScalingMode::kBlock1d;  // its cast takes the per-group amax
  if (M > 0 && !block) {
    row_group_kernel<<<grid_for(M + TR, 256, 8192), 256, 0, st>>>(starts, ends, G, M, row_group,
                                                                  tile_info, rows_list, rows_count);
    if (auto s = launch_status("row_group_kernel"); !s.ok()) return s;
  }
  const bool fast = tile_cast_fits(M, K, aligned16(p.x), p.rowwise ? p.data : nullptr,
                                   p.colwise && tensor ? p.colwise_data : nullptr);
  // Delayed scaling needs no amax before the cast: the tile kernel accumulates it in the same read.
  const bool fused_amax = fast && tensor && p.mode == ScalingMode::kDelayedTensor;
  if (n > 0 && G > 0 && !fused_amax && !block) {
    constexpr int CH = 16 / int(sizeof(typename In<IN>::T));
    const bool vec = K % CH == 0 && aligned16(p.x);
    grouped_amax_kernel<IN>
        <<<grid_for(M * 32, 256, 2048), 256, 0, st>>>(p.x, M, K, vec, row_group, p.amax);
    if (auto s = launch_status("grouped_amax_kernel"); !s.ok()) return s;
  }
  if (p.mode == ScalingMode::kBlock1d) return run_grouped_block1d<IN, FMT>(p, st, starts, ends);

  if (tensor && G > 0) {
    grouped_finalize_kernel<FMT><<<grid_for(G > TR ? G : TR, 256), 256, 0, st>>>(
        G, p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr, p.amax,
        p.rowwise ? static_cast<float*>(p.scale_inv) : nullptr,
        p.colwise ? static_cast<float*>(p.colwise_scale_inv) : nullptr, tile_info, TR);
    if (auto s = launch_status("grouped_finalize_kernel"); !s.ok()) return s;
  }
  if (n == 0) return Status::Ok();
  if ((p.rowwise && !p.data) || (p.colwise && !p.colwise_data))
    return Status::Invalid("grouped_quantize: output missing");

  CastArgs a;
  a.x = p.x;
  a.R = M;
  a.C = K;
  a.rowwise = p.rowwise;
  a.colwise = p.colwise && tensor;  // MXFP8 grouped is rowwise only (validated)
  a.q_row = static_cast<uint8_t*>(p.data);
  a.s_row = static_cast<uint8_t*>(p.scale_inv);
  a.q_col = static_cast<uint8_t*>(p.colwise_data);
  a.delayed = p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr;
  a.amax_in = p.amax;
  a.row_group = row_group;
  a.tile_info = tile_info;
  a.rows_list = rows_list;
  a.rows_count = rows_count;
  a.amax_out = fused_amax && G > 0 ? p.amax : nullptr;
  if (fast) {
    int64_t tiles = 0;
    if (!set_tiles(a, &tiles)) return Status::Invalid("grouped_quantize: tensor too large");
    cast_tile_kernel<IN, KIND, FMT, kGroupTiles><<<unsigned(tiles), kTileThreads, 0, st>>>(a);
    if (auto s = launch_status("cast_tile_kernel (grouped tiles)"); !s.ok()) return s;
    if (G == 0) return Status::Ok();  // no kTileRowScales tiles (rows_count not set)
    // At most min(G, TR) tile rows cross a group end; blocks past rows_count exit.
    const int64_t rows_tiles = (G < TR ? G : TR) * int64_t(a.tiles_c);
    cast_tile_kernel<IN, KIND, FMT, kGroupRows><<<unsigned(rows_tiles), kTileThreads, 0, st>>>(a);
    return launch_status("cast_tile_kernel (grouped rows)");
  }
  constexpr int B = generic_block<KIND>();
  if (a.rowwise) {
    rowwise_generic_kernel<IN, KIND, FMT, true><<<grid_for(n / B, 256, 8192), 256, 0, st>>>(a);
    if (auto s = launch_status("rowwise_generic_kernel (grouped)"); !s.ok()) return s;
  }
  if (a.colwise) {
    colwise_generic_kernel<IN, KIND, FMT, true><<<grid_for(n / B, 256, 8192), 256, 0, st>>>(a);
    if (auto s = launch_status("colwise_generic_kernel (grouped)"); !s.ok()) return s;
  }
  return Status::Ok();
}

template <int IN>
Status dispatch_grouped(const GroupedQuantizeParams& p, cudaStream_t st) {
  const bool e5 = p.q_dtype == DType::kE5M2;
  switch (p.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      return e5 ? run_grouped<IN, kTensor, kFmtE5M2>(p, st)
                : run_grouped<IN, kTensor, kFmtE4M3>(p, st);
    case ScalingMode::kMxfp8_1d:
      return e5 ? run_grouped<IN, kMx, kFmtE5M2>(p, st) : run_grouped<IN, kMx, kFmtE4M3>(p, st);
    case ScalingMode::kBlock1d:  // the per-group amax of the tensor path, then the block cast
      return e5 ? run_grouped<IN, kTensor, kFmtE5M2>(p, st)
                : run_grouped<IN, kTensor, kFmtE4M3>(p, st);
    default: return Status::Invalid("grouped_quantize: unsupported scaling mode");
  }
}

}  // namespace
}  // namespace cuda

size_t grouped_quantize_workspace_bytes(const GroupedQuantizeParams& p) {
  const int64_t G = p.num_groups > 0 ? p.num_groups : 0, M = p.rows > 0 ? p.rows : 0;
  const size_t bytes = cuda::rowslist_off(G, M) + size_t(cuda::tile_rows(M)) * sizeof(int32_t);
  return (bytes + 255) & ~size_t(255);
}

Status grouped_quantize_cuda(const GroupedQuantizeParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.x_dtype) {
    case DType::kF32: return cuda::dispatch_grouped<0>(p, st);
    case DType::kBF16: return cuda::dispatch_grouped<1>(p, st);
    case DType::kF16: return cuda::dispatch_grouped<2>(p, st);
    default: return Status::Invalid("grouped_quantize: unsupported input dtype");
  }
}

}  // namespace lowbit
