// CUDA MoE kernels (lowbit/moe.h): the router (one warp per token, the experts spread over the
// lanes), the dispatch plan (a stable counting sort in three small kernels), the permute (a
// gather, or a gather that quantizes to FP8 and writes the transposed copy from one tile in
// shared memory); the weighted combine and its backward are in moe_combine.cu. No host sync: every
// size stays on the device.
#include "../common/moe_math.h"
#include "device_common.cuh"
#include "lowbit/moe.h"
#include "moe_vec.cuh"

namespace lowbit {
namespace cuda {
namespace {

// ---- router: warp per token, lane l holds experts l, l + 32, ... (V per lane) ----

// Warp arg-best of (value, index) by moe_before; index -1 = no candidate.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (oi >= 0 && (i < 0 || moe_before(ov, oi, v, i))) {
      v = ov;
      i = oi;
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// softmax over the lanes' valid entries (z[i] for j = lane + 32 i < E) into p.
template <int V>
__device__ __forceinline__ void warp_softmax(const float* z, float* p, int E, int lane) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (lane + 32 * i < E) m = fmaxf(m, z[i]);
  m = warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    p[i] = lane + 32 * i < E ? expf(z[i] - m) : 0.0f;
    s += p[i];
  }
  s = warp_sum(s);
#pragma unroll
  for (int i = 0; i < V; ++i) p[i] = p[i] / s;
}

// Entry b (lane b & 31, slot b >> 5) of the per-lane array v, broadcast to the warp.
template <int V>
__device__ __forceinline__ float warp_entry(const float* v, int b) {
  float x = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (i == (b >> 5)) x = v[i];
  return __shfl_sync(kFull, x, b & 31);
}

// The best candidate in `mask` (bit i: entry lane + 32 i), removed from the mask.
template <int V>
__device__ __forceinline__ int warp_pick(const float* c, uint32_t& mask, int lane) {
  float bv = 0.0f;
  int bi = -1;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (((mask >> i) & 1u) && (bi < 0 || moe_before(c[i], lane + 32 * i, bv, bi))) {
      bv = c[i];
      bi = lane + 32 * i;
    }
  warp_best(bv, bi);
  if (bi >= 0 && (bi & 31) == lane) mask &= ~(1u << (bi >> 5));
  return bi;
}

template <int V>
__global__ void router_fwd_kernel(const MoeRouterParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= p.T) return;
  const int E = int(p.E), k = p.topk;
  const bool post = p.score == MoeScore::kSoftmax && !p.pre_softmax;
  float z[V], s[V], c[V];
  uint32_t valid = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = lane + 32 * i;
    z[i] = j < E ? p.logits[t * E + j] : 0.0f;
    if (j < E) valid |= 1u << i;
  }
  if (p.score == MoeScore::kSoftmax) {
    if (!post) warp_softmax<V>(z, s, E, lane);
#pragma unroll
    for (int i = 0; i < V; ++i) c[i] = post ? z[i] : s[i];
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = lane + 32 * i;
      s[i] = moe_score(z[i], p.score);
      c[i] = p.bias && j < E ? s[i] + p.bias[j] : s[i];
    }
  }
  uint32_t allowed = valid;
  if (p.num_groups > 0) {
    const int G = p.num_groups, per = E / G, n = k / p.group_topk;
    uint64_t chosen_groups = 0;
    float gbest = 0.0f;
    int gi = -1;
    // Group scores one group at a time (warp-uniform), the best group_topk kept as a bit mask.
    float gscore[kMoeMaxGroups];
    for (int g = 0; g < G; ++g) {
      uint32_t in = 0;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int j = lane + 32 * i;
        if (j < E && j / per == g) in |= 1u << i;
      }
      float sum = 0.0f;
      for (int r = 0; r < n; ++r) {
        const int b = warp_pick<V>(c, in, lane);
        sum += warp_entry<V>(c, b);
      }
      gscore[g] = sum;
    }
    for (int r = 0; r < p.group_topk; ++r) {
      gi = -1;
      for (int g = 0; g < G; ++g)
        if (!((chosen_groups >> g) & 1ull) && (gi < 0 || moe_before(gscore[g], g, gbest, gi))) {
          gbest = gscore[g];
          gi = g;
        }
      chosen_groups |= 1ull << gi;
    }
    allowed = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = lane + 32 * i;
      if (j < E && ((chosen_groups >> (j / per)) & 1ull)) allowed |= 1u << i;
    }
  }
  // Top-k: k warp picks; lane i keeps pick i (k <= 64: lanes 0..31 twice).
  int mine[2] = {0, 0};
  float val[2] = {0.0f, 0.0f};
  for (int r = 0; r < k; ++r) {
    const int b = warp_pick<V>(c, allowed, lane);
    const float vb = warp_entry<V>(post ? z : s, b);  // the pick's logit or score
    if ((r & 31) == lane) {
      mine[r >> 5] = b;
      val[r >> 5] = vb;
    }
  }
  // Weights over the k picks held by lanes r & 31 (slot r >> 5).
  float w[2];
  if (post) {
    float m = -INFINITY;
    for (int h = 0; h < 2; ++h)
      if (lane + 32 * h < k) m = fmaxf(m, val[h]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int h = 0; h < 2; ++h) {
      w[h] = lane + 32 * h < k ? expf(val[h] - m) : 0.0f;
      sum += w[h];
    }
    sum = warp_sum(sum);
    for (int h = 0; h < 2; ++h) w[h] = w[h] / sum;
  } else {
    float sum = 0.0f;
    for (int h = 0; h < 2; ++h) {
      w[h] = lane + 32 * h < k ? val[h] : 0.0f;
      sum += w[h];
    }
    sum = warp_sum(sum);
    if (p.score != MoeScore::kSoftmax && k > 1)
      for (int h = 0; h < 2; ++h) w[h] = w[h] / (sum + 1e-20f);
  }
  for (int h = 0; h < 2; ++h) {
    const int r = lane + 32 * h;
    if (r < k) {
      p.experts[t * k + r] = mine[h];
      p.weights[t * k + r] = p.scaling != 1.0f ? __fmul_rn(w[h], p.scaling) : w[h];
    }
  }
}

