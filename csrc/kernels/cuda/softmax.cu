// CUDA fused softmax (lowbit/softmax.h): scaled, scaled + masked, scaled + causal; backward.
// Fast path: one row per warp held in registers (up to 8 16-byte vectors per lane), warp
// reductions. Other shapes: one row per block re-reading global memory. No host sync.
#include <cmath>

#include "fused_kernel_helpers.cuh"
#include "lowbit/softmax.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kWarps = 8;

struct FwdArgs {
  const void* x;
  void* y;
  int64_t H, Sq, Sk, rows;
  float scale;
  int type;
  const uint8_t* mask;
  int64_t ms[4];
};

// Per-row masking state, computed once per row: the causal limit (keep j <= limit) and the
// mask row.
struct RowMask {
  int64_t limit;
  const uint8_t* m;
  int64_t mstride;
};

__device__ __forceinline__ RowMask row_mask(const FwdArgs& a, int64_t row) {
  RowMask k{INT64_MAX, nullptr, 0};
  if (a.type == int(SoftmaxType::kCausal)) k.limit = row % a.Sq;
  if (a.type == int(SoftmaxType::kMasked)) {
    const int64_t i = row % a.Sq, bh = row / a.Sq, h = bh % a.H, b = bh / a.H;
    k.m = a.mask + b * a.ms[0] + h * a.ms[1] + i * a.ms[2];
    k.mstride = a.ms[3];
  }
  return k;
}

__device__ __forceinline__ bool keep(const RowMask& k, int64_t j) {
  return j <= k.limit && (k.m == nullptr || k.m[j * k.mstride] == 0);
}

// kLog2e, ex2_approx (2^x, MUFU): fused_kernel_helpers.cuh.

// NaN-propagating max (fmaxf drops NaN): a kept NaN makes the row maximum NaN, hence every kept
// output NaN, as on the CPU and in jax.nn.softmax. Masked-out entries never enter it.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <int IN>
__device__ __forceinline__ uint4 pack16(const float* v) {
  if constexpr (IN == 0)
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                      __float_as_uint(v[3]));
  else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = out_bits<IN>(v[2 * j]) | (out_bits<IN>(v[2 * j + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <int IN, int NV>
__global__ void __launch_bounds__(kWarps * 32) softmax_fwd_fast(const FwdArgs a) {
  using T = typename In<IN>::T;
  constexpr int E = 16 / int(sizeof(T));
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t nvec = a.Sk / E;
  const uint4* xr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.Sk);
  const RowMask km = row_mask(a, row);
  float v[NV][E];
  const float ninf = -INFINITY;
  float m = ninf;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t vi = lane + 32 * k;
    uint4 raw = vi < nvec ? __ldg(xr + vi) : make_uint4(0u, 0u, 0u, 0u);
    unpack16<IN>(raw, v[k]);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t j = vi * E + e;
      const bool in = vi < nvec && keep(km, j);
      v[k][e] = in ? __fmul_rn(v[k][e], a.scale) : ninf;
      m = nan_max(m, v[k][e]);
    }
  }
  m = warp_max(m);
  if (m == INFINITY) m = NAN;  // inf - inf: a NaN row, as jax.nn.softmax (and the CPU)
  float s = 0.0f;
  // -inf entries (kept or masked out, which were set to -inf above) give 0, also in a row whose
  // maximum is NaN: -inf acts as a mask. m == -inf: all zeros. m NaN: the other entries NaN.
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      v[k][e] = (m == ninf || v[k][e] == ninf)
                    ? 0.0f
                    : ex2_approx(__fmul_rn(__fsub_rn(v[k][e], m), kLog2e));
      s = __fadd_rn(s, v[k][e]);
    }
  s = warp_sum(s);
  // A fully masked row stays zeros. A NaN row (s NaN) gets inv = 0: its NaN entries stay NaN
  // (NaN * 0) and its -inf / masked-out entries 0.
  const float inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
  uint4* yr = reinterpret_cast<uint4*>(static_cast<T*>(a.y) + row * a.Sk);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t vi = lane + 32 * k;
    if (vi >= nvec) continue;
