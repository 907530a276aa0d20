// CUDA LayerNorm / RMSNorm (lowbit/norm.h). Stream-ordered, no host sync, no allocation.
//
// Forward, fast path (C a multiple of one 16-byte vector, at most 2048 vectors per row): a block
// of 16 warps owns a band of 16 rows; a row is split over `wpr` warps (1..16, each lane holds NV
// <= 4 vectors in registers), so 16 / wpr rows run at once and the block walks the band in wpr
// passes, loading the next pass's row while it computes the current one. Statistics: two-pass
// variance from registers, warp butterflies, then the row's warp partials added in warp order
// through shared memory (deterministic). Each row writes y and/or its rowwise FP8 bytes and
// stashes the FP8 bytes in shared memory; once the band is done the block writes the colwise
// copy (16 bytes per column). Several blocks share an SM. (Few vectors per lane on purpose: a
// whole row per warp needs too many registers and too much unrolled code.) Current scaling runs
// the kernel twice (lowbit/norm.h): amax first, then the copies. Other shapes: a generic kernel,
// one row per block, re-reading x from global memory, same per-element arithmetic.
// FP8 output in whole 16x16 tiles (the transformer's case) takes another route: the kernel writes
// only the statistics (and y if asked, and amax(y) for current scaling), then the quantize tile
// cast recomputes y per element from x and the statistics (NormLoad) and writes both copies in
// 128-byte runs. Two reads of x, but the colwise copy at copy speed instead of 35% of it.
//
// Backward: one row at a time per block, the row spread over the block's threads; each thread
// keeps dgamma/dbeta partial sums for its own columns in registers; partials go to the workspace
// ([2][parts][C] floats) and a second kernel adds them in a fixed order. Float ops are explicit _rn
// intrinsics (FMAs written as such), so every launch of a kernel computes y with identical
// arithmetic whatever outputs it writes: the fused FP8 copies equal lowbit.quantize(y).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_cast.cuh"
#include "cast_kernels.cuh"
#include "fused_kernel_helpers.cuh"
#include "lowbit/norm.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kBand = 16;       // rows per band (forward fast path): 16 colwise bytes per column
constexpr int kFwdWarps = 16;   // warps per block (forward fast path): one row per warp at most
constexpr int kMaxNV = 4;       // 16-byte vectors per lane (forward fast path)
constexpr int kBwdParts = 256;  // backward blocks = dgamma/dbeta partial rows (at most)

template <int IN>
__host__ __device__ constexpr int vec_elems() {
  return IN == 0 ? 4 : 8;
}

// pack2 / round_vec / round1 / fp8_vec / enc1 / fused_launch_scale: fused_kernel_helpers.cuh.

// Sum over the block; every thread gets the same value (warp partials added in warp order).
// `red` holds 32 floats; callers alternate two buffers so one barrier per call suffices.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) s = __fadd_rn(s, red[w]);
  return s;
}

struct FwdArgs {
  const void* x;
  const float* gamma;
  const float* beta;
  int64_t R, C;
  bool rms, e5;
  float zc_add;  // 1 for zero-centered gamma, else 0
  float eps;
  void* y;
  uint8_t* q_row;
  uint8_t* q_col;
  bool fp8;              // quantize in this launch (scale from `scale` or from amax_in)
  const float* scale;    // delayed
  const float* amax_in;  // current: the first pass's amax
  float* si;
  float* csi;
  float* amax_out;  // atomicMax target (zeroed before), or null
  float* mean;
  float* rsigma;
};

// Row statistics from a row's partial sums (lane values), as (mean, rsigma).
__device__ __forceinline__ float rsigma_of(float sq, float fc, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sq, fc), eps)));
}