template <int V>
__global__ void router_bwd_kernel(const MoeRouterBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= p.T) return;
  const int E = int(p.E), k = p.topk;
  const int* idx = p.experts + t * k;
  const float* z = p.logits + t * E;
  // Lane h-slot holds pick r = lane + 32 h: its expert, its gradient ds and its weight wc.
  int e[2] = {-1, -1};
  float ds[2] = {0.0f, 0.0f}, wc[2] = {0.0f, 0.0f}, zc[2] = {0.0f, 0.0f};
  for (int h = 0; h < 2; ++h) {
    const int r = lane + 32 * h;
    if (r < k) {
      e[h] = idx[r];
      ds[h] = __fmul_rn(p.dweights[t * k + r], p.scaling);
      zc[h] = z[e[h]];
    }
  }
  float* dz = p.dlogits + t * E;
  if (p.score == MoeScore::kSoftmax) {
    float zr[V], pr[V];
    if (p.pre_softmax) {
#pragma unroll
      for (int i = 0; i < V; ++i) zr[i] = lane + 32 * i < E ? z[lane + 32 * i] : 0.0f;
      warp_softmax<V>(zr, pr, E, lane);
      // The picks' probabilities: expert e lives in lane e & 31, slot e >> 5.
      for (int r = 0; r < k; ++r) {
        const int er = __shfl_sync(kFull, e[r >> 5], r & 31);
        const float v = warp_entry<V>(pr, er);
        if ((r & 31) == lane) wc[r >> 5] = v;
      }
    } else {
      float m = -INFINITY;
      for (int h = 0; h < 2; ++h)
        if (e[h] >= 0) m = fmaxf(m, zc[h]);
      m = warp_max(m);
      float sum = 0.0f;
      for (int h = 0; h < 2; ++h) {
        wc[h] = e[h] >= 0 ? expf(zc[h] - m) : 0.0f;
        sum += wc[h];
      }
      sum = warp_sum(sum);
      for (int h = 0; h < 2; ++h) wc[h] = wc[h] / sum;
    }
    float dot = 0.0f;
    for (int h = 0; h < 2; ++h) dot += __fmul_rn(ds[h], wc[h]);
    dot = warp_sum(dot);
    if (p.pre_softmax) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (lane + 32 * i < E) dz[lane + 32 * i] = __fmul_rn(pr[i], 0.0f - dot);
    } else {
      for (int j = lane; j < E; j += 32) dz[j] = 0.0f;
    }
    __syncwarp();
    for (int h = 0; h < 2; ++h)
      if (e[h] >= 0) dz[e[h]] = __fmul_rn(wc[h], ds[h] - dot);
  } else {
    float sum = 0.0f, dot = 0.0f;
    for (int h = 0; h < 2; ++h)
      if (e[h] >= 0) {
        wc[h] = moe_score(zc[h], p.score);
        sum += wc[h];
        dot += __fmul_rn(ds[h], wc[h]);
      }
    sum = warp_sum(sum);
    dot = warp_sum(dot);
    const float S = sum + 1e-20f;
    for (int j = lane; j < E; j += 32) dz[j] = 0.0f;
    __syncwarp();
    for (int h = 0; h < 2; ++h)
      if (e[h] >= 0) {
        const float dsc = k > 1 ? ds[h] / S - dot / __fmul_rn(S, S) : ds[h];
        dz[e[h]] = __fmul_rn(dsc, moe_score_grad(zc[h], wc[h], p.score));
      }
  }
}