#pragma unroll
    for (int e = 0; e < E; ++e) v[k][e] = __fmul_rn(v[k][e], inv);
    yr[vi] = pack16<IN>(v[k]);
  }
}

// Block-wide reductions for the generic kernels (all threads get the result).
__device__ float block_reduce(float v, bool is_max, float* red) {
  v = is_max ? warp_max(v) : warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = is_max ? -INFINITY : 0.0f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w)
    r = is_max ? nan_max(r, red[w]) : __fadd_rn(r, red[w]);
  __syncthreads();
  return r;
}

template <int IN>
__global__ void __launch_bounds__(256) softmax_fwd_generic(const FwdArgs a) {
  using T = typename In<IN>::T;
  __shared__ float red[8];
  const T* x = static_cast<const T*>(a.x);
  const float ninf = -INFINITY;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const RowMask km = row_mask(a, row);
    const T* xr = x + row * a.Sk;
    float m = ninf;
    for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x)
      if (keep(km, j)) m = nan_max(m, __fmul_rn(In<IN>::f(xr[j]), a.scale));
    m = block_reduce(m, true, red);
    if (m == INFINITY) m = NAN;  // as the fast kernel
    float s = 0.0f;
    if (m != ninf)
      for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x) {
        const float v = __fmul_rn(In<IN>::f(xr[j]), a.scale);
        if (keep(km, j) && v != ninf)
          s = __fadd_rn(s, ex2_approx(__fmul_rn(__fsub_rn(v, m), kLog2e)));
      }
    const float inv = __fdiv_rn(1.0f, block_reduce(s, false, red));
    for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x) {
      const float v = __fmul_rn(In<IN>::f(xr[j]), a.scale);
      float y = 0.0f;
      // As the fast kernel: -inf entries are 0 (also when m is NaN), the others NaN when m is.
      if (m != ninf && keep(km, j) && v != ninf)
        y = __fmul_rn(ex2_approx(__fmul_rn(__fsub_rn(v, m), kLog2e)), inv);
      store_out<IN>(a.y, row * a.Sk + j, y);
    }
  }
}

struct BwdArgs {
  const void* dy;
  const void* y;
  void* dx;
  int64_t rows, cols;
  float scale;
};

template <int IN, int NV>
__global__ void __launch_bounds__(kWarps * 32) softmax_bwd_fast(const BwdArgs a) {
  using T = typename In<IN>::T;
  constexpr int E = 16 / int(sizeof(T));
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t nvec = a.cols / E;
  const uint4* dyr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) + row * a.cols);
  const uint4* yr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.y) + row * a.cols);
  uint4 rdy[NV], ry[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t vi = lane + 32 * k;
    rdy[k] = vi < nvec ? __ldg(dyr + vi) : make_uint4(0u, 0u, 0u, 0u);
    ry[k] = vi < nvec ? __ldg(yr + vi) : make_uint4(0u, 0u, 0u, 0u);
  }
  float dot = 0.0f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    float fd[E], fy[E];
    unpack16<IN>(rdy[k], fd);
    unpack16<IN>(ry[k], fy);
#pragma unroll
    for (int e = 0; e < E; ++e) dot = __fadd_rn(dot, __fmul_rn(fd[e], fy[e]));
  }
  dot = warp_sum(dot);
  uint4* dxr = reinterpret_cast<uint4*>(static_cast<T*>(a.dx) + row * a.cols);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t vi = lane + 32 * k;
    if (vi >= nvec) continue;
    float fd[E], fy[E], o[E];
    unpack16<IN>(rdy[k], fd);
    unpack16<IN>(ry[k], fy);
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = __fmul_rn(a.scale, __fmul_rn(fy[e], __fsub_rn(fd[e], dot)));
    dxr[vi] = pack16<IN>(o);
  }
}

