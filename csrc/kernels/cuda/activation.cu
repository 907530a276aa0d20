// CUDA activations (lowbit/activation.h), forward and backward, fused with FP8 tensor-scaled
// quantization (rowwise + colwise) and, in the backward, dbias. Stream-ordered, no host sync.
//
// Fast path (H a multiple of one 16-byte vector, aligned buffers): one 64-row x 16-vector tile
// per block of 256 threads, four 16-byte vectors per thread (plus the gate's and dy's). The
// values are computed in registers, rounded to the input dtype, written as y and/or rowwise FP8,
// and the FP8 bytes staged in shared memory so that the colwise copy leaves as 16-byte column
// segments, 64 contiguous bytes per column and store instruction (scattered 8-byte pieces from
// different warps coalesce badly). dbias: per-tile column sums (fixed order) in the workspace,
// then a reduce over tiles in tile order: deterministic. Current scaling runs the kernel twice:
// amax only, then the outputs. Other shapes: a generic elementwise kernel.
// The tile kernel is specialised per activation (no per-element dispatch); exp and 1/x use the
// MUFU approximations and the bf16/f16 rounding the hardware cvt (round to nearest even). Float
// ops are explicit intrinsics, and the generic kernel calls the same templated functions, so
// every launch computes a value with identical arithmetic whatever outputs it writes: the fused
// FP8 copies equal lowbit.quantize of the unfused output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_cast.cuh"
#include "fused_kernel_helpers.cuh"
#include "lowbit/activation.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kRows = 64;  // tile rows
constexpr int kVecs = 16;  // tile width in 16-byte vectors
constexpr int kActThreads = 256;
constexpr int kPer = kRows * kVecs / kActThreads;  // vectors per thread

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kQuickGelu = 1.702f;

// 1 / (1 + exp(-z)) (ex2_approx / rcp_approx: fused_kernel_helpers.cuh); exact limits 0 and 1 for
// large |z|, never NaN for finite z.
__device__ __forceinline__ float sigmoid(float z) {
  return rcp_approx(__fadd_rn(1.0f, ex2_approx(__fmul_rn(-kLog2e, z))));
}
__device__ __forceinline__ float relu_f(float x) { return x < 0.0f ? 0.0f : x; }

// Value and derivative of activation ACT at x. The tanh-form gelu is evaluated as
// x * sigmoid(2u) (= 0.5 x (1 + tanh u)), which does not cancel in the tails. Inlined into each
// kernel; the compiler drops the derivative where it is unused.
template <int ACT>
__device__ __forceinline__ void act_vg(float x, float* v, float* g) {
  switch (ActKind(ACT)) {
    case ActKind::kLinear: *v = x, *g = 1.0f; return;
    case ActKind::kGeluTanh: {
      const float t = __fmul_rn(x, x);
      const float s = sigmoid(
          __fmul_rn(x, __fmaf_rn(t, 2.0f * kSqrt2OverPi * kGeluCubic, 2.0f * kSqrt2OverPi)));
      const float dz = __fmaf_rn(t, 6.0f * kSqrt2OverPi * kGeluCubic, 2.0f * kSqrt2OverPi);
      *v = __fmul_rn(x, s);
      *g = __fmaf_rn(__fmul_rn(__fmul_rn(x, s), __fsub_rn(1.0f, s)), dz, s);
      return;
    }
    case ActKind::kGeluExact: {
      const float p = __fmul_rn(0.5f, __fadd_rn(1.0f, erff(__fmul_rn(x, kInvSqrt2))));
      *v = __fmul_rn(x, p);
      *g = __fmaf_rn(__fmul_rn(x, kInvSqrt2Pi),
                     ex2_approx(__fmul_rn(__fmul_rn(-0.5f * kLog2e, x), x)), p);
      return;
    }
    case ActKind::kRelu: *v = relu_f(x), *g = x > 0.0f ? 1.0f : 0.0f; return;
    case ActKind::kSilu:
    case ActKind::kQuickGelu: {
      const float k = ACT == int(ActKind::kSilu) ? 1.0f : kQuickGelu;
      const float s = sigmoid(__fmul_rn(k, x));
      *v = __fmul_rn(x, s);
      *g = __fmaf_rn(__fmul_rn(__fmul_rn(k, x), s), __fsub_rn(1.0f, s), s);
      return;
    }
    case ActKind::kSquaredRelu: {
      const float r = relu_f(x);
      *v = __fmul_rn(r, r), *g = __fmul_rn(2.0f, r);
      return;
    }
  }
}