template <template <int> class K, typename P>
Status launch_router(const P& p, cudaStream_t st, const char* what) {
  if (p.T == 0) return Status::Ok();
  const int v = int((p.E + 31) / 32);
  const unsigned grid = unsigned((p.T + 7) / 8);
  if (v <= 1)
    K<1>::run(p, grid, st);
  else if (v <= 2)
    K<2>::run(p, grid, st);
  else if (v <= 4)
    K<4>::run(p, grid, st);
  else if (v <= 8)
    K<8>::run(p, grid, st);
  else if (v <= 16)
    K<16>::run(p, grid, st);
  else
    K<32>::run(p, grid, st);
  return launch_status(what);
}
template <int V>
struct RouterFwd {
  static void run(const MoeRouterParams& p, unsigned g, cudaStream_t st) {
    router_fwd_kernel<V><<<g, 256, 0, st>>>(p);
  }
};
template <int V>
struct RouterBwd {
  static void run(const MoeRouterBwdParams& p, unsigned g, cudaStream_t st) {
    router_bwd_kernel<V><<<g, 256, 0, st>>>(p);
  }
};

// ---- dispatch plan: per-chunk counts, a scan over chunks per expert, stable ranks ----
constexpr int kChunk = kMoePlanChunk;

__global__ void plan_count_kernel(const MoePlanParams p, int32_t* chunk_counts, int32_t* bad) {
  extern __shared__ int32_t cnt[];
  const int64_t P = p.T * p.k;
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int64_t q0 = int64_t(blockIdx.x) * kChunk;
  for (int64_t q = q0 + threadIdx.x; q < min(P, q0 + kChunk); q += blockDim.x) {
    const int e = p.experts[q];
    if (e < 0 || e >= p.E) {
      *bad = 1;
      continue;
    }
    atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.E; e += blockDim.x)
    chunk_counts[int64_t(blockIdx.x) * p.E + e] = cnt[e];
}

// One thread per expert: its chunk prefix sums (in place) and total; then thread 0 the offsets.
__global__ void plan_scan_kernel(const MoePlanParams p, int32_t* chunk_counts, int64_t chunks) {
  __shared__ int32_t sizes[kMoeMaxExperts];
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
    int32_t run = 0;
#pragma unroll 8
    for (int64_t b = 0; b < chunks; ++b) {
      const int32_t c = chunk_counts[b * p.E + e];
      chunk_counts[b * p.E + e] = run;
      run += c;
    }
    const int64_t kept = p.capacity >= 0 ? min(int64_t(run), p.capacity) : int64_t(run);
    p.counts[e] = run;
    sizes[e] = int32_t((kept + p.align - 1) / p.align * p.align);
    p.sizes[e] = sizes[e];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t off = 0;
    for (int e = 0; e < p.E; ++e) {
      p.offsets[e] = off;
      off += sizes[e];
    }
  }
}

__global__ void fill_kernel(int32_t* a, int64_t n, int32_t v) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    a[i] = v;
}