// One 16-byte vector of x (E elements from column c0 of a row with statistics rs and
// nm = -mean * rs) -> y = (x * rs + nm) * (gamma + zc_add) + beta, rounded to x's dtype: the
// bits, and their values in `yr`. gamma/beta point at the vector's E values (GLOBAL: device
// memory, read through the read-only cache; else shared memory; beta null: no bias). The
// forward kernels and NormLoad share it, so y is the same wherever it is computed.
template <int IN, bool GLOBAL = true>
__device__ __forceinline__ uint4 affine_vec(uint4 raw, float rs, float nm, const float* gamma,
                                            const float* beta, float zc_add, float* yr) {
  constexpr int E = vec_elems<IN>();
  float f[E], out[E];
  unpack16<IN>(raw, f);
  const float4* g4 = reinterpret_cast<const float4*>(gamma);
  const float4* b4 = reinterpret_cast<const float4*>(beta);
#pragma unroll
  for (int h = 0; h < E / 4; ++h) {
    float4 gg, bb = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (GLOBAL) {
      gg = __ldg(g4 + h);
      if (beta) bb = __ldg(b4 + h);
    } else {
      gg = g4[h];
      if (beta) bb = b4[h];
    }
    const float g[4] = {gg.x, gg.y, gg.z, gg.w}, b[4] = {bb.x, bb.y, bb.z, bb.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      out[4 * h + j] = __fmaf_rn(__fmaf_rn(f[4 * h + j], rs, nm), __fadd_rn(g[j], zc_add), b[j]);
  }
  return round_vec<IN, E>(out, yr);
}

// The tile cast's Load (cast_kernels.cuh) for the FP8 copies of the norm output: each chunk of
// x becomes y from the row statistics the first pass wrote; the tile's gamma, beta and row
// statistics are staged in shared memory (read straight from global memory after the tile's
// loads, they cost a second latency round trip: 73 instead of 52 us for 8192x4096 on the H100).
// The launch's scale_inv outputs are written once. Why: the norm kernel's own colwise store
// writes 16-byte pieces per column and band (36% of copy bandwidth); the tile cast writes
// 128-byte runs.
template <int TC, int TR>  // the cast's tile: TC columns x TR rows
struct NormLoadT {
  const float* mean;  // null for rmsnorm
  const float* rsigma;
  const float* gamma;
  const float* beta;  // or null
  float zc_add;
  float* si;
  float* csi;

  struct Shared {
    float4 gamma[TC / 4], beta[TC / 4];  // beta zeros without a bias
    float rs[TR], nm[TR];                // rsigma, -mean * rsigma of the tile's rows
  };
  __device__ __forceinline__ void stage(Shared& s, int64_t r0, int64_t c0, int64_t R, int64_t C,
                                        int t) const {
    float* g = reinterpret_cast<float*>(s.gamma);
    float* b = reinterpret_cast<float*>(s.beta);
    if (t < TC) {
      const bool in = c0 + t < C;
      g[t] = in ? __ldg(gamma + c0 + t) : 0.0f;
      b[t] = in && beta ? __ldg(beta + c0 + t) : 0.0f;
    } else if (t < TC + TR) {
      const int i = t - TC;
      const bool in = r0 + i < R;
      const float rs = in ? __ldg(rsigma + r0 + i) : 0.0f;
      const float m = in && mean ? __ldg(mean + r0 + i) : 0.0f;
      s.rs[i] = rs;
      s.nm[i] = __fmul_rn(-m, rs);
    }
  }
  template <int IN>
  __device__ __forceinline__ uint4 apply(const Shared& s, uint4 raw, int lr, int lc) const {
    float yr[vec_elems<IN>()];
    const float* g = reinterpret_cast<const float*>(s.gamma) + lc;
    const float* b = reinterpret_cast<const float*>(s.beta) + lc;
    return affine_vec<IN, false>(raw, s.rs[lr], s.nm[lr], g, b, zc_add, yr);
  }
  __device__ __forceinline__ void publish(float scale) const {
    const float inv = 1.0f / scale;
    if (si) *si = inv;
    if (csi) *csi = inv;
  }
};
using NormLoad = NormLoadT<kTileC, kTileR>;

// The block cast's Load (block_cast.cuh) for the block-scaled copies of the norm output: x's
// chunk, then y from the row statistics the first pass wrote (the same affine_vec as above).
struct NormBlockLoad {
  static constexpr int kLoads = 1;
  static constexpr int kMinBlocks = 2;  // the staged statistics and the affine map's registers
  using Shared = NormLoadT<kBlk, kBlk>::Shared;
  NormLoadT<kBlk, kBlk> norm;
  const void* x;
  int64_t C;

  template <int IN>
  __device__ __forceinline__ void fetch(int64_t gr, int64_t gc, uint4 (&src)[kLoads]) const {
    using T = typename In<IN>::T;
    src[0] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(x) + gr * C + gc));
  }
  __device__ __forceinline__ void stage(Shared& s, int64_t r0, int64_t c0, int64_t R, int64_t C_,
                                        int t) const {
    norm.stage(s, r0, c0, R, C_, t);
  }
  template <int IN>
  __device__ __forceinline__ uint4 apply(const Shared& s, const uint4 (&src)[kLoads], int64_t,
                                         int lr, int lc) const {
    return norm.template apply<IN>(s, src[0], lr, lc);
  }
};

// Stores the band's colwise bytes: thread = 4 columns x the band's rows.
__device__ void write_band_colwise(const uint8_t* band, const FwdArgs& a, int64_t r0) {
  const int64_t C = a.C, R = a.R;
  const int rows = R - r0 < kBand ? int(R - r0) : kBand;
  const uint32_t* b32 = reinterpret_cast<const uint32_t*>(band);
  const int64_t nq = C / 4;
  for (int64_t q = threadIdx.x; q < nq; q += blockDim.x) {
    uint32_t w[kBand];
#pragma unroll
    for (int rr = 0; rr < kBand; ++rr) w[rr] = rr < rows ? b32[rr * nq + q] : 0u;
    store_colwise_16x4<false>(w, a.q_col, R, 4 * q, C, 0, r0, rows);
  }
}