struct Args {
  const void* x;   // (R, gated ? 2H : H)
  const void* dy;  // backward: (R, H)
  int64_t R, H;
  int act;
  bool e5;
  void* hp;        // y (R, H) or dx (R, W), input dtype
  uint8_t* q_row;  // (R, H) or (R, W)
  uint8_t* q_col;  // (H, R) or (W, R)
  bool fp8;
  const float* scale;
  const float* amax_in;
  float* si;
  float* csi;
  float* amax_out;
  float* dbias_part;  // [tiles_r][W]
  bool pow2;          // FP8 block scaling: power-of-two scales, amax floor
  float eps;
};

// The NO (1 or 2) output values at one position; forward: y; backward: dx (gated: da, db).
template <int ACT, bool BWD, bool GATED>
__device__ __forceinline__ void values_at(float xa, float xb, float dy, float* out) {
  float v, g;
  act_vg<ACT>(xa, &v, &g);
  if constexpr (!BWD) {
    out[0] = GATED ? __fmul_rn(v, xb) : v;
  } else if constexpr (GATED) {
    out[0] = __fmul_rn(__fmul_rn(dy, xb), g);
    out[1] = __fmul_rn(dy, v);
  } else {
    out[0] = __fmul_rn(dy, g);
  }
}

template <int IN, bool BWD, bool GATED, int ACT>
__global__ void __launch_bounds__(kActThreads) act_tile_kernel(const Args a) {
  using T = typename In<IN>::T;
  constexpr int E = 16 / int(sizeof(T));
  constexpr int TC = kVecs * E;  // tile columns
  constexpr int NO = (BWD && GATED) ? 2 : 1;
  constexpr int NQ = TC / 4;               // column quads
  constexpr int RG = kActThreads / kVecs;  // row groups of the row phase
  __shared__ __align__(16) uint8_t qt[NO][kRows][TC];
  __shared__ float dsum[BWD ? NO : 1][BWD ? RG : 1][BWD ? TC : 1];
  __shared__ float red[kActThreads / 32];

  const int t = threadIdx.x;
  const int64_t R = a.R, H = a.H, W = GATED ? 2 * H : H;
  const int64_t xw = GATED ? 2 * H : H;  // x row length
  const int64_t ow = BWD ? W : H;        // output row length
  const int64_t r0 = int64_t(blockIdx.y) * kRows, c0 = int64_t(blockIdx.x) * TC;
  const int vc = t % kVecs;
  const int64_t c = c0 + int64_t(vc) * E;
  const float scale = fused_launch_scale<true>(a);

  uint4 rx[kPer], rg[kPer], rd[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = r0 + t / kVecs + RG * i;
    const bool ok = r < R && c < H;
    const T* xr = static_cast<const T*>(a.x) + r * xw + c;
    rx[i] = ok ? __ldg(reinterpret_cast<const uint4*>(xr)) : make_uint4(0u, 0u, 0u, 0u);
    rg[i] =
        (GATED && ok) ? __ldg(reinterpret_cast<const uint4*>(xr + H)) : make_uint4(0u, 0u, 0u, 0u);
    rd[i] = (BWD && ok)
                ? __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) + r * H + c))
                : make_uint4(0u, 0u, 0u, 0u);
  }

  float amax = 0.0f;
  float colsum[NO][E];
#pragma unroll
  for (int o = 0; o < NO; ++o)
#pragma unroll
    for (int e = 0; e < E; ++e) colsum[o][e] = 0.0f;

#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int lr = t / kVecs + RG * i;
    const int64_t r = r0 + lr;
    if (r >= R || c >= H) continue;
    float fx[E], fg[E], fd[E];
    unpack16<IN>(rx[i], fx);
    if constexpr (GATED) unpack16<IN>(rg[i], fg);
    if constexpr (BWD) unpack16<IN>(rd[i], fd);
    float v[NO][E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float o2[NO];
      values_at<ACT, BWD, GATED>(fx[e], GATED ? fg[e] : 0.0f, BWD ? fd[e] : 0.0f, o2);
#pragma unroll
      for (int o = 0; o < NO; ++o) v[o][e] = o2[o];
    }
