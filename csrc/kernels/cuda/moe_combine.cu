// CUDA MoE combine (lowbit/moe.h): out[t] = sum_j w[t, j] * y[dest[t, j]] and its backward.
// Every kernel is a gather with fixed summation order (no atomics). Row kernels: one block per
// token, the hidden dim across the threads in 8-element vectors (16-byte accesses) when d % 8 == 0
// and the buffers are 16-byte aligned; the scalar kernels are the fallback.
//
// The backward runs by token, not by buffer row: token t reads g[t] once (from HBM; its k
// re-reads hit L1), and for each pick j reads y[dest[t, j]], writes dy[dest[t, j]] = w * g[t]
// and dw[t, j] = <y[dest], g[t]> (a fixed-order block sum). Rows no pair points to (src = P:
// alignment padding, capacity slack) are zeroed by a separate pass over src. This assumes what
// every plan gives: dest and src are inverse maps over the kept pairs.
#include <initializer_list>

#include "device_common.cuh"
#include "lowbit/moe.h"
#include "moe_vec.cuh"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kRowThreads = 128;

// ---- forward ----

template <int IN, int OUT>
__global__ void __launch_bounds__(kRowThreads) combine_fwd_vec_kernel(const MoeCombineParams p) {
  const int64_t nv = p.d / kMoeVec;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int32_t* dt = p.dest + t * p.k;
    const float* wt = p.w + t * p.k;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      float acc[kMoeVec] = {};
#pragma unroll 4
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t r = __ldg(dt + j);
        if (r >= p.rows) continue;  // a dropped pair adds zero
        const float w = __ldg(wt + j);
        float y[kMoeVec];
        load8<IN>(p.y, r * p.d + v * kMoeVec, y);
#pragma unroll
        for (int e = 0; e < kMoeVec; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, y[e]));
      }
      store8<OUT>(p.out, t * p.d + v * kMoeVec, acc);
    }
  }
}

template <int IN, int OUT>
__global__ void combine_fwd_kernel(const MoeCombineParams p) {
  using T = typename In<IN>::T;
  const T* y = static_cast<const T*>(p.y);
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x)
    for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
      float acc = 0.0f;
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t r = p.dest[t * p.k + j];
        if (r < p.rows)
          acc = __fadd_rn(acc, __fmul_rn(p.w[t * p.k + j], In<IN>::f(y[r * p.d + c])));
      }
      store_out<OUT>(p.out, t * p.d + c, acc);
    }
}

// ---- backward ----

// Fixed-order sum over the block (kRowThreads threads); the result in thread 0.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  if (threadIdx.x == 0)
    for (int i = 0; i < kRowThreads / 32; ++i) s = __fadd_rn(s, red[i]);
  __syncthreads();  // red is reused by the next call
  return s;
}

template <int IN, int G>
__global__ void __launch_bounds__(kRowThreads) combine_bwd_vec_kernel(const MoeCombineBwdParams p) {
  __shared__ float red[kRowThreads / 32];
  const int64_t nv = p.d / kMoeVec;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x)
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t q = t * p.k + j, r = __ldg(p.dest + q);
      float dot = 0.0f;
      if (r < p.rows) {  // block-uniform
        const float w = __ldg(p.w + q);
        for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
          float g[kMoeVec], y[kMoeVec], o[kMoeVec];
          load8<G>(p.g, t * p.d + v * kMoeVec, g);
          load8<IN>(p.y, r * p.d + v * kMoeVec, y);
#pragma unroll
          for (int e = 0; e < kMoeVec; ++e) {
            dot = __fadd_rn(dot, __fmul_rn(y[e], g[e]));
            o[e] = __fmul_rn(w, g[e]);
          }
          store8<IN>(p.dy, r * p.d + v * kMoeVec, o);
        }
      }
      dot = block_sum(dot, red);
      if (threadIdx.x == 0) p.dw[q] = dot;
    }
}