// This lane's NV vectors of row r: vector lane0 + k * stride (warp-coalesced); zeros past the row.
template <int NV>
__device__ __forceinline__ void load_row(uint4 (&buf)[NV], const void* x, int64_t r, int64_t R,
                                         int64_t C, int64_t nvec, int64_t lane0, int64_t stride,
                                         int elem_bytes) {
  const uint4* xr =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(x) + r * C * elem_bytes);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = lane0 + k * stride;
    buf[k] = r < R && v < nvec ? __ldg(xr + v) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Sum of a row's lane values over its `wpr` warps: warp butterfly, then the warps' partials in
// warp order from `red` (row slot's wpr floats). Every thread of the block calls it (barrier).
__device__ __forceinline__ float row_sum(float v, float* red, int wi, int wpr) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[wi] = v;
  __syncthreads();
  float s = red[0];
  for (int w = 1; w < wpr; ++w) s = __fadd_rn(s, red[w]);
  return s;
}

// One row held by `wpr` warps in registers: statistics, then y / FP8 outputs. `valid`: r < R
// (an invalid row still takes part in the barriers).
template <int IN, int NV>
__device__ __forceinline__ void norm_row(const FwdArgs& a, const uint4 (&raw)[NV], int64_t r,
                                         int rr, bool valid, int64_t lane0, int64_t stride,
                                         float* red_s, float* red_q, int wi, int wpr, float scale,
                                         uint8_t* band, float& amax) {
  using T = typename In<IN>::T;
  constexpr int E = vec_elems<IN>();
  const int64_t C = a.C, nvec = C / E;
  const float fc = float(C);
  float mean = 0.0f;
  if (!a.rms) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: shorter dependency, fixed order
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      float f[E];
      unpack16<IN>(raw[k], f);  // padding vectors are zero
#pragma unroll
      for (int e = 0; e < E; ++e) s[e & 3] = __fadd_rn(s[e & 3], f[e]);
    }
    mean = __fdiv_rn(
        row_sum(__fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3])), red_s, wi, wpr), fc);
  }
  float q[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (lane0 + k * stride >= nvec) continue;
    float f[E];
    unpack16<IN>(raw[k], f);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float d = __fsub_rn(f[e], mean);
      q[e & 3] = __fmaf_rn(d, d, q[e & 3]);
    }
  }
  const float rs = rsigma_of(
      row_sum(__fadd_rn(__fadd_rn(q[0], q[1]), __fadd_rn(q[2], q[3])), red_q, wi, wpr), fc, a.eps);
  if (!valid) return;
  const float nm = __fmul_rn(-mean, rs);
  if (lane0 == 0) {
    if (a.rsigma) a.rsigma[r] = rs;
    if (a.mean && !a.rms) a.mean[r] = mean;
  }
  if (!a.y && !a.fp8 && !a.amax_out) return;  // statistics only (the tile cast's first pass)
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = lane0 + k * stride;
    if (v >= nvec) continue;
    float yr[E];
    const uint4 bits = affine_vec<IN>(raw[k], rs, nm, a.gamma + v * E,
                                      a.beta ? a.beta + v * E : nullptr, a.zc_add, yr);
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(yr[e]));
    if (a.y) reinterpret_cast<uint4*>(static_cast<T*>(a.y) + r * C)[v] = bits;
    if (a.fp8) {
      uint32_t w[E / 4];
      if (a.e5)
        fp8_vec<kFmtE5M2, E>(yr, scale, w);
      else
        fp8_vec<kFmtE4M3, E>(yr, scale, w);
      if constexpr (E == 8) {
        const uint2 o = make_uint2(w[0], w[1]);
        if (a.q_row) *reinterpret_cast<uint2*>(a.q_row + r * C + v * E) = o;
        if (a.q_col) *reinterpret_cast<uint2*>(band + rr * C + v * E) = o;
      } else {
        if (a.q_row) *reinterpret_cast<uint32_t*>(a.q_row + r * C + v * E) = w[0];
        if (a.q_col) *reinterpret_cast<uint32_t*>(band + rr * C + v * E) = w[0];
      }
    }
  }
}