#pragma unroll
    for (int o = 0; o < NO; ++o) {
      const int64_t oc = c + o * H;  // output column
      float yr[E];
      const uint4 bits = round_vec<IN, E>(v[o], yr);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        amax = fmaxf(amax, fabsf(yr[e]));
        if constexpr (BWD) colsum[o][e] = __fadd_rn(colsum[o][e], yr[e]);
      }
      if (a.hp) *reinterpret_cast<uint4*>(static_cast<T*>(a.hp) + r * ow + oc) = bits;
      if (a.fp8) {
        uint32_t w[E / 4];
        if (a.e5)
          fp8_vec<kFmtE5M2, E>(yr, scale, w);
        else
          fp8_vec<kFmtE4M3, E>(yr, scale, w);
        if constexpr (E == 8) {
          const uint2 p = make_uint2(w[0], w[1]);
          if (a.q_row) *reinterpret_cast<uint2*>(a.q_row + r * ow + oc) = p;
          if (a.q_col) *reinterpret_cast<uint2*>(&qt[o][lr][vc * E]) = p;
        } else {
          if (a.q_row) *reinterpret_cast<uint32_t*>(a.q_row + r * ow + oc) = w[0];
          if (a.q_col) *reinterpret_cast<uint32_t*>(&qt[o][lr][vc * E]) = w[0];
        }
      }
    }
  }
  if (a.amax_out) block_amax_to(amax, red, a.amax_out);

  if constexpr (BWD) {
    if (a.dbias_part) {  // this tile's column sums: the row groups added in order
#pragma unroll
      for (int o = 0; o < NO; ++o)
#pragma unroll
        for (int e = 0; e < E; ++e) dsum[o][t / kVecs][vc * E + e] = colsum[o][e];
      __syncthreads();
      if (t < NO * TC) {
        const int o = t / TC, col = t % TC;
        float s = 0.0f;
        for (int g = 0; g < RG; ++g) s = __fadd_rn(s, dsum[o][g][col]);
        if (c0 + col < H) a.dbias_part[int64_t(blockIdx.y) * W + o * H + c0 + col] = s;
      }
    }
  }

  if (a.fp8 && a.q_col) {
    // Column phase: a task is 4 columns x 16 rows (read as 16 words of 4 bytes, transposed with
    // byte_perm), stored as four 16-byte column segments; the 4 lanes of a quad take the tile's
    // 4 row groups, so each store instruction writes 64 contiguous bytes of 8 columns.
    static_assert(kRows == 64 && NQ * (kRows / 16) <= kActThreads, "column-phase mapping");
    __syncthreads();
    if (t < NQ * (kRows / 16)) {
      const int q = t / (kRows / 16), g = t % (kRows / 16);
      const int64_t rs = r0 + int64_t(g) * 16;
      const int rows = rs >= R ? 0 : (R - rs < 16 ? int(R - rs) : 16);
#pragma unroll
      for (int o = 0; o < NO; ++o) {
        uint32_t w[16];
#pragma unroll
        for (int rr = 0; rr < 16; ++rr)
          w[rr] = *reinterpret_cast<const uint32_t*>(&qt[o][g * 16 + rr][4 * q]);
        store_colwise_16x4<true>(w, a.q_col, R, c0 + 4 * q, H, o * H, rs, rows);
      }
    }
  }
}

// Runtime activation -> the same templated arithmetic as the tile kernel.
template <bool BWD, bool GATED>
__device__ void values_dyn(int act, float xa, float xb, float dy, float* out) {
  switch (ActKind(act)) {
    case ActKind::kLinear: return values_at<0, BWD, GATED>(xa, xb, dy, out);
    case ActKind::kGeluTanh: return values_at<1, BWD, GATED>(xa, xb, dy, out);
    case ActKind::kGeluExact: return values_at<2, BWD, GATED>(xa, xb, dy, out);
    case ActKind::kRelu: return values_at<3, BWD, GATED>(xa, xb, dy, out);
    case ActKind::kSilu: return values_at<4, BWD, GATED>(xa, xb, dy, out);
    case ActKind::kQuickGelu: return values_at<5, BWD, GATED>(xa, xb, dy, out);
    default: return values_at<6, BWD, GATED>(xa, xb, dy, out);
  }
}

