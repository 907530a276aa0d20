// CUDA grouped GEMM: picks the CUTLASS configuration, lays out the workspace, runs the setup
// kernel, the CUTLASS kernel and the fallback kernel (see grouped_gemm_cutlass.cuh for the plan).
// Block-scaled ragged-M calls go through the router of grouped_gemm_select.cc first (CUTLASS or
// lowbit's own sm90 kernel, grouped_gemm_sm90.cu).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>

#include "grouped_gemm_cutlass.cuh"
#include "grouped_gemm_sm90.h"

namespace lowbit {
namespace gg {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so the next call does not see it
  return Status::Invalid(std::string(what) + ": " + cudaGetErrorString(e));
}

int current_sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
  if (dev >= 0 && dev < 64) cache[dev].store(count, std::memory_order_relaxed);
  return count;
}

Problem make_problem(const GroupedGemmParams& p, void* info_area, void* realign_area,
                     bool cutlass_ok) {
  Problem q;
  q.mode = int32_t(p.mode);
  q.m = p.m;
  q.n = p.n;
  q.k = p.k;
  q.groups = p.num_groups;
  q.group_sizes = p.group_sizes;
  q.a = static_cast<const char*>(p.a);
  q.b = static_cast<const char*>(p.b);
  q.out = static_cast<char*>(p.out);
  q.a_dtype = int32_t(p.a_dtype);
  q.b_dtype = int32_t(p.b_dtype);
  q.a_kmajor = p.a_kmajor;
  q.b_kmajor = p.b_kmajor;
  q.lda = p.lda;
  q.ldb = p.ldb;
  q.b_group_stride = p.b_group_stride;
  q.a_scale_inv = p.a_scale_inv;
  q.b_scale_inv = p.b_scale_inv;
  q.block_scaled = p.block_scaled;
  q.b_block_n = p.b_block_n;
  q.cutlass_ok = cutlass_ok;
  q.info = static_cast<GroupInfo*>(info_area);
  q.flags = reinterpret_cast<int64_t*>(static_cast<char*>(info_area) +
                                       size_t(p.num_groups) * sizeof(GroupInfo));
  q.realign_ld = realign_cols(p.k, p.num_groups);
  q.realign_a = q.realign_b = nullptr;
  if (realign_area) {
    char* r = static_cast<char*>(realign_area);
    if (p.a_kmajor) {
      q.realign_a = r;
      r += align_up(size_t(p.m * q.realign_ld * dtype_bytes(p.a_dtype)), 256);
    }
    if (p.b_kmajor) q.realign_b = r;
  }
  return q;
}