// One warp per chunk walks it 32 pairs at a time: the lanes with the same expert rank among
// themselves (match_any), a running per-expert count in shared memory carries the rest. Each
// expert's first row for this chunk (offset + chunk prefix) and its kept count are staged in
// shared memory first, so the walk's only global reads are the expert ids.
__global__ void plan_rank_kernel(const MoePlanParams p, const int32_t* chunk_prefix) {
  extern __shared__ int32_t run[];  // run[E], base[E], left[E]
  int32_t* base = run + p.E;
  int32_t* left = base + p.E;  // the expert's kept pairs not ranked before this chunk
  const int lane = threadIdx.x;
  const int64_t P = p.T * p.k;
  for (int e = lane; e < p.E; e += 32) {
    const int32_t prefix = chunk_prefix[int64_t(blockIdx.x) * p.E + e];
    const int64_t cnt = p.counts[e];
    run[e] = 0;
    base[e] = p.offsets[e] + prefix;
    left[e] = int32_t(p.capacity >= 0 ? min(cnt, p.capacity) : cnt) - prefix;
  }
  __syncwarp();
  const int64_t q0 = int64_t(blockIdx.x) * kChunk;
  for (int64_t b = q0; b < min(P, q0 + kChunk); b += 32) {
    const int64_t q = b + lane;
    const bool in = q < P && q < q0 + kChunk;
    const int e = in ? p.experts[q] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    if (in && e >= 0 && e < p.E) {
      const int32_t before = run[e] + __popc(peers & ((1u << lane) - 1u));
      if (before < left[e]) {  // rank = prefix + before < kept
        p.dest[q] = base[e] + before;
        p.src[base[e] + before] = int32_t(q);
      } else {
        p.dest[q] = int32_t(p.rows);
      }
    }
    __syncwarp();
    if (in && e >= 0 && e < p.E && lane == __ffs(peers) - 1) run[e] += __popc(peers);
    __syncwarp();
  }
}

// ---- permute ----

// Plain gather: one block per row, 16-byte copies when rows allow.
__global__ void gather_kernel(const MoePermuteParams p, int64_t row_bytes, bool vec) {
  const int64_t P = p.T * p.k;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int32_t q = p.src[r];
    char* o = static_cast<char*>(p.out) + r * row_bytes;
    const char* x = q < P ? static_cast<const char*>(p.x) + (q / p.k) * row_bytes : nullptr;
    if (vec) {
      for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(o)[i] =
            x ? __ldg(reinterpret_cast<const uint4*>(x) + i) : make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) o[i] = x ? x[i] : 0;
    }
  }
}

template <int IN>
__global__ void row_amax_kernel(const MoePermuteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= p.T) return;
  using T = typename In<IN>::T;
  const T* x = static_cast<const T*>(p.x) + t * p.d;
  float m = 0.0f;
  for (int64_t c = lane; c < p.d; c += 32) m = fmaxf(m, fabsf(In<IN>::f(x[c])));  // NaN ignored
  m = warp_max(m);
  if (lane == 0) p.row_amax[t] = m;
}

__global__ void expert_amax_kernel(const MoePermuteParams p) {
  const int64_t P = p.T * p.k;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < p.rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t q = p.src[r];
    if (q < P) atomic_max_nonneg(p.amax + p.experts[q], p.row_amax[q / p.k]);
  }
}

template <int FMT>
__global__ void scale_inv_kernel(const MoePermuteParams p) {
  for (int64_t e = threadIdx.x; e < p.E; e += blockDim.x) {
    const float s = p.delayed ? p.delayed[e] : scale_from_amax(p.amax[e], fmt_max<FMT>());
    p.scale_inv[e] = 1.0f / s;
  }
}