// Any shape/alignment: one thread per output position.
template <int IN, bool BWD, bool GATED>
__global__ void __launch_bounds__(256) act_generic_kernel(const Args a) {
  using T = typename In<IN>::T;
  constexpr int NO = (BWD && GATED) ? 2 : 1;
  __shared__ float red[8];
  const int64_t R = a.R, H = a.H, W = GATED ? 2 * H : H;
  const int64_t xw = GATED ? 2 * H : H, ow = BWD ? W : H;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const float scale = fused_launch_scale<true>(a);
  float amax = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < R * H;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, c = i - r * H;
    float v[NO];
    values_dyn<BWD, GATED>(a.act, In<IN>::f(x[r * xw + c]),
                           GATED ? In<IN>::f(x[r * xw + H + c]) : 0.0f,
                           BWD ? In<IN>::f(dy[r * H + c]) : 0.0f, v);
#pragma unroll
    for (int o = 0; o < NO; ++o) {
      const int64_t oc = c + o * H;
      uint32_t bits;
      const float yr = round1<IN>(v[o], &bits);
      amax = fmaxf(amax, fabsf(yr));
      if (a.hp) {
        if constexpr (IN == 0)
          static_cast<float*>(a.hp)[r * ow + oc] = yr;
        else
          static_cast<uint16_t*>(a.hp)[r * ow + oc] = uint16_t(bits);
      }
      if (a.fp8) {
        const float sv = __fmul_rn(yr, scale);
        const uint8_t code = uint8_t(enc1(sv, a.e5));
        if (a.q_row) a.q_row[r * ow + oc] = code;
        if (a.q_col) a.q_col[oc * R + r] = code;
      }
    }
  }
  if (a.amax_out) block_amax_to(amax, red, a.amax_out);
}

// dbias of the generic path: one thread per dx column, rows in order.
template <int IN, bool GATED>
__global__ void dbias_generic_kernel(const Args a, void* dbias) {
  using T = typename In<IN>::T;
  const int64_t R = a.R, H = a.H, W = GATED ? 2 * H : H;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < W;
       w += int64_t(gridDim.x) * blockDim.x) {
    const int o = w >= H ? 1 : 0;
    const int64_t c = w - o * H;
    float s = 0.0f;
    for (int64_t r = 0; r < R; ++r) {
      float v[2];
      values_dyn<true, GATED>(a.act, In<IN>::f(x[r * W + c]),
                              GATED ? In<IN>::f(x[r * W + H + c]) : 0.0f, In<IN>::f(dy[r * H + c]),
                              v);
      uint32_t bits;
      s = __fadd_rn(s, round1<IN>(v[o], &bits));
    }
    store_out<IN>(dbias, w, s);
  }
}

template <int IN>
__global__ void dbias_reduce_kernel(const float* part, int64_t tiles, int64_t W, void* out) {
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < W;
       w += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t t = 0; t < tiles; ++t) s = __fadd_rn(s, part[t * W + w]);
    store_out<IN>(out, w, s);
  }
}

// The tile kernel needs whole 16-byte vectors and aligned buffers (XLA's always are).
template <int IN>
bool tile_path(const Args& a) {
  constexpr int E = 16 / (IN == 0 ? 4 : 2);
  return a.H % E == 0 && aligned16(a.x) && (!a.dy || aligned16(a.dy)) &&
         (!a.hp || aligned16(a.hp)) &&
         (!a.q_row || (reinterpret_cast<uintptr_t>(a.q_row) & 7u) == 0) &&
         (!a.q_col || aligned16(a.q_col)) && (a.R + kRows - 1) / kRows <= 65535;
}

template <int IN, bool BWD, bool GATED, int ACT>
Status launch_tile(const Args& a, cudaStream_t st) {
  constexpr int E = 16 / (IN == 0 ? 4 : 2);
  const int64_t tc = (a.H + kVecs * E - 1) / (kVecs * E), tr = (a.R + kRows - 1) / kRows;
  const dim3 grid(unsigned(std::max<int64_t>(tc, 1)), unsigned(std::max<int64_t>(tr, 1)));
  act_tile_kernel<IN, BWD, GATED, ACT><<<grid, kActThreads, 0, st>>>(a);
  return launch_status("act_tile_kernel");
}