// One block per band of kBand rows; a row is spread over `wpr` warps (a power of two), so the
// band takes wpr passes of kFwdWarps / wpr rows each; the next pass's row is loaded before the
// current one is computed.
template <int IN, int NV>
__global__ void __launch_bounds__(kFwdWarps * 32, 2) norm_fwd_fast(const FwdArgs a, int wpr) {
  constexpr int EB = IN == 0 ? 4 : 2;
  extern __shared__ uint4 smem[];
  uint8_t* band = reinterpret_cast<uint8_t*>(smem);
  __shared__ float red_s[kFwdWarps], red_q[kFwdWarps], red_a[kFwdWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = warp / wpr, wi = warp % wpr, per_pass = kFwdWarps / wpr;
  const int64_t R = a.R, C = a.C, nvec = C / vec_elems<IN>(), r0 = int64_t(blockIdx.x) * kBand;
  const int64_t lane0 = int64_t(wi) * 32 + lane, stride = int64_t(wpr) * 32;
  const float scale = fused_launch_scale<false>(a);
  float amax = 0.0f;
  uint4 cur[NV], nxt[NV];
  load_row<NV>(cur, a.x, r0 + slot, R, C, nvec, lane0, stride, EB);
  for (int pass = 0; pass < wpr; ++pass) {
    const int rr = pass * per_pass + slot;
    if (pass + 1 < wpr) load_row<NV>(nxt, a.x, r0 + rr + per_pass, R, C, nvec, lane0, stride, EB);
    // RMSNorm has one row sum per pass: alternate its buffer so a pass never overwrites partials
    // another warp of the previous pass may still be reading.
    float* rq = a.rms && (pass & 1) ? red_s : red_q;
    norm_row<IN, NV>(a, cur, r0 + rr, rr, r0 + rr < R, lane0, stride, red_s + slot * wpr,
                     rq + slot * wpr, wi, wpr, scale, band, amax);
#pragma unroll
    for (int k = 0; k < NV; ++k) cur[k] = nxt[k];
  }
  if (a.fp8 && a.q_col) {
    __syncthreads();
    write_band_colwise(band, a, r0);
  }
  if (a.amax_out) block_amax_to(amax, red_a, a.amax_out);
}

// Any shape/alignment: one row per block, x re-read from global memory for each pass; the
// per-element arithmetic is the fast kernel's.
template <int IN>
__global__ void __launch_bounds__(256) norm_fwd_generic(const FwdArgs a) {
  using T = typename In<IN>::T;
  __shared__ float red[2][32];
  const T* x = static_cast<const T*>(a.x);
  const int64_t C = a.C, R = a.R;
  const float scale = fused_launch_scale<false>(a);
  float amax = 0.0f;
  int parity = 0;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* xr = x + r * C;
    float mean = 0.0f;
    if (!a.rms) {
      float s = 0.0f;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s = __fadd_rn(s, In<IN>::f(xr[c]));
      mean = __fdiv_rn(block_sum(s, red[parity]), float(C));
      parity ^= 1;
    }
    float q = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = __fsub_rn(In<IN>::f(xr[c]), mean);
      q = __fmaf_rn(d, d, q);
    }
    const float rs = rsigma_of(block_sum(q, red[parity]), float(C), a.eps);
    const float nm = __fmul_rn(-mean, rs);
    parity ^= 1;
    if (threadIdx.x == 0) {
      if (a.rsigma) a.rsigma[r] = rs;
      if (a.mean && !a.rms) a.mean[r] = mean;
    }
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float v = __fmaf_rn(__fmaf_rn(In<IN>::f(xr[c]), rs, nm),
                                __fadd_rn(a.gamma[c], a.zc_add), a.beta ? a.beta[c] : 0.0f);
      const float yr = round1<IN>(v);
      amax = fmaxf(amax, fabsf(yr));
      if (a.y) store_out<IN>(a.y, r * C + c, yr);
      if (a.fp8) {
        const uint8_t code = uint8_t(enc1(__fmul_rn(yr, scale), a.e5));
        if (a.q_row) a.q_row[r * C + c] = code;
        if (a.q_col) a.q_col[c * R + r] = code;
      }
    }
  }
  if (a.amax_out) {
    __shared__ float ared[8];
    block_amax_to(amax, ared, a.amax_out);
  }
}

// The fast path's split of a row of `nvec` vectors: NV vectors per lane, `wpr` warps per row
// (a power of two, at most kFwdWarps); NV 0 when the row is too long for it.
struct FwdSplit {
  int nv, wpr;
};
FwdSplit fwd_split(int64_t nvec) {
  for (int nv : {1, 2, 4})
    if (nvec <= 32 * int64_t(nv)) return {nv, 1};
  for (int wpr = 2; wpr <= kFwdWarps; wpr *= 2)
    if (nvec <= 32 * int64_t(kMaxNV) * wpr) return {kMaxNV, wpr};
  return {0, 0};
}

template <int IN, int NV>
Status launch_fwd_fast(const FwdArgs& a, int wpr, cudaStream_t st) {
  const int64_t nbands = (a.R + kBand - 1) / kBand;
  const size_t smem = a.q_col ? size_t(kBand) * size_t(a.C) : 0;
  auto kernel = norm_fwd_fast<IN, NV>;
  if (smem > 48 * 1024) {
    // Opting in to more than 48 KB of shared memory is a per-kernel attribute, not a stream op.
    auto e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (auto s = api_status(e, "norm: shared memory opt-in"); !s.ok()) return s;
  }
  if (nbands > int64_t(0x7fffffff)) return Status::Invalid("norm: too many rows");
  kernel<<<unsigned(nbands), kFwdWarps * 32, smem, st>>>(a, wpr);
  return launch_status("norm_fwd_fast");
}