// FP8 gather-cast of a 64-row x 64-column tile: each row's scale from its expert; the rowwise
// bytes written per row, the colwise bytes (d, rows) per column from the tile in shared memory.
constexpr int kPT = 64;
template <int IN, int FMT>
__global__ void __launch_bounds__(256) permute_fp8_kernel(const MoePermuteParams p) {
  using T = typename In<IN>::T;
  __shared__ uint8_t tile[kPT][kPT + 4];
  __shared__ int32_t srow[kPT];
  __shared__ float sscale[kPT];
  const int64_t P = p.T * p.k;
  const int64_t tiles_c = (p.d + kPT - 1) / kPT;
  const int64_t r0 = int64_t(blockIdx.x / tiles_c) * kPT, c0 = int64_t(blockIdx.x % tiles_c) * kPT;
  const int tid = threadIdx.x;
  if (tid < kPT) {
    const int64_t r = r0 + tid;
    const int32_t q = r < p.rows ? p.src[r] : int32_t(P);
    srow[tid] = q < P ? int32_t(q / p.k) : -1;
    float s = 0.0f;
    if (q < P) {
      const int e = p.experts[q];
      s = p.delayed ? p.delayed[e] : scale_from_amax(p.amax[e], fmt_max<FMT>());
    }
    sscale[tid] = s;
  }
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  uint8_t* out = static_cast<uint8_t*>(p.out);
  // 4096 bytes per tile, 16 per thread: row lr, columns lc .. lc + 15.
  const int lr = tid / 4, lc = (tid % 4) * 16;
  const int64_t r = r0 + lr;
  const int t = srow[lr];
  uint32_t packed[4] = {0, 0, 0, 0};
  for (int c = 0; c < 16; c += 2) {
    const int64_t gc = c0 + lc + c;
    float a = 0.0f, b = 0.0f;
    if (t >= 0 && gc < p.d) a = __fmul_rn(In<IN>::f(x[int64_t(t) * p.d + gc]), sscale[lr]);
    if (t >= 0 && gc + 1 < p.d) b = __fmul_rn(In<IN>::f(x[int64_t(t) * p.d + gc + 1]), sscale[lr]);
    const uint32_t two = t >= 0 ? enc_fp8x2<FMT>(a, b) : 0u;
    packed[c / 4] |= two << ((c % 4) * 8);
    tile[lr][lc + c] = uint8_t(two & 0xff);
    tile[lr][lc + c + 1] = uint8_t(two >> 8);
  }
  if (out && r < p.rows && p.d % 16 == 0 && c0 + lc + 16 <= p.d) {
    *reinterpret_cast<uint4*>(out + r * p.d + c0 + lc) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else if (out && r < p.rows) {
    for (int c = 0; c < 16; ++c) {
      const int64_t gc = c0 + lc + c;
      if (gc < p.d) out[r * p.d + gc] = uint8_t(packed[c / 4] >> ((c % 4) * 8));
    }
  }
  if (!p.out_col) return;
  __syncthreads();
  // Colwise: thread -> column tid / 4, rows (tid % 4) * 16 .. + 15 (16 contiguous bytes).
  const int cc = tid / 4, rr = (tid % 4) * 16;
  const int64_t gc = c0 + cc;
  if (gc < p.d && p.rows % 16 == 0 && r0 + rr + 16 <= p.rows) {
    uint32_t w[4] = {0, 0, 0, 0};
    for (int i = 0; i < 16; ++i) w[i / 4] |= uint32_t(tile[rr + i][cc]) << ((i % 4) * 8);
    *reinterpret_cast<uint4*>(p.out_col + gc * p.rows + r0 + rr) =
        make_uint4(w[0], w[1], w[2], w[3]);
  } else if (gc < p.d)
    for (int i = 0; i < 16; ++i) {
      const int64_t gr = r0 + rr + i;
      if (gr < p.rows) p.out_col[gc * p.rows + gr] = tile[rr + i][cc];
    }
}

}  // namespace
}  // namespace cuda

using namespace cuda;

Status moe_router_fwd_cuda(const MoeRouterParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  return launch_router<RouterFwd>(p, static_cast<cudaStream_t>(stream), "moe_router_fwd");
}

Status moe_router_bwd_cuda(const MoeRouterBwdParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  return launch_router<RouterBwd>(p, static_cast<cudaStream_t>(stream), "moe_router_bwd");
}