template <int IN, bool BWD, bool GATED>
Status launch_one(const Args& a, bool tile, cudaStream_t st) {
  if (tile) {
    switch (ActKind(a.act)) {
      case ActKind::kLinear: return launch_tile<IN, BWD, GATED, 0>(a, st);
      case ActKind::kGeluTanh: return launch_tile<IN, BWD, GATED, 1>(a, st);
      case ActKind::kGeluExact: return launch_tile<IN, BWD, GATED, 2>(a, st);
      case ActKind::kRelu: return launch_tile<IN, BWD, GATED, 3>(a, st);
      case ActKind::kSilu: return launch_tile<IN, BWD, GATED, 4>(a, st);
      case ActKind::kQuickGelu: return launch_tile<IN, BWD, GATED, 5>(a, st);
      default: return launch_tile<IN, BWD, GATED, 6>(a, st);
    }
  }
  act_generic_kernel<IN, BWD, GATED><<<grid_for(a.R * a.H, 256, 8192), 256, 0, st>>>(a);
  return launch_status("act_generic_kernel");
}

template <int IN, bool BWD>
Status launch(const Args& a, bool gated, bool tile, cudaStream_t st) {
  return gated ? launch_one<IN, BWD, true>(a, tile, st) : launch_one<IN, BWD, false>(a, tile, st);
}

// The block cast's Load (block_cast.cuh) for the block-scaled copies of the forward's y (R, H)
// or the backward's dx (R, W): each output chunk from its chunks of x (and the gate, and dy),
// through values_at and round_vec as in the tile kernel, so the values are the same bits.
template <bool BWD, bool GATED>
struct ActBlockLoad {
  static constexpr int kLoads = 1 + (GATED ? 1 : 0) + (BWD ? 1 : 0);
  static constexpr int kMinBlocks = BWD && GATED ? 1 : 2;  // 3 (or 2) source chunks per chunk
  struct Shared {};
  const void* x;
  const void* dy;
  int64_t H;
  int act;

  // Backward, gated: output columns [H, 2H) are db, computed at column gc - H of the inputs.
  __device__ __forceinline__ int half(int64_t gc) const { return BWD && GATED && gc >= H ? 1 : 0; }

  template <int IN>
  __device__ __forceinline__ void fetch(int64_t gr, int64_t gc, uint4 (&src)[kLoads]) const {
    using T = typename In<IN>::T;
    const int64_t c = gc - half(gc) * H, xw = GATED ? 2 * H : H;
    const T* xr = static_cast<const T*>(x) + gr * xw + c;
    src[0] = __ldg(reinterpret_cast<const uint4*>(xr));
    if constexpr (GATED) src[1] = __ldg(reinterpret_cast<const uint4*>(xr + H));
    if constexpr (BWD)
      src[kLoads - 1] =
          __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(dy) + gr * H + c));
  }
  __device__ __forceinline__ void stage(Shared&, int64_t, int64_t, int64_t, int64_t, int) const {}

  template <int IN, int ACT>
  __device__ __forceinline__ uint4 chunk(const uint4 (&src)[kLoads], int o) const {
    constexpr int E = 16 / int(sizeof(typename In<IN>::T));
    float fx[E], fg[E], fd[E], v[E], yr[E];
    unpack16<IN>(src[0], fx);
    if constexpr (GATED) unpack16<IN>(src[1], fg);
    if constexpr (BWD) unpack16<IN>(src[kLoads - 1], fd);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float o2[2];
      values_at<ACT, BWD, GATED>(fx[e], GATED ? fg[e] : 0.0f, BWD ? fd[e] : 0.0f, o2);
      v[e] = o2[o];
    }
    return round_vec<IN, E>(v, yr);
  }
  template <int IN>
  __device__ __forceinline__ uint4 apply(const Shared&, const uint4 (&src)[kLoads], int64_t gc, int,
                                         int) const {
    const int o = half(gc);
    switch (ActKind(act)) {  // uniform over the launch
      case ActKind::kLinear: return chunk<IN, 0>(src, o);
      case ActKind::kGeluTanh: return chunk<IN, 1>(src, o);
      case ActKind::kGeluExact: return chunk<IN, 2>(src, o);
      case ActKind::kRelu: return chunk<IN, 3>(src, o);
      case ActKind::kSilu: return chunk<IN, 4>(src, o);
      case ActKind::kQuickGelu: return chunk<IN, 5>(src, o);
      default: return chunk<IN, 6>(src, o);
    }
  }
};