template <int IN>
Status launch_fwd(const FwdArgs& a, cudaStream_t st) {
  constexpr int E = vec_elems<IN>();
  const bool vec = a.C % E == 0 && aligned16(a.x) && aligned16(a.gamma) &&
                   (!a.beta || aligned16(a.beta)) && (!a.y || aligned16(a.y)) &&
                   (!a.q_row || (reinterpret_cast<uintptr_t>(a.q_row) & 7u) == 0) &&
                   (!a.q_col || aligned16(a.q_col));
  // The band of FP8 rows must fit in shared memory (227 KB on Hopper).
  const FwdSplit sp =
      vec && int64_t(kBand) * a.C <= 200 * 1024 ? fwd_split(a.C / E) : FwdSplit{0, 0};
  switch (sp.nv) {
    case 1: return launch_fwd_fast<IN, 1>(a, sp.wpr, st);
    case 2: return launch_fwd_fast<IN, 2>(a, sp.wpr, st);
    case 4: return launch_fwd_fast<IN, 4>(a, sp.wpr, st);
    default: break;
  }
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(a.R, 65535)));
  norm_fwd_generic<IN><<<blocks, 256, 0, st>>>(a);
  return launch_status("norm_fwd_generic");
}

// The FP8 copies of y through the tile cast (NormLoad), after a first pass has written the
// statistics: the tile cast's own conditions, and at least one row.
bool norm_tile_cast_fits(const NormFwdParams& p) {
  const bool x_ok = aligned16(p.x) && aligned16(p.gamma) && (!p.beta || aligned16(p.beta));
  return p.rows > 0 && tile_cast_fits(p.rows, p.cols, x_ok, p.data, p.colwise_data);
}

template <int IN, int FMT>
Status launch_tile_cast(const NormFwdParams& p, cudaStream_t st) {
  CastArgs c;
  c.x = p.x;
  c.R = p.rows;
  c.C = p.cols;
  c.rowwise = p.data != nullptr;
  c.colwise = p.colwise_data != nullptr;
  c.q_row = p.data;
  c.q_col = p.colwise_data;
  const bool delayed = p.mode == ScalingMode::kDelayedTensor;
  c.delayed = delayed ? p.scale : nullptr;
  c.amax_in = p.amax;                       // current: the first pass's amax(y)
  c.amax_out = delayed ? p.amax : nullptr;  // delayed: amax(y) on the way
  int64_t tiles = 0;
  if (!set_tiles(c, &tiles)) return Status::Invalid("norm: tensor too large");
  const NormLoad load{p.type == NormType::kRmsNorm ? nullptr : p.mean,
                      p.rsigma,
                      p.gamma,
                      p.beta,
                      p.zero_centered_gamma ? 1.0f : 0.0f,
                      p.scale_inv,
                      p.colwise_scale_inv};
  cast_tile_kernel<IN, kTensor, FMT, false, false, NormLoad>
      <<<unsigned(tiles), kTileThreads, 0, st>>>(c, load);
  return launch_status("cast_tile_kernel<NormLoad>");
}

template <int IN>
Status tile_cast(const NormFwdParams& p, cudaStream_t st) {
  return p.q_dtype == DType::kE5M2 ? launch_tile_cast<IN, kFmtE5M2>(p, st)
                                   : launch_tile_cast<IN, kFmtE4M3>(p, st);
}

// The block-scaled copies of y through the block cast (NormBlockLoad), after a first pass has
// written the statistics. Python sends only whole 16x16 tiles (lowbit.ops.fused_quantize).
template <int IN, int FMT>
Status launch_block_cast(const NormFwdParams& p, cudaStream_t st) {
  BlockCastArgs c{};
  c.x = p.x;
  c.R = p.rows;
  c.C = p.cols;
  c.q_row = p.data;
  c.s_row = p.data ? p.scale_inv : nullptr;
  c.q_col = p.colwise_data;
  c.s_col = p.colwise_data ? p.colwise_scale_inv : nullptr;
  c.eps = p.amax_epsilon;
  c.pow2 = p.power_2_scale;
  c.amax_out = p.amax;
  NormBlockLoad load{};
  load.norm = NormLoadT<kBlk, kBlk>{p.type == NormType::kRmsNorm ? nullptr : p.mean,
                                    p.rsigma,
                                    p.gamma,
                                    p.beta,
                                    p.zero_centered_gamma ? 1.0f : 0.0f,
                                    nullptr,
                                    nullptr};
  load.x = p.x;
  load.C = p.cols;
  return launch_fp8_block_cast<IN, FMT>(c, p.mode == ScalingMode::kBlock2d, load, st);
}

template <int IN>
Status block_cast(const NormFwdParams& p, cudaStream_t st) {
  return p.q_dtype == DType::kE5M2 ? launch_block_cast<IN, kFmtE5M2>(p, st)
                                   : launch_block_cast<IN, kFmtE4M3>(p, st);
}

// ---------------------------------------------------------------------------------------------
// backward

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* mean;
  const float* rsigma;
  const float* gamma;
  int64_t R, C;
  bool rms, zc;
  void* dx;
  float* part;  // [2][parts][C]
  int parts;
};