namespace {

const Config* pick_config(const GroupedGemmParams& p) {
#if LOWBIT_HAVE_CUTLASS
  if (p.a_dtype == DType::kBF16) {
    if (p.a_kmajor && p.b_kmajor) return &config_bf16_kk();
    if (p.a_kmajor) return &config_bf16_kn();
    if (!p.b_kmajor) return &config_bf16_mn();
    return nullptr;
  }
  if (!p.a_kmajor || !p.b_kmajor) return nullptr;  // FP8 tensor cores read K-major operands only
  const bool a4 = p.a_dtype == DType::kE4M3, b4 = p.b_dtype == DType::kE4M3;
  if (p.block_scaled) {
    if (p.b_block_n == 128) {
      if (a4 && b4) return &config_block_e4m3_e4m3_n128();
      if (b4) return &config_block_e5m2_e4m3_n128();
      return nullptr;  // E4M3 x E5M2 with 128x128 B: no GEMM of the recipe needs it
    }
    if (a4 && b4) return &config_block_e4m3_e4m3_n1();
    if (b4) return &config_block_e5m2_e4m3_n1();
    if (a4) return &config_block_e4m3_e5m2_n1();
    return nullptr;
  }
  // Fast accumulation where the call asks for it (TE 2.20 accumulates every grouped FP8 GEMM
  // fast) or where it adds the same sums as split accumulation: a ragged-K weight gradient whose
  // groups average 256 rows or fewer (host-known: the total and the group count; the sizes stay
  // on the device), one or two k-blocks per tile.
  const bool short_k = p.mode == GroupedGemmMode::kRaggedK && p.k <= 256 * p.num_groups;
  const bool fast = p.fast_accum || short_k;
  if (a4 && b4) return fast ? &config_fp8_e4m3_e4m3_fast() : &config_fp8_e4m3_e4m3();
  if (b4) return fast ? &config_fp8_e5m2_e4m3_fast() : &config_fp8_e5m2_e4m3();
  if (a4) return fast ? &config_fp8_e4m3_e5m2_fast() : &config_fp8_e4m3_e5m2();
#else
  (void)p;
#endif
  return nullptr;
}

#if LOWBIT_HAVE_CUTLASS
// Whether every stride keeps 16-byte alignment (TMA) and the extents fit CUTLASS's int shapes.
bool strides_fit_cutlass(const GroupedGemmParams& p) {
  const int64_t ea = dtype_bytes(p.a_dtype), eb = dtype_bytes(p.b_dtype);
  const int64_t lim = int64_t(1) << 31;
  return (p.lda * ea) % 16 == 0 && (p.ldb * eb) % 16 == 0 && (p.n * 2) % 16 == 0 &&
         (p.b_group_stride * eb) % 16 == 0 && p.m < lim && p.n < lim && p.k < lim;
}

#endif

struct Layout {
  size_t info, realign, arrays, cutlass, total;
};

// Ragged K with a K-major operand and a CUTLASS kernel: the realigned copies (see realign_cols).
size_t realign_bytes(const GroupedGemmParams& p) {
  if (p.mode != GroupedGemmMode::kRaggedK || !(p.a_kmajor || p.b_kmajor)) return 0;
  const size_t cols = size_t(realign_cols(p.k, p.num_groups));
  size_t bytes = 0;
  if (p.a_kmajor) bytes += align_up(size_t(p.m) * cols * dtype_bytes(p.a_dtype), 256);
  if (p.b_kmajor) bytes += align_up(size_t(p.n) * cols * dtype_bytes(p.b_dtype), 256);
  return bytes;
}

Layout workspace_layout(const GroupedGemmParams& p, const Config* cfg, int sm_count) {
  Layout l{};
  l.info = info_bytes(p.num_groups);
  if (cfg) {
    l.realign = realign_bytes(p);
    l.arrays = align_up(cfg->arrays_bytes(p.num_groups), 256);
    l.cutlass = align_up(cfg->cutlass_bytes(sm_count), 256);
  }
  l.total = l.info + l.realign + l.arrays + l.cutlass;
  return l;
}

#if LOWBIT_HAVE_CUTLASS
// Copies the K-major rows of every realigned ragged-K group to its 16-aligned slot (one block
// per operand row at a time). Rows start and end on 16-byte boundaries (CUTLASS's stride
// check), so the aligned 4-byte words around a group's bytes lie inside its row: each output
// word is two such words funnel-shifted. Exits at once when no group is realigned.
__global__ void __launch_bounds__(256) realign_kernel(Problem p) {
  if (p.flags[1] == 0) return;
  const int ea = p.a_dtype == int32_t(DType::kBF16) ? 2 : 1;
  const int eb = p.b_dtype == int32_t(DType::kBF16) ? 2 : 1;
  const int64_t rows_a = p.realign_a ? p.m : 0, rows = rows_a + (p.realign_b ? p.n : 0);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const bool is_a = r < rows_a;
    const int es = is_a ? ea : eb;
    const char* src = is_a ? p.a + r * p.lda * ea : p.b + (r - rows_a) * p.ldb * eb;
    char* dst =
        is_a ? p.realign_a + r * p.realign_ld * ea : p.realign_b + (r - rows_a) * p.realign_ld * eb;
    for (int64_t g = 0; g < p.groups; ++g) {
      const GroupInfo gi = p.info[g];
      if (gi.slot < 0) continue;
      const uintptr_t s = reinterpret_cast<uintptr_t>(src + gi.start * es);
      const int shift = int(s & 3u) * 8;
      const uint32_t* s4 = reinterpret_cast<const uint32_t*>(s & ~uintptr_t(3));
      uint32_t* d4 = reinterpret_cast<uint32_t*>(dst + gi.slot * es);  // 16-aligned slot
      const int64_t bytes = gi.size * es, span = bytes + (shift >> 3);
      for (int64_t w = threadIdx.x; w * 4 < bytes; w += blockDim.x) {
        const uint32_t lo = s4[w];
        const uint32_t hi = (w + 1) * 4 < span ? s4[w + 1] : 0u;
        d4[w] = __funnelshift_r(lo, hi, shift);  // the slot's padding takes a partial last word
      }
    }
  }
}

// ---- fallback kernel: a plain tiled GEMM for the groups CUTLASS does not take ----