// FP8 block scaling: the block cast writes the copies and amax (one read of the inputs) and, for
// dbias, each 128-row tile's column sums of dx into the workspace (no second read of dy and x),
// summed over the tiles by launch_dbias_reduce: float32 in a fixed order, deterministic, within
// float32 accumulation-order bounds of lowbit.quantize_dbias (not its bits). y / dx in x's
// dtype, when asked for too, come from the elementwise kernels. The workspace
// (act_bwd_workspace_bytes: 64-row tiles) holds the 128-row tiles' partials.
// Python sends only whole 16x16 tiles (lowbit.ops.fused_quantize).
static_assert(kRows <= kBlk, "the workspace's tile rows must cover the block cast's");

template <int IN, bool BWD, bool GATED>
Status run_block_one(Args a, bool two_d, float* amax, void* dbias, void* ws, cudaStream_t st) {
  const int64_t R = a.R, W = GATED ? 2 * a.H : a.H, OC = BWD ? W : a.H;
  const bool fits = aligned16(a.x) && (!BWD || aligned16(a.dy)) &&
                    block_cast_fits(R, OC, true, a.q_row, a.q_col) && a.H % 16 == 0;
  if (R > 0 && OC > 0 && !fits)
    return Status::Invalid(
        "activation: FP8 block-scaled output needs rows and columns multiples of 16 and aligned "
        "buffers");
  if (auto s = api_status(cudaMemsetAsync(amax, 0, sizeof(float), st), "activation: memset amax");
      !s.ok())
    return s;
  const bool with_dbias = BWD && dbias && W > 0;
  if (with_dbias && R > 0 && ws == nullptr)
    return Status::Invalid("activation_bwd: workspace missing");
  if (R > 0 && OC > 0) {
    BlockCastArgs c{};
    c.R = R;
    c.C = OC;
    c.q_row = a.q_row;
    c.s_row = a.q_row ? a.si : nullptr;
    c.q_col = a.q_col;
    c.s_col = a.q_col ? a.csi : nullptr;
    c.eps = a.eps;
    c.pow2 = a.pow2;
    c.amax_out = amax;
    c.dbias_part = with_dbias ? static_cast<float*>(ws) : nullptr;
    const ActBlockLoad<BWD, GATED> load{a.x, a.dy, a.H, a.act};
    Status s;
    if constexpr (BWD) {
      if (with_dbias)
        s = a.e5 ? launch_fp8_block_cast<IN, kFmtE5M2, true>(c, two_d, load, st)
                 : launch_fp8_block_cast<IN, kFmtE4M3, true>(c, two_d, load, st);
    }
    if (!with_dbias)
      s = a.e5 ? launch_fp8_block_cast<IN, kFmtE5M2>(c, two_d, load, st)
               : launch_fp8_block_cast<IN, kFmtE4M3>(c, two_d, load, st);
    if (!s.ok()) return s;
  }
  if (a.hp) {  // the unquantized output as well: the elementwise kernels, nothing quantized
    Args hp = a;
    hp.q_row = hp.q_col = nullptr;
    hp.fp8 = false;
    hp.amax_out = nullptr;
    if (auto s = launch_one<IN, BWD, GATED>(hp, tile_path<IN>(hp), st); !s.ok()) return s;
  }
  if (!with_dbias) return Status::Ok();
  return launch_dbias_reduce<IN>(static_cast<const float*>(ws), R, W, dbias, st);
}

template <int IN, bool BWD>
Status run_block(const Args& a, bool gated, bool two_d, float* amax, void* dbias, void* ws,
                 cudaStream_t st) {
  return gated ? run_block_one<IN, BWD, true>(a, two_d, amax, dbias, ws, st)
               : run_block_one<IN, BWD, false>(a, two_d, amax, dbias, ws, st);
}