__device__ __forceinline__ float bwd_gamma(const BwdArgs& a, float g) {
  return a.zc ? __fadd_rn(g, 1.0f) : g;
}

template <int IN, int NV>
__global__ void __launch_bounds__(256) norm_bwd_fast(const BwdArgs a) {
  using T = typename In<IN>::T;
  constexpr int E = vec_elems<IN>();
  __shared__ float red[2][2][32];
  const int64_t C = a.C, nvec = C / E;
  const int tpb = blockDim.x;
  float acc_g[NV * E], acc_b[NV * E];
#pragma unroll
  for (int i = 0; i < NV * E; ++i) acc_g[i] = acc_b[i] = 0.0f;
  int parity = 0;
  // Row r's dy and x; the next row's are loaded before this row's block reduction, so the
  // loads are in flight across the barrier (a row per step left the kernel at half of copy).
  auto load_row = [&](int64_t r, uint4* rdy, uint4* rx) {
    const bool ok = r < a.R;
    const uint4* dyr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) + r * C);
    const uint4* xr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + r * C);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t v = threadIdx.x + int64_t(tpb) * k;
      rdy[k] = ok && v < nvec ? __ldg(dyr + v) : make_uint4(0u, 0u, 0u, 0u);
      rx[k] = ok && v < nvec ? __ldg(xr + v) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  uint4 rdy[NV], rx[NV], ndy[NV], nx[NV];
  load_row(blockIdx.x, rdy, rx);
  for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
    const float mean = a.rms ? 0.0f : a.mean[r], rs = a.rsigma[r];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t v = threadIdx.x + int64_t(tpb) * k;
      if (v >= nvec) continue;
      float fdy[E], fx[E];
      unpack16<IN>(rdy[k], fdy);
      unpack16<IN>(rx[k], fx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float xh = __fmul_rn(__fsub_rn(fx[e], mean), rs);
        const float dyg = __fmul_rn(fdy[e], bwd_gamma(a, __ldg(a.gamma + v * E + e)));
        s1 = __fadd_rn(s1, __fmul_rn(dyg, xh));
        s2 = __fadd_rn(s2, dyg);
        acc_g[k * E + e] = __fadd_rn(acc_g[k * E + e], __fmul_rn(fdy[e], xh));
        acc_b[k * E + e] = __fadd_rn(acc_b[k * E + e], fdy[e]);
      }
    }
    load_row(r + gridDim.x, ndy, nx);
    // Both sums in one pass over the warps.
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if ((threadIdx.x & 31) == 0) {
      red[parity][0][threadIdx.x >> 5] = s1;
      red[parity][1][threadIdx.x >> 5] = s2;
    }
    __syncthreads();
    s1 = 0.0f, s2 = 0.0f;
    for (int w = 0; w < (tpb >> 5); ++w) {
      s1 = __fadd_rn(s1, red[parity][0][w]);
      s2 = __fadd_rn(s2, red[parity][1][w]);
    }
    parity ^= 1;
    const float c1 = __fdiv_rn(s1, float(C)), c2 = a.rms ? 0.0f : __fdiv_rn(s2, float(C));
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t v = threadIdx.x + int64_t(tpb) * k;
      if (v >= nvec) continue;
      float fdy[E], fx[E];
      unpack16<IN>(rdy[k], fdy);
      unpack16<IN>(rx[k], fx);
      uint32_t bits[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float xh = __fmul_rn(__fsub_rn(fx[e], mean), rs);
        const float dyg = __fmul_rn(fdy[e], bwd_gamma(a, __ldg(a.gamma + v * E + e)));
        bits[e] = out_bits<IN>(__fmul_rn(rs, __fsub_rn(dyg, __fadd_rn(__fmul_rn(xh, c1), c2))));
      }
      uint4 o;
      if constexpr (IN == 0)
        o = make_uint4(bits[0], bits[1], bits[2], bits[3]);
      else
        o = make_uint4(bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16),
                       bits[4] | (bits[5] << 16), bits[6] | (bits[7] << 16));
      reinterpret_cast<uint4*>(static_cast<T*>(a.dx) + r * C)[v] = o;
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) rdy[k] = ndy[k], rx[k] = nx[k];
  }
  float* pg = a.part + int64_t(blockIdx.x) * C;
  float* pb = a.part + (int64_t(a.parts) + blockIdx.x) * C;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = threadIdx.x + int64_t(tpb) * k;
    if (v >= nvec) continue;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      pg[v * E + e] = acc_g[k * E + e];
      pb[v * E + e] = acc_b[k * E + e];
    }
  }
}