// The scratch (moe_plan_scratch_len int32, an XLA-owned result) holds the per-chunk counts and
// a bad-id flag.
Status moe_plan_cuda(const MoePlanParams& p, void* stream) {
  if (auto s = validate(p); !s.ok()) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t P = p.T * p.k, chunks = std::max<int64_t>((P + kChunk - 1) / kChunk, 1);
  if (p.scratch_len < moe_plan_scratch_len(p.T, p.k, p.E))
    return Status::Invalid("moe_plan: scratch too small");
  int32_t* scratch = p.scratch;
  int32_t* bad = scratch + chunks * p.E;
  const size_t shared = size_t(p.E) * sizeof(int32_t);
  Status s = api_status(cudaMemsetAsync(bad, 0, sizeof(int32_t), st), "moe_plan memset");
  if (s.ok() && p.rows > 0) {
    fill_kernel<<<grid_for(p.rows, 256), 256, 0, st>>>(p.src, p.rows, int32_t(P));
    s = launch_status("moe_plan fill");
  }
  if (s.ok()) {
    plan_count_kernel<<<unsigned(chunks), 256, shared, st>>>(p, scratch, bad);
    s = launch_status("moe_plan count");
  }
  if (s.ok()) {
    plan_scan_kernel<<<1, 1024, 0, st>>>(p, scratch, chunks);
    s = launch_status("moe_plan scan");
  }
  if (s.ok() && P > 0) {
    plan_rank_kernel<<<unsigned(chunks), 32, 3 * shared, st>>>(p, scratch);
    s = launch_status("moe_plan rank");
  }
  // Ids out of range cannot be reported without a sync (the CPU kernel refuses them): here such
  // pairs are left out of every group (their dest is not written).
  return s;
}

Status moe_permute_cuda(const MoePermuteParams& p_in, void* stream) {
  if (auto s = validate(p_in); !s.ok()) return s;
  // The kernels take the delayed scales whenever the pointer is set: current scaling must not
  // see them (the CPU kernel, like the mode's contract, ignores them there).
  MoePermuteParams p = p_in;
  if (p.mode != ScalingMode::kDelayedTensor) p.delayed = nullptr;
  auto st = static_cast<cudaStream_t>(stream);
  if (p.mode == ScalingMode::kNoScaling) {
    if (p.rows == 0) return Status::Ok();
    const int64_t row_bytes = p.d * int64_t(dtype_bytes(p.dtype));
    const bool vec = row_bytes % 16 == 0 && aligned16(p.x) && aligned16(p.out);
    gather_kernel<<<unsigned(std::min<int64_t>(p.rows, 65535)), 128, 0, st>>>(p, row_bytes, vec);
    return launch_status("moe_permute gather");
  }
  if (auto s = api_status(cudaMemsetAsync(p.amax, 0, size_t(p.E) * sizeof(float), st), "memset");
      !s.ok())
    return s;
  Status s = Status::Ok();
  if (p.T > 0) {
    with_in(p.dtype, [&](auto in) {
      row_amax_kernel<decltype(in)::value><<<unsigned((p.T + 7) / 8), 256, 0, st>>>(p);
    });
    s = launch_status("moe_permute row amax");
  }
  if (s.ok() && p.rows > 0) {
    expert_amax_kernel<<<grid_for(p.rows, 256), 256, 0, st>>>(p);
    s = launch_status("moe_permute expert amax");
  }
  const bool e4 = p.q == DType::kE4M3;
  if (s.ok()) {
    if (e4)
      scale_inv_kernel<kFmtE4M3><<<1, 1024, 0, st>>>(p);
    else
      scale_inv_kernel<kFmtE5M2><<<1, 1024, 0, st>>>(p);
    s = launch_status("moe_permute scale_inv");
  }
  if (s.ok() && p.rows > 0 && p.d > 0) {
    const int64_t tiles = ((p.rows + kPT - 1) / kPT) * ((p.d + kPT - 1) / kPT);
    if (tiles > INT32_MAX) return Status::Invalid("moe_permute: too many tiles");
    with_in(p.dtype, [&](auto in) {
      constexpr int IN = decltype(in)::value;
      if (e4)
        permute_fp8_kernel<IN, kFmtE4M3><<<unsigned(tiles), 256, 0, st>>>(p);
      else
        permute_fp8_kernel<IN, kFmtE5M2><<<unsigned(tiles), 256, 0, st>>>(p);
    });
    s = launch_status("moe_permute fp8");
  }
  return s;
}

}  // namespace lowbit