// Zero dy's rows that no pair points to (src[r] = P): a warp per row.
template <int IN>
__global__ void zero_unused_rows_kernel(const MoeCombineBwdParams p, bool vec) {
  using T = typename In<IN>::T;
  const int lane = threadIdx.x & 31;
  const int64_t P = p.T * p.k, warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < p.rows;
       r += warps) {
    if (p.src[r] < P) continue;
    T* o = static_cast<T*>(p.dy) + r * p.d;
    if (vec) {
      const int64_t n16 = p.d * int64_t(sizeof(T)) / 16;
      for (int64_t i = lane; i < n16; i += 32)
        reinterpret_cast<uint4*>(o)[i] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t c = lane; c < p.d; c += 32) o[c] = T(0);
    }
  }
}

// Scalar fallback, by buffer row: dy[r] = w[src[r]] * g[src[r] / k].
template <int IN, int G>
__global__ void combine_dy_kernel(const MoeCombineBwdParams p) {
  using TG = typename In<G>::T;
  const TG* g = static_cast<const TG*>(p.g);
  const int64_t P = p.T * p.k;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int32_t q = p.src[r];
    for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
      const float v = q < P ? __fmul_rn(p.w[q], In<G>::f(g[(q / p.k) * p.d + c])) : 0.0f;
      store_out<IN>(p.dy, r * p.d + c, v);
    }
  }
}

// Scalar fallback: a warp per pair.
template <int IN, int G>
__global__ void combine_dw_kernel(const MoeCombineBwdParams p) {
  using T = typename In<IN>::T;
  using TG = typename In<G>::T;
  const T* y = static_cast<const T*>(p.y);
  const TG* g = static_cast<const TG*>(p.g);
  const int lane = threadIdx.x & 31;
  const int64_t q = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (q >= p.T * p.k) return;
  const int64_t r = p.dest[q], t = q / p.k;
  float dot = 0.0f;
  if (r < p.rows)
    for (int64_t c = lane; c < p.d; c += 32)
      dot = __fadd_rn(dot, __fmul_rn(In<IN>::f(y[r * p.d + c]), In<G>::f(g[t * p.d + c])));
  dot = warp_sum(dot);
  if (lane == 0) p.dw[q] = dot;
}

unsigned token_grid(int64_t T) { return unsigned(std::min<int64_t>(T, 65535)); }

bool vectorized(int64_t d, std::initializer_list<const void*> ptrs) {
  if (d % kMoeVec) return false;
  for (const void* q : ptrs)
    if (!aligned16(q)) return false;
  return true;
}

}  // namespace
}  // namespace cuda

using namespace cuda;

Status moe_combine_fwd_cuda(const MoeCombineParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  if (p.T == 0 || p.d == 0) return Status::Ok();
  auto st = static_cast<cudaStream_t>(stream);
  const bool vec = vectorized(p.d, {p.y, p.out});
  with_in(p.y_dtype, [&](auto in) {
    with_in(p.out_dtype, [&](auto out) {
      constexpr int IN = decltype(in)::value, OUT = decltype(out)::value;
      if (vec)
        combine_fwd_vec_kernel<IN, OUT><<<token_grid(p.T), kRowThreads, 0, st>>>(p);
      else
        combine_fwd_kernel<IN, OUT><<<token_grid(p.T), 256, 0, st>>>(p);
    });
  });
  return launch_status("moe_combine_fwd");
}

Status moe_combine_bwd_cuda(const MoeCombineBwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t P = p.T * p.k;
  const bool vec = vectorized(p.d, {p.g, p.y, p.dy});
  with_in(p.y_dtype, [&](auto in) {
    with_in(p.g_dtype, [&](auto g) {
      constexpr int IN = decltype(in)::value, G = decltype(g)::value;
      if (!vec) {
        if (p.rows > 0 && p.d > 0)
          combine_dy_kernel<IN, G><<<unsigned(std::min<int64_t>(p.rows, 65535)), 256, 0, st>>>(p);
        if (P > 0) combine_dw_kernel<IN, G><<<unsigned((P + 7) / 8), 256, 0, st>>>(p);
        return;
      }
      if (p.rows > 0 && p.d > 0)
        zero_unused_rows_kernel<IN><<<grid_for(p.rows, 8), 256, 0, st>>>(p, true);
      if (P > 0) combine_bwd_vec_kernel<IN, G><<<token_grid(p.T), kRowThreads, 0, st>>>(p);
    });
  });
  return launch_status("moe_combine_bwd");
}

}  // namespace lowbit