template <int IN>
__global__ void __launch_bounds__(256) softmax_bwd_generic(const BwdArgs a) {
  using T = typename In<IN>::T;
  __shared__ float red[8];
  const T* dy = static_cast<const T*>(a.dy);
  const T* y = static_cast<const T*>(a.y);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x)
      dot = __fadd_rn(dot,
                      __fmul_rn(In<IN>::f(dy[row * a.cols + j]), In<IN>::f(y[row * a.cols + j])));
    dot = block_reduce(dot, false, red);
    for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
      const int64_t i = row * a.cols + j;
      store_out<IN>(
          a.dx, i,
          __fmul_rn(a.scale, __fmul_rn(In<IN>::f(y[i]), __fsub_rn(In<IN>::f(dy[i]), dot))));
    }
  }
}

// 16-byte vectors per lane for a warp-per-row kernel, 0 when the row needs the generic kernel.
int row_nv(int64_t cols, int elems, bool aligned) {
  if (!aligned || cols % elems) return 0;
  for (int nv : {1, 2, 4, 8})
    if (cols / elems <= 32 * int64_t(nv)) return nv;
  return 0;
}

unsigned generic_grid(int64_t rows) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, 65535)));
}

template <int IN>
Status fwd(const FwdArgs& a, cudaStream_t st) {
  if (a.rows == 0 || a.Sk == 0) return Status::Ok();
  constexpr int E = IN == 0 ? 4 : 8;
  const unsigned blocks = unsigned((a.rows + kWarps - 1) / kWarps);
  const bool big_grid = (a.rows + kWarps - 1) / kWarps > INT32_MAX;
  switch (big_grid ? 0 : row_nv(a.Sk, E, aligned16(a.x) && aligned16(a.y))) {
    case 1: softmax_fwd_fast<IN, 1><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 2: softmax_fwd_fast<IN, 2><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 4: softmax_fwd_fast<IN, 4><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 8: softmax_fwd_fast<IN, 8><<<blocks, kWarps * 32, 0, st>>>(a); break;
    default: softmax_fwd_generic<IN><<<generic_grid(a.rows), 256, 0, st>>>(a);
  }
  return launch_status("softmax_fwd");
}

template <int IN>
Status bwd(const BwdArgs& a, cudaStream_t st) {
  if (a.rows == 0 || a.cols == 0) return Status::Ok();
  constexpr int E = IN == 0 ? 4 : 8;
  const unsigned blocks = unsigned((a.rows + kWarps - 1) / kWarps);
  const bool big_grid = (a.rows + kWarps - 1) / kWarps > INT32_MAX;
  switch (big_grid ? 0 : row_nv(a.cols, E, aligned16(a.dy) && aligned16(a.y) && aligned16(a.dx))) {
    case 1: softmax_bwd_fast<IN, 1><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 2: softmax_bwd_fast<IN, 2><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 4: softmax_bwd_fast<IN, 4><<<blocks, kWarps * 32, 0, st>>>(a); break;
    case 8: softmax_bwd_fast<IN, 8><<<blocks, kWarps * 32, 0, st>>>(a); break;
    default: softmax_bwd_generic<IN><<<generic_grid(a.rows), 256, 0, st>>>(a);
  }
  return launch_status("softmax_bwd");
}

}  // namespace
}  // namespace cuda

Status softmax_fwd_cuda(const SoftmaxFwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cuda::FwdArgs a{};
  a.x = p.x;
  a.y = p.y;
  a.H = p.dims[1];
  a.Sq = p.dims[2];
  a.Sk = p.dims[3];
  a.rows = p.dims[0] * p.dims[1] * p.dims[2];
  a.scale = p.scale;
  a.type = int(p.type);
  a.mask = p.mask;
  for (int i = 0; i < 4; ++i) a.ms[i] = p.mask_strides[i];
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kF32: return cuda::fwd<0>(a, st);
    case DType::kBF16: return cuda::fwd<1>(a, st);
    default: return cuda::fwd<2>(a, st);
  }
}

Status softmax_bwd_cuda(const SoftmaxBwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  cuda::BwdArgs a{p.dy, p.y, p.dx, p.rows, p.cols, p.scale};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kF32: return cuda::bwd<0>(a, st);
    case DType::kBF16: return cuda::bwd<1>(a, st);
    default: return cuda::bwd<2>(a, st);
  }
}

}  // namespace lowbit