// Runs the (two-pass for current scaling) sequence for one direction; `dbias` optional (bwd).
template <int IN, bool BWD>
Status run(Args a, bool gated, ScalingMode mode, float* amax, void* dbias, void* workspace,
           cudaStream_t st) {
  if (is_fp8_block(mode))
    return run_block<IN, BWD>(a, gated, mode == ScalingMode::kBlock2d, amax, dbias, workspace, st);
  const bool tile = tile_path<IN>(a);
  const int64_t W = gated ? 2 * a.H : a.H, tiles_r = (a.R + kRows - 1) / kRows;
  const bool dbias_tiles = dbias && tile && a.R > 0 && a.H > 0;
  if (dbias_tiles && workspace == nullptr)
    return Status::Invalid("activation_bwd: workspace missing");
  if (is_tensor_scaling(mode)) {
    if (auto s = api_status(cudaMemsetAsync(amax, 0, sizeof(float), st), "activation: memset amax");
        !s.ok())
      return s;
    if (mode == ScalingMode::kCurrentTensor) {
      Args first = a;  // amax only
      first.hp = nullptr;
      first.q_row = first.q_col = nullptr;
      first.fp8 = false;
      first.amax_out = amax;
      if (auto s = launch<IN, BWD>(first, gated, tile, st); !s.ok()) return s;
      a.amax_in = amax;
    } else {
      a.amax_out = amax;
    }
    a.fp8 = true;
  }
  a.dbias_part = dbias_tiles ? static_cast<float*>(workspace) : nullptr;
  if (auto s = launch<IN, BWD>(a, gated, tile, st); !s.ok()) return s;
  if (!dbias || W == 0) return Status::Ok();
  if (dbias_tiles) {
    dbias_reduce_kernel<IN><<<grid_for(W, 256), 256, 0, st>>>(a.dbias_part, tiles_r, W, dbias);
    return launch_status("dbias_reduce_kernel");
  }
  if (gated)
    dbias_generic_kernel<IN, true><<<grid_for(W, 256), 256, 0, st>>>(a, dbias);
  else
    dbias_generic_kernel<IN, false><<<grid_for(W, 256), 256, 0, st>>>(a, dbias);
  return launch_status("dbias_generic_kernel");
}

template <bool BWD>
Status dispatch(DType dt, const Args& a, bool gated, ScalingMode mode, float* amax, void* dbias,
                void* ws, cudaStream_t st) {
  switch (dt) {
    case DType::kF32: return run<0, BWD>(a, gated, mode, amax, dbias, ws, st);
    case DType::kBF16: return run<1, BWD>(a, gated, mode, amax, dbias, ws, st);
    default: return run<2, BWD>(a, gated, mode, amax, dbias, ws, st);
  }
}

}  // namespace
}  // namespace cuda

size_t act_bwd_workspace_bytes(int64_t rows, int64_t cols, bool gated, bool dbias) {
  if (!dbias || rows <= 0 || cols <= 0) return 0;
  return size_t((rows + cuda::kRows - 1) / cuda::kRows) * size_t(gated ? 2 * cols : cols) *
         sizeof(float);
}

Status act_fwd_cuda(const ActFwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cuda::Args a{};
  a.x = p.x;
  a.R = p.rows;
  a.H = p.cols;
  a.act = int(p.act);
  a.e5 = p.q_dtype == DType::kE5M2;
  a.hp = p.y;
  a.q_row = p.data;
  a.q_col = p.colwise_data;
  a.scale = p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr;
  a.si = p.scale_inv;
  a.csi = p.colwise_scale_inv;
  a.pow2 = p.power_2_scale;
  a.eps = p.amax_epsilon;
  return cuda::dispatch<false>(p.x_dtype, a, p.gated, p.mode, p.amax, nullptr, nullptr,
                               static_cast<cudaStream_t>(stream));
}

Status act_bwd_cuda(const ActBwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cuda::Args a{};
  a.x = p.x;
  a.dy = p.dy;
  a.R = p.rows;
  a.H = p.cols;
  a.act = int(p.act);
  a.e5 = p.q_dtype == DType::kE5M2;
  a.hp = p.dx;
  a.q_row = p.data;
  a.q_col = p.colwise_data;
  a.scale = p.mode == ScalingMode::kDelayedTensor ? p.scale : nullptr;
  a.si = p.scale_inv;
  a.csi = p.colwise_scale_inv;
  a.pow2 = p.power_2_scale;
  a.eps = p.amax_epsilon;
  return cuda::dispatch<true>(p.x_dtype, a, p.gated, p.mode, p.amax, p.dbias, p.workspace,
                              static_cast<cudaStream_t>(stream));
}

}  // namespace lowbit