// Any shape/alignment: partial sums accumulate in the block's own workspace rows.
template <int IN>
__global__ void __launch_bounds__(256) norm_bwd_generic(const BwdArgs a) {
  using T = typename In<IN>::T;
  __shared__ float red[2][2][32];
  const int64_t C = a.C;
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  float* pg = a.part + int64_t(blockIdx.x) * C;
  float* pb = a.part + (int64_t(a.parts) + blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) pg[c] = pb[c] = 0.0f;
  int parity = 0;
  for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
    const float mean = a.rms ? 0.0f : a.mean[r], rs = a.rsigma[r];
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float xh = __fmul_rn(__fsub_rn(In<IN>::f(x[r * C + c]), mean), rs);
      const float fdy = In<IN>::f(dy[r * C + c]);
      const float dyg = __fmul_rn(fdy, bwd_gamma(a, a.gamma[c]));
      s1 = __fadd_rn(s1, __fmul_rn(dyg, xh));
      s2 = __fadd_rn(s2, dyg);
      pg[c] = __fadd_rn(pg[c], __fmul_rn(fdy, xh));
      pb[c] = __fadd_rn(pb[c], fdy);
    }
    s1 = block_sum(s1, red[parity][0]);
    s2 = block_sum(s2, red[parity][1]);
    parity ^= 1;
    const float c1 = __fdiv_rn(s1, float(C)), c2 = a.rms ? 0.0f : __fdiv_rn(s2, float(C));
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float xh = __fmul_rn(__fsub_rn(In<IN>::f(x[r * C + c]), mean), rs);
      const float dyg = __fmul_rn(In<IN>::f(dy[r * C + c]), bwd_gamma(a, a.gamma[c]));
      store_out<IN>(a.dx, r * C + c,
                    __fmul_rn(rs, __fsub_rn(dyg, __fadd_rn(__fmul_rn(xh, c1), c2))));
    }
  }
}

// dgamma / dbeta: each column's partial sums over the parts, in a fixed order. A block takes 32
// columns (a warp's lanes: coalesced rows of parts) and its 8 warps 8 interleaved groups of
// parts, summed in order, then the groups in order: 8x the threads in flight of one thread per
// column (which left the reduce latency-bound, ~36 us for 4096 columns).
constexpr int kReduceGroups = 8;
__global__ void __launch_bounds__(32 * kReduceGroups)
    norm_bwd_reduce(const float* part, int parts, int64_t C, float* dgamma, float* dbeta) {
  __shared__ float sg[kReduceGroups][32], sb[kReduceGroups][32];
  const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  float g = 0.0f, b = 0.0f;
  if (c < C) {
    for (int p = grp; p < parts; p += kReduceGroups) {
      g = __fadd_rn(g, part[int64_t(p) * C + c]);
      b = __fadd_rn(b, part[(int64_t(parts) + p) * C + c]);
    }
  }
  sg[grp][lane] = g;
  sb[grp][lane] = b;
  __syncthreads();
  if (grp == 0 && c < C) {
    float gs = sg[0][lane], bs = sb[0][lane];
#pragma unroll
    for (int k = 1; k < kReduceGroups; ++k) {
      gs = __fadd_rn(gs, sg[k][lane]);
      bs = __fadd_rn(bs, sb[k][lane]);
    }
    dgamma[c] = gs;
    if (dbeta) dbeta[c] = bs;
  }
}

int bwd_parts(int64_t rows) {
  return int(std::max<int64_t>(1, std::min<int64_t>(rows, kBwdParts)));
}

template <int IN, int NV>
Status launch_bwd_fast(const BwdArgs& a, int tpb, cudaStream_t st) {
  norm_bwd_fast<IN, NV><<<a.parts, tpb, 0, st>>>(a);
  return launch_status("norm_bwd_fast");
}

template <int IN>
Status launch_bwd(const BwdArgs& a, float* dgamma, float* dbeta, cudaStream_t st) {
  constexpr int E = vec_elems<IN>();
  const bool vec = a.C % E == 0 && aligned16(a.dy) && aligned16(a.x) && aligned16(a.dx);
  const int64_t nvec = a.C / E;
  // Up to 256 threads per row; NV vectors per thread.
  const int tpb = int(std::min<int64_t>(256, (nvec + 31) / 32 * 32));
  int nv = 0;
  if (vec)
    for (int c : {1, 2, 4})
      if (nvec <= int64_t(tpb) * c) {
        nv = c;
        break;
      }
  Status s;
  switch (nv) {
    case 1: s = launch_bwd_fast<IN, 1>(a, tpb, st); break;
    case 2: s = launch_bwd_fast<IN, 2>(a, tpb, st); break;
    case 4: s = launch_bwd_fast<IN, 4>(a, tpb, st); break;
    default:
      norm_bwd_generic<IN><<<a.parts, 256, 0, st>>>(a);
      s = launch_status("norm_bwd_generic");
  }
  if (!s.ok()) return s;
  if (a.C == 0) return Status::Ok();
  if ((a.C + 31) / 32 > INT32_MAX) return Status::Invalid("norm backward: too many columns");
  norm_bwd_reduce<<<unsigned((a.C + 31) / 32), 32 * kReduceGroups, 0, st>>>(a.part, a.parts, a.C,
                                                                            dgamma, dbeta);
  return launch_status("norm_bwd_reduce");
}

}  // namespace
}  // namespace cuda