constexpr int kTile = 64, kChunk = 16, kThreads = 256;

__device__ __forceinline__ float load_elem(const char* base, int32_t dtype, int64_t i) {
  if (dtype == int32_t(DType::kBF16)) {
    const uint16_t u = reinterpret_cast<const uint16_t*>(base)[i];
    return __uint_as_float(uint32_t(u) << 16);
  }
  const uint8_t c = reinterpret_cast<const uint8_t*>(base)[i];
  if (dtype == int32_t(DType::kE4M3)) {
    __nv_fp8_e4m3 v;
    v.__x = c;
    return float(v);
  }
  __nv_fp8_e5m2 v;
  v.__x = c;
  return float(v);
}

__device__ void fallback_tile(const Problem& p, const GroupView& v, float alpha, int64_t tm,
                              int64_t tn, float (*As)[kTile + 1], float (*Bs)[kTile + 1]) {
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t i0 = tm * kTile, j0 = tn * kTile;
  float acc[4][4] = {};
  for (int64_t c0 = 0; c0 < v.kc; c0 += kChunk) {
    // Stage a 64 x 16 slice of A and a 16 x 64 slice of B, walking the contiguous axis fastest.
    for (int q = 0; q < kTile * kChunk / kThreads; ++q) {
      const int e = tid + q * kThreads;
      const int ii = v.a_sc == 1 ? e / kChunk : e % kTile;
      const int cc = v.a_sc == 1 ? e % kChunk : e / kTile;
      const int64_t i = i0 + ii, c = c0 + cc;
      As[cc][ii] = (i < v.rows && c < v.kc) ? load_elem(v.A, p.a_dtype, i * v.a_si + c * v.a_sc) *
                                                  (v.SA ? v.SA[(c / 128) * v.sa_ld + i] : 1.f)
                                            : 0.f;
      const int jj = v.b_sc == 1 ? e / kChunk : e % kTile;
      const int cb = v.b_sc == 1 ? e % kChunk : e / kTile;
      const int64_t j = j0 + jj, cj = c0 + cb;
      Bs[cb][jj] = (j < p.n && cj < v.kc)
                       ? load_elem(v.B, p.b_dtype, cj * v.b_sc + j * v.b_sj) *
                             (v.SB ? v.SB[(cj / 128) * v.sb_ld + j / p.b_block_n] : 1.f)
                       : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int cc = 0; cc < kChunk; ++cc) {
      float a[4], b[4];
      for (int r = 0; r < 4; ++r) a[r] = As[cc][ty * 4 + r];
      for (int s = 0; s < 4; ++s) b[s] = Bs[cc][tx * 4 + s];
      for (int r = 0; r < 4; ++r)
        for (int s = 0; s < 4; ++s) acc[r][s] += a[r] * b[s];
    }
    __syncthreads();
  }
  __nv_bfloat16* D = reinterpret_cast<__nv_bfloat16*>(v.D);
  for (int r = 0; r < 4; ++r) {
    const int64_t i = i0 + ty * 4 + r;
    if (i >= v.rows) break;
    for (int s = 0; s < 4; ++s) {
      const int64_t j = j0 + tx * 4 + s;
      if (j < p.n) D[i * p.n + j] = __float2bfloat16_rn(v.kc == 0 ? 0.f : acc[r][s] * alpha);
    }
  }
}

// Persistent: the work items are the fallback groups, then (ragged M) the rows in no group; their
// tiles are dealt round-robin over the blocks. Launched on every call: it is idle in the common
// case (every group on the CUTLASS path, every row covered) and finds that out with one parallel
// pass over GroupInfo. The loop below reads GroupInfo one dependent load per group, which made
// an idle launch cost ~37 us at 128 groups (0.11 ms of a 1.3 ms fwd+bwd on an H200).
__global__ void __launch_bounds__(kThreads) fallback_kernel(Problem p) {
  __shared__ float As[kChunk][kTile + 1];
  __shared__ float Bs[kChunk][kTile + 1];
  const bool ragged_m = p.mode == int32_t(GroupedGemmMode::kRaggedM);
  int busy = threadIdx.x == 0 && ragged_m && p.flags[0] < p.m;
  for (int64_t g = threadIdx.x; g < p.groups; g += blockDim.x)
    busy |= p.info[g].path == kPathFallback;
  if (!__syncthreads_or(busy)) return;
  const int64_t tiles_n = (p.n + kTile - 1) / kTile;
  const int64_t grid = gridDim.x;
  int64_t first = 0;
  for (int64_t g = 0; g <= p.groups; ++g) {
    GroupView v;
    float alpha = 1.f;
    if (g == p.groups) {
      const int64_t covered = ragged_m ? p.flags[0] : p.m;
      if (!ragged_m || covered >= p.m) break;
      v = group_view(p, 0, covered, p.m - covered);
      v.kc = 0;  // zero rows
    } else {
      const GroupInfo gi = p.info[g];
      if (gi.path != kPathFallback) continue;
      v = group_view(p, g, gi.start, gi.size);
      alpha = gi.alpha;
    }
    const int64_t tiles = (v.rows + kTile - 1) / kTile * tiles_n;
    for (int64_t t = first + ((int64_t(blockIdx.x) - first % grid) % grid + grid) % grid;
         t < first + tiles; t += grid)
      fallback_tile(p, v, alpha, (t - first) / tiles_n, (t - first) % tiles_n, As, Bs);
    first += tiles;
  }
}