size_t norm_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  return size_t(2) * size_t(cuda::bwd_parts(rows)) * size_t(cols > 0 ? cols : 0) * sizeof(float);
}

Status norm_fwd_cuda(const NormFwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cuda::FwdArgs a{};
  a.x = p.x;
  a.gamma = p.gamma;
  a.beta = p.beta;
  a.R = p.rows;
  a.C = p.cols;
  a.rms = p.type == NormType::kRmsNorm;
  a.zc_add = p.zero_centered_gamma ? 1.0f : 0.0f;
  a.e5 = p.q_dtype == DType::kE5M2;
  a.eps = p.epsilon;
  a.mean = p.mean;
  a.rsigma = p.rsigma;
  a.y = p.y;
  const bool fp8 = is_tensor_scaling(p.mode);
  auto run = [&](const cuda::FwdArgs& args) -> Status {
    switch (p.x_dtype) {
      case DType::kF32: return cuda::launch_fwd<0>(args, st);
      case DType::kBF16: return cuda::launch_fwd<1>(args, st);
      default: return cuda::launch_fwd<2>(args, st);
    }
  };
  if (is_fp8_block(p.mode)) {
    // Pass 1: statistics (and y when asked); pass 2: the block cast recomputes y per element.
    const bool x_ok =
        cuda::aligned16(p.x) && cuda::aligned16(p.gamma) && (!p.beta || cuda::aligned16(p.beta));
    if (p.rows > 0 && !cuda::block_cast_fits(p.rows, p.cols, x_ok, p.data, p.colwise_data))
      return Status::Invalid(
          "norm: FP8 block-scaled output needs rows and cols multiples of 16 and aligned buffers");
    if (auto s =
            cuda::api_status(cudaMemsetAsync(p.amax, 0, sizeof(float), st), "norm: memset amax");
        !s.ok())
      return s;
    if (auto s = run(a); !s.ok() || p.rows == 0) return s;
    switch (p.x_dtype) {
      case DType::kF32: return cuda::block_cast<0>(p, st);
      case DType::kBF16: return cuda::block_cast<1>(p, st);
      default: return cuda::block_cast<2>(p, st);
    }
  }
  if (!fp8) return run(a);
  if (auto s = cuda::api_status(cudaMemsetAsync(p.amax, 0, sizeof(float), st), "norm: memset amax");
      !s.ok())
    return s;
  if (cuda::norm_tile_cast_fits(p)) {
    // Pass 1: statistics (and y when asked; current scaling: amax(y)); pass 2: the tile cast.
    cuda::FwdArgs first = a;
    first.amax_out = p.mode == ScalingMode::kCurrentTensor ? p.amax : nullptr;
    if (auto s = run(first); !s.ok()) return s;
    switch (p.x_dtype) {
      case DType::kF32: return cuda::tile_cast<0>(p, st);
      case DType::kBF16: return cuda::tile_cast<1>(p, st);
      default: return cuda::tile_cast<2>(p, st);
    }
  }
  a.si = p.scale_inv;
  a.csi = p.colwise_scale_inv;
  if (p.mode == ScalingMode::kDelayedTensor) {
    a.fp8 = true;
    a.scale = p.scale;
    a.q_row = p.data;
    a.q_col = p.colwise_data;
    a.amax_out = p.amax;
    return run(a);
  }
  // Current scaling: pass 1 = statistics, y and amax; pass 2 = the FP8 copies.
  cuda::FwdArgs first = a;
  first.amax_out = p.amax;
  if (auto s = run(first); !s.ok()) return s;
  a.fp8 = true;
  a.amax_in = p.amax;
  a.q_row = p.data;
  a.q_col = p.colwise_data;
  a.y = nullptr;
  a.mean = nullptr;
  a.rsigma = nullptr;
  return run(a);
}

Status norm_bwd_cuda(const NormBwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  if (p.workspace == nullptr && norm_bwd_workspace_bytes(p.rows, p.cols) > 0)
    return Status::Invalid("norm_bwd: workspace missing");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cuda::BwdArgs a{};
  a.dy = p.dy;
  a.x = p.x;
  a.mean = p.mean;
  a.rsigma = p.rsigma;
  a.gamma = p.gamma;
  a.R = p.rows;
  a.C = p.cols;
  a.rms = p.type == NormType::kRmsNorm;
  a.zc = p.zero_centered_gamma;
  a.dx = p.dx;
  a.part = static_cast<float*>(p.workspace);
  a.parts = cuda::bwd_parts(p.rows);
  switch (p.x_dtype) {
    case DType::kF32: return cuda::launch_bwd<0>(a, p.dgamma, p.dbeta, st);
    case DType::kBF16: return cuda::launch_bwd<1>(a, p.dgamma, p.dbeta, st);
    default: return cuda::launch_bwd<2>(a, p.dgamma, p.dbeta, st);
  }
}

}  // namespace lowbit