#endif  // LOWBIT_HAVE_CUTLASS

}  // namespace
}  // namespace gg

size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p) {
  if (p.num_groups < 1) return 0;
  const gg::Config* cfg = gg::pick_config(p);
  return gg::workspace_layout(p, cfg, cfg ? gg::current_sm_count() : 0).total;
}

Status grouped_gemm_cuda(const GroupedGemmParams& p, void* stream_ptr) {
  Status s = validate(p);
  if (!s.ok()) return s;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Block-scaled ragged M (1x128 x 128x128): CUTLASS or lowbit's own kernel, by measurement.
  if (gg::block_route_applies(p)) return gg::route_block(p, stream);
  return gg::cutlass_grouped(p, stream);
}

namespace gg {

Status cutlass_grouped(const GroupedGemmParams& p, cudaStream_t stream) {
  Status s;
#if !LOWBIT_HAVE_CUTLASS
  (void)stream;
  return Status::Invalid(
      "grouped_gemm: this liblowbit_cuda was built without CUTLASS; rebuild with the CUTLASS "
      "headers (pip install nvidia-cutlass, or -DLOWBIT_CUTLASS_INCLUDE=<cutlass>/include)");
#else
  const gg::Config* cfg = gg::pick_config(p);
  const int sm_count = gg::current_sm_count();
  if (sm_count <= 0) return Status::Invalid("grouped_gemm: cannot read the device's SM count");
  const gg::Layout lay = gg::workspace_layout(p, cfg, sm_count);
  if (p.workspace_bytes < lay.total || (lay.total && !p.workspace))
    return Status::Invalid("grouped_gemm: workspace of " + std::to_string(p.workspace_bytes) +
                           " bytes, needs " + std::to_string(lay.total));
  char* ws = static_cast<char*>(p.workspace);
  const bool use_cutlass = cfg && gg::strides_fit_cutlass(p);
  char* realign = use_cutlass && lay.realign ? ws + lay.info : nullptr;
  char* arrays = ws + lay.info + lay.realign;
  const gg::Problem prob = gg::make_problem(p, ws, realign, use_cutlass);
  if (use_cutlass) {
    s = cfg->setup(prob, arrays, stream);
    if (!s.ok()) return s;
    // clang-format off: it splits a kernel launch's >>> after a template argument list
    if (realign) {
      const int64_t rows = (p.a_kmajor ? p.m : 0) + (p.b_kmajor ? p.n : 0);
      const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, 8 * sm_count)));
      gg::realign_kernel<<<grid, 256, 0, stream>>>(prob);
      s = gg::cuda_status(cudaGetLastError(), "grouped_gemm realign kernel");
      if (!s.ok()) return s;
    }
    s = cfg->gemm(prob, arrays, arrays + lay.arrays, lay.cutlass, sm_count, stream);
    if (!s.ok()) return s;
  } else {
    gg::setup_kernel<gg::NoArrays><<<1, gg::kSetupThreads, 0, stream>>>(prob, gg::NoArrays{});
    s = gg::cuda_status(cudaGetLastError(), "grouped_gemm setup kernel");
    if (!s.ok()) return s;
  }
  gg::fallback_kernel<<<2 * sm_count, gg::kThreads, 0, stream>>>(prob);
  return gg::cuda_status(cudaGetLastError(), "grouped_gemm fallback kernel");
  // clang-format on
#endif
}

}  // namespace gg
}  // namespace lowbit
