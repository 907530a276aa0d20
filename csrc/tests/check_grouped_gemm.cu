// Standalone check of the CUDA grouped GEMM against the CPU one (no JAX).
//
// Build: cmake -DLOWBIT_BUILD_CHECKS=ON (target lowbit_check_grouped_gemm), or by hand from the
// repository root:
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -I csrc/include -I <cutlass>/include csrc/tests/check_grouped_gemm.cu \
//     csrc/kernels/cuda/grouped_gemm*.cu csrc/kernels/cuda/gemm_cublaslt.cc \
//     csrc/kernels/cpu/*.cc csrc/kernels/common/*.cc -lcublasLt -o build/check_grouped_gemm
// Run:
//   check_grouped_gemm            every case (small and medium)
//   check_grouped_gemm --quick    small cases only (for compute-sanitizer memcheck)
//   check_grouped_gemm --bench    TFLOP/s on the MoE shapes, next to one cuBLASLt dense GEMM
//   check_grouped_gemm --bench-block   the block-scaled fwd / dgrad only, per backend
//                                      (LOWBIT_GROUPED_BLOCK_GEMM=cutlass, sm90own, auto)
// Exit status: 0 when every comparison passed.
//
// The CPU kernel is the reference (float32 sums); the GPU result must match it within a relative
// Frobenius error per format, rows in no group and empty ragged-K groups must be exactly zero,
// outputs start poisoned (NaN) so an unwritten element fails, workspaces start as garbage, and
// operands are allocated at exactly the size their strides reach so memcheck sees stray reads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "lowbit/formats.h"
#include "lowbit/gemm.h"
#include "lowbit/grouped_gemm.h"

using namespace lowbit;

namespace {

int g_failures = 0, g_cases = 0;

// LOWBIT_GROUPED_BLOCK_GEMM for the calls of one scope (the router reads it at every call);
// null: unset.
struct Backend {
  explicit Backend(const char* value) {
    if (value)
      setenv("LOWBIT_GROUPED_BLOCK_GEMM", value, 1);
    else
      unsetenv("LOWBIT_GROUPED_BLOCK_GEMM");
  }
  ~Backend() { unsetenv("LOWBIT_GROUPED_BLOCK_GEMM"); }
};

// ---- operands in the layouts lowbit.grouped_gemm passes -------------------------------------

enum class Op { kFwdBf16, kDgradBf16, kWgradBf16, kFwdFp8, kDgradFp8, kWgradFp8 };

const char* op_name(Op op) {
  switch (op) {
    case Op::kFwdBf16: return "bf16 fwd";
    case Op::kDgradBf16: return "bf16 dgrad";
    case Op::kWgradBf16: return "bf16 wgrad";
    case Op::kFwdFp8: return "fp8 fwd";
    case Op::kDgradFp8: return "fp8 dgrad";
    default: return "fp8 wgrad";
  }
}

// The GEMM view of one op on a MoE layer with `rows` tokens, hidden K, expert width N:
//   fwd   out(rows, N)  = x(rows, K) . w_g(K, N)
//   dgrad out(rows, K)  = dy(rows, N) . w_g(K, N)^T
//   wgrad out(G, K, N)  = x_g^T . dy_g
GroupedGemmParams view(Op op, int64_t rows, int64_t K, int64_t N, int64_t G, DType e_fwd,
                       DType e_bwd, bool fast) {
  GroupedGemmParams p;
  p.num_groups = G;
  switch (op) {
    case Op::kFwdBf16:
      p.mode = GroupedGemmMode::kRaggedM;
      p.m = rows, p.n = N, p.k = K;
      p.a_dtype = p.b_dtype = DType::kBF16;
      p.a_kmajor = true, p.lda = K;
      p.b_kmajor = false, p.ldb = N, p.b_group_stride = K * N;
      break;
    case Op::kDgradBf16:
      p.mode = GroupedGemmMode::kRaggedM;
      p.m = rows, p.n = K, p.k = N;
      p.a_dtype = p.b_dtype = DType::kBF16;
      p.a_kmajor = true, p.lda = N;
      p.b_kmajor = true, p.ldb = N, p.b_group_stride = K * N;
      break;
    case Op::kWgradBf16:
      p.mode = GroupedGemmMode::kRaggedK;
      p.m = K, p.n = N, p.k = rows;
      p.a_dtype = p.b_dtype = DType::kBF16;
      p.a_kmajor = false, p.lda = K;
      p.b_kmajor = false, p.ldb = N;
      break;
    case Op::kFwdFp8:  // rhs's colwise copy (N, G*K)
      p.mode = GroupedGemmMode::kRaggedM;
      p.m = rows, p.n = N, p.k = K;
      p.a_dtype = p.b_dtype = e_fwd;
      p.a_kmajor = true, p.lda = K;
      p.b_kmajor = true, p.ldb = G * K, p.b_group_stride = K;
      p.fast_accum = fast;
      break;
    case Op::kDgradFp8:  // dy rowwise . rhs rowwise (G*K, N)
      p.mode = GroupedGemmMode::kRaggedM;
      p.m = rows, p.n = K, p.k = N;
      p.a_dtype = e_bwd, p.b_dtype = e_fwd;
      p.a_kmajor = true, p.lda = N;
      p.b_kmajor = true, p.ldb = N, p.b_group_stride = K * N;
      break;
    case Op::kWgradFp8:  // x colwise (K, rows) . dy colwise (N, rows)
      p.mode = GroupedGemmMode::kRaggedK;
      p.m = K, p.n = N, p.k = rows;
      p.a_dtype = e_fwd, p.b_dtype = e_bwd;
      p.a_kmajor = true, p.lda = rows;
      p.b_kmajor = true, p.ldb = rows;
      break;
  }
  return p;
}

int64_t reach(bool kmajor, int64_t rk, int64_t ck, int64_t ld) {
  const int64_t r = kmajor ? rk : ck, c = kmajor ? ck : rk;
  return (r == 0 || c == 0) ? 0 : (r - 1) * ld + c;
}
int64_t a_count(const GroupedGemmParams& p) { return reach(p.a_kmajor, p.m, p.k, p.lda); }
int64_t b_count(const GroupedGemmParams& p) {
  int64_t r = reach(p.b_kmajor, p.n, p.k, p.ldb);
  if (p.mode == GroupedGemmMode::kRaggedM && r) r += (p.num_groups - 1) * p.b_group_stride;
  return r;
}
int64_t out_count(const GroupedGemmParams& p) {
  return p.m * p.n * (p.mode == GroupedGemmMode::kRaggedK ? p.num_groups : 1);
}
int esize(DType t) { return t == DType::kBF16 ? 2 : 1; }

// FP8 block scaling (Float8BlockScaling): `block_n` 0 = per-group tensor scales; 1 / 128 = block
// scales, B's blocks 1x128 / 128x128 (fwd and dgrad; the wgrad takes 1x128 for both).
void set_block(GroupedGemmParams* p, int block_n) {
  if (block_n == 0) return;
  p->block_scaled = true;
  p->b_block_n = block_n;
  p->fast_accum = false;
}
// Element counts of the block-scale arrays (the grouped layouts of lowbit/grouped_gemm.h).
int64_t scale_count(const GroupedGemmParams& p, bool a) {
  if (!p.block_scaled) return p.num_groups;
  if (p.mode == GroupedGemmMode::kRaggedM) {
    const int64_t nkb = (p.k + 127) / 128;
    return a ? p.m * nkb : p.num_groups * nkb * ((p.n + p.b_block_n - 1) / p.b_block_n);
  }
  return grouped_block_colwise_rows(p.k, p.num_groups) * (a ? p.m : p.n);
}

// Random operand codes: N(0, 1) values encoded in the operand's format (never NaN).
std::vector<uint8_t> random_operand(DType t, int64_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint8_t> out(size_t(count) * esize(t));
  for (int64_t i = 0; i < count; ++i) {
    const float x = nd(rng);
    if (t == DType::kBF16) {
      const uint16_t v = float_to_bf16(x);
      std::memcpy(out.data() + 2 * i, &v, 2);
    } else {
      out[i] = uint8_t(encode_rne(x, t == DType::kE4M3 ? kE4M3 : kE5M2));
    }
  }
  return out;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  if (h.empty()) return nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Clamped group ranges (the contract of lowbit/grouped_gemm.h), for the exact-zero checks.
void ranges(const std::vector<int32_t>& sizes, int64_t extent, std::vector<int64_t>* start,
            std::vector<int64_t>* size, int64_t* covered) {
  int64_t off = 0;
  for (int32_t s : sizes) {
    const int64_t v = std::min<int64_t>(std::max<int32_t>(s, 0), extent - off);
    start->push_back(off);
    size->push_back(v);
    off += v;
  }
  *covered = off;
}

// Runs one op on both backends and compares. `graph`: capture the CUDA call in a CUDA graph
// and launch the graph instead (what XLA's command buffers do).
void check(const std::string& label, Op op, int64_t rows, int64_t K, int64_t N,
           const std::vector<int32_t>& sizes, DType e_fwd, DType e_bwd, bool fast, bool graph,
           uint64_t seed, int block_n = 0, const char* backend = nullptr) {
  ++g_cases;
  const Backend scope(backend);
  const int64_t G = int64_t(sizes.size());
  GroupedGemmParams p = view(op, rows, K, N, G, e_fwd, e_bwd, fast);
  set_block(&p, block_n);
  std::mt19937_64 rng(seed);
  const auto ha = random_operand(p.a_dtype, a_count(p), rng);
  const auto hb = random_operand(p.b_dtype, b_count(p), rng);
  // Scales 2^U(-2, 2) (not powers of two): per group, or per block with block scaling.
  std::vector<float> sa(scale_count(p, true)), sb(scale_count(p, false));
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  for (auto& v : sa) v = std::exp2(ud(rng));
  for (auto& v : sb) v = std::exp2(ud(rng));
  const bool fp8 = p.a_dtype != DType::kBF16;
  const int64_t oc = out_count(p);

  // CPU reference.
  std::vector<uint16_t> ref(static_cast<size_t>(oc), uint16_t(0x7FC1));
  GroupedGemmParams pc = p;
  pc.group_sizes = sizes.data();
  pc.a = ha.data(), pc.b = hb.data(), pc.out = ref.data();
  if (fp8) pc.a_scale_inv = sa.data(), pc.b_scale_inv = sb.data();
  Status s = grouped_gemm_cpu(pc);
  if (!s.ok()) {
    std::printf("FAIL %s [%s]: CPU: %s\n", label.c_str(), op_name(op), s.message.c_str());
    ++g_failures;
    return;
  }

  // GPU.
  uint8_t* da = to_device(ha);
  uint8_t* db = to_device(hb);
  int32_t* dg = to_device(sizes);
  float* dsa = to_device(sa);
  float* dsb = to_device(sb);
  uint16_t* dout = nullptr;
  if (oc) {
    CK(cudaMalloc(&dout, size_t(oc) * 2));
    CK(cudaMemset(dout, 0xFF, size_t(oc) * 2));  // NaN: an unwritten element fails
  }
  GroupedGemmParams pg = p;
  pg.group_sizes = dg, pg.a = da, pg.b = db, pg.out = dout;
  if (fp8) pg.a_scale_inv = dsa, pg.b_scale_inv = dsb;
  pg.a_elements = a_count(p), pg.b_elements = b_count(p), pg.out_elements = oc;
  pg.a_scale_elements = int64_t(sa.size()), pg.b_scale_elements = int64_t(sb.size());
  pg.workspace_bytes = grouped_gemm_workspace_bytes(pg);
  void* ws = nullptr;
  if (pg.workspace_bytes) {
    CK(cudaMalloc(&ws, pg.workspace_bytes));
    CK(cudaMemset(ws, 0xA5, pg.workspace_bytes));  // garbage
  }
  pg.workspace = ws;
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    s = grouped_gemm_cuda(pg, stream);
    CK(cudaStreamEndCapture(stream, &g));
    if (s.ok()) {
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphLaunch(ge, stream));
      CK(cudaGraphLaunch(ge, stream));  // replays must give the same result
      CK(cudaGraphExecDestroy(ge));
    }
    CK(cudaGraphDestroy(g));
  } else {
    s = grouped_gemm_cuda(pg, stream);
  }
  CK(cudaStreamSynchronize(stream));
  CK(cudaGetLastError());
  std::vector<uint16_t> got(static_cast<size_t>(oc));
  if (oc) CK(cudaMemcpy(got.data(), dout, size_t(oc) * 2, cudaMemcpyDeviceToHost));
  CK(cudaStreamDestroy(stream));
  for (void* ptr : {(void*)da, (void*)db, (void*)dg, (void*)dsa, (void*)dsb, (void*)dout, ws})
    if (ptr) CK(cudaFree(ptr));
  if (!s.ok()) {
    std::printf("FAIL %s [%s]: CUDA: %s\n", label.c_str(), op_name(op), s.message.c_str());
    ++g_failures;
    return;
  }

  // Relative Frobenius error, NaNs, exact zeros.
  double num = 0, den = 0;
  int64_t bad = 0;
  for (int64_t i = 0; i < oc; ++i) {
    const double r = bf16_to_float(ref[i]), v = bf16_to_float(got[i]);
    if (!std::isfinite(v)) {
      ++bad;
      continue;
    }
    num += (v - r) * (v - r);
    den += r * r;
  }
  int64_t nonzero = 0;
  std::vector<int64_t> st, sz;
  int64_t covered = 0;
  if (p.mode == GroupedGemmMode::kRaggedM) {
    ranges(sizes, p.m, &st, &sz, &covered);
    for (int64_t i = covered * p.n; i < oc; ++i) nonzero += (got[i] & 0x7FFF) != 0;
  } else {
    ranges(sizes, p.k, &st, &sz, &covered);
    for (int64_t g = 0; g < G; ++g)
      if (sz[g] == 0)
        for (int64_t i = g * p.m * p.n; i < (g + 1) * p.m * p.n; ++i)
          nonzero += (got[i] & 0x7FFF) != 0;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const double tol = !fp8 ? 8e-3 : (p.fast_accum ? 2e-2 : 8e-3);
  const bool ok = bad == 0 && nonzero == 0 && rel <= tol;
  if (!ok) ++g_failures;
  const std::string name =
      std::string(op_name(op)) + (block_n ? (block_n == 128 ? " blk128" : " blk1") : "");
  std::printf("%s %-34s %-16s rows=%-6lld K=%-5lld N=%-5lld G=%-4lld rel=%.2e%s%s%s%s%s\n",
              ok ? "PASS" : "FAIL", label.c_str(), name.c_str(), (long long)rows, (long long)K,
              (long long)N, (long long)G, rel, bad ? " (non-finite/unwritten)" : "",
              nonzero ? " (rows in no group / empty groups not zero)" : "", graph ? " [graph]" : "",
              backend ? " " : "", backend ? backend : "");
}

// ---- group-size patterns ---------------------------------------------------------------------

std::vector<int32_t> random_sizes(int64_t G, int64_t total, std::mt19937_64& rng, int64_t mult,
                                  double zero_frac) {
  std::gamma_distribution<double> gd(1.0, 1.0);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> w(G);
  double sum = 0;
  for (auto& x : w) {
    x = u(rng) < zero_frac ? 0.0 : gd(rng);
    sum += x;
  }
  std::vector<int32_t> s(G, 0);
  if (sum == 0) {
    s[0] = int32_t(total);
    return s;
  }
  int64_t used = 0;
  for (int64_t g = 0; g < G; ++g) {
    s[g] = int32_t(int64_t(w[g] / sum * double(total)) / mult * mult);
    used += s[g];
  }
  // The remainder goes to the last non-empty group (in whole multiples).
  for (int64_t g = G - 1; g >= 0; --g)
    if (w[g] > 0) {
      s[g] += int32_t((total - used) / mult * mult);
      break;
    }
  return s;
}

struct Shape {
  std::string label;
  int64_t rows, K, N;
  std::vector<int32_t> sizes;
};

std::vector<Shape> shapes(bool quick) {
  std::mt19937_64 rng(1234);
  std::vector<Shape> v;
  auto add = [&](std::string l, int64_t rows, int64_t K, int64_t N, std::vector<int32_t> s) {
    v.push_back({std::move(l), rows, K, N, std::move(s)});
  };
  add("G=4 uneven, an empty group", 300, 256, 384, {100, 0, 150, 50});
  add("all rows in one group", 257, 128, 256, {0, 0, 257, 0, 0});
  add("G=1", 200, 192, 320, {200});
  add("sum < rows (trailing padding)", 300, 128, 128, {64, 100, 99});
  add("sum > rows (clamped)", 250, 128, 128, {100, 120, 90, 40});
  add("negative size", 160, 128, 128, {50, -7, 110});
  add("K,N not multiples of 128", 333, 200, 136, {111, 0, 222});
  add("K,N not multiples of 16", 130, 100, 60, {30, 100});
  add("all groups empty", 64, 128, 128, {0, 0, 0});
  add("G=128 sparse", 1000, 128, 128, random_sizes(128, 1000, rng, 1, 0.3));
  add("G=16 multiples of 16", 1024, 256, 256, random_sizes(16, 1024, rng, 16, 0.1));
  if (!quick) {
    add("G=8 medium uneven", 4096, 1024, 2048, random_sizes(8, 4096, rng, 1, 0.0));
    add("G=64 medium", 8192, 512, 768, random_sizes(64, 8192, rng, 1, 0.1));
    add("G=128 medium", 4096, 1024, 256, random_sizes(128, 4096, rng, 1, 0.1));
    add("G=8 balanced 512-aligned", 4096, 768, 1024, std::vector<int32_t>(8, 512));
  }
  return v;
}

// ---- lowbit's own sm90 kernel on the block-scaled ragged-M calls
// ---------------------------------

// Ragged shapes for LOWBIT_GROUPED_BLOCK_GEMM=sm90own: groups of 0, 1, 127, 128, 129 rows, groups
// ending mid-tile, rows in no group, sums above the rows, N (fwd's n, dgrad's k) and K not
// multiples of 128 (both multiples of 16: the kernel's TMA rows), G = 1, 8, 64, 128.
std::vector<Shape> sm90_shapes(bool quick) {
  std::mt19937_64 rng(90);
  std::vector<Shape> v;
  auto add = [&](std::string l, int64_t rows, int64_t K, int64_t N, std::vector<int32_t> s) {
    v.push_back({std::move(l), rows, K, N, std::move(s)});
  };
  add("sm90 G=8 edges, rows in no group", 800, 272, 208, {0, 1, 127, 128, 129, 0, 200, 50});
  add("sm90 G=1", 300, 256, 144, {300});
  add("sm90 G=1 sum < rows", 300, 128, 128, {250});
  add("sm90 G=4 sum > rows (clamped)", 250, 144, 160, {100, 120, 90, 40});
  add("sm90 negative size", 160, 128, 128, {50, -7, 110});
  add("sm90 all groups empty", 64, 128, 128, {0, 0, 0});
  add("sm90 G=128 sparse", 1000, 128, 128, random_sizes(128, 1000, rng, 1, 0.3));
  add("sm90 G=64", 2048, 384, 400, random_sizes(64, 2000, rng, 1, 0.1));
  if (!quick) {
    // The most groups the kernel's shared-memory table takes (1025 go to CUTLASS, below).
    add("sm90 G=1024", 9000, 128, 144, random_sizes(1024, 8900, rng, 1, 0.2));
    add("sm90 G=64 medium", 8192, 1024, 1408, random_sizes(64, 8100, rng, 1, 0.1));
    add("sm90 G=8 medium", 4096, 2048, 1024, random_sizes(8, 4096, rng, 1, 0.0));
  }
  return v;
}

void check_sm90(bool quick, uint64_t& seed) {
  for (const Shape& s : sm90_shapes(quick)) {
    for (const char* be : {"sm90own", "sm90own:n128_mc/group8"}) {
      // fwd (A E4M3), dgrad with E5M2 (HYBRID) and E4M3 gradients.
      check(s.label, Op::kFwdFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, false,
            false, seed++, 128, be);
      check(s.label, Op::kDgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, false,
            false, seed++, 128, be);
      check(s.label + " e4m3", Op::kDgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE4M3,
            false, false, seed++, 128, be);
    }
  }
  // auto (measured at the first call), and captured in a CUDA graph (the cached winner, or the
  // first candidate) with each setting.
  const Shape s0 = sm90_shapes(true)[0];
  for (const char* be : {"auto", "sm90own", "cutlass"}) {
    check(s0.label, Op::kFwdFp8, s0.rows, s0.K, s0.N, s0.sizes, DType::kE4M3, DType::kE5M2, false,
          false, seed++, 128, be);
    check(s0.label, Op::kDgradFp8, s0.rows, s0.K, s0.N, s0.sizes, DType::kE4M3, DType::kE5M2, false,
          true, seed++, 128, be);
  }
}

// A bad LOWBIT_GROUPED_BLOCK_GEMM, and sm90own forced where it cannot run (K % 16 != 0, more
// than 1024 groups): clear errors, nothing launched.
void check_sm90_errors() {
  auto expect = [](const char* value, int64_t K, int64_t G, const char* needle) {
    ++g_cases;
    const Backend scope(value);
    GroupedGemmParams p = view(Op::kFwdFp8, 64, K, 128, G, DType::kE4M3, DType::kE5M2, false);
    set_block(&p, 128);
    std::vector<int32_t> sizes(size_t(G), 0);
    sizes[0] = sizes[G - 1] = 32;
    int32_t* dg = to_device(sizes);
    std::vector<uint8_t> zeros(size_t(std::max(a_count(p), b_count(p))), 0);
    uint8_t* da = to_device(zeros);
    uint8_t* db = to_device(zeros);
    std::vector<float> ones(size_t(std::max(scale_count(p, true), scale_count(p, false))), 1.f);
    float* ds = to_device(ones);
    void* out = nullptr;
    CK(cudaMalloc(&out, size_t(out_count(p)) * 2));
    p.group_sizes = dg, p.a = da, p.b = db, p.out = out, p.a_scale_inv = ds, p.b_scale_inv = ds;
    p.workspace_bytes = grouped_gemm_workspace_bytes(p);
    CK(cudaMalloc(&p.workspace, std::max<size_t>(p.workspace_bytes, 1)));
    const Status st = grouped_gemm_cuda(p, nullptr);
    CK(cudaDeviceSynchronize());
    for (void* ptr : {(void*)dg, (void*)da, (void*)db, (void*)ds, out, p.workspace})
      CK(cudaFree(ptr));
    const bool ok = !st.ok() && st.message.find(needle) != std::string::npos;
    if (!ok) ++g_failures;
    std::printf("%s error for LOWBIT_GROUPED_BLOCK_GEMM=%s K=%lld G=%lld: %s\n",
                ok ? "PASS" : "FAIL", value, (long long)K, (long long)G,
                st.ok() ? "(none)" : st.message.c_str());
  };
  expect("fastest", 128, 2, "LOWBIT_GROUPED_BLOCK_GEMM must be");
  expect("sm90own", 120, 2, "K > 0 a multiple of 16");
  expect("sm90own", 128, 1025, "at most 1024 groups");
}

// ---- benchmark -------------------------------------------------------------------------------

__global__ void fill_random(uint8_t* p, int64_t n, uint32_t seed, int bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float x = (float(h & 0xFFFF) / 65536.f - 0.5f) * 2.f;
    if (bf16) {
      reinterpret_cast<uint16_t*>(p)[i] = uint16_t(__float_as_uint(x) >> 16);
    } else {
      p[i] = uint8_t((h >> 16) & 0xF7);  // finite E4M3/E5M2 codes of either sign
    }
  }
}

uint8_t* device_random(int64_t count, DType t, uint32_t seed) {
  uint8_t* d = nullptr;
  if (count == 0) return nullptr;
  CK(cudaMalloc(&d, size_t(count) * esize(t)));
  fill_random<<<1024, 256>>>(d, count, seed, t == DType::kBF16);
  CK(cudaGetLastError());
  return d;
}

template <typename F>
double time_ms(F fn, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) fn();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms / iters;
}

double bench_grouped(Op op, int64_t rows, int64_t K, int64_t N, const std::vector<int32_t>& sizes,
                     bool fast, int block_n = 0, const char* backend = nullptr) {
  const Backend scope(backend);
  const int64_t G = int64_t(sizes.size());
  GroupedGemmParams p = view(op, rows, K, N, G, DType::kE4M3, DType::kE5M2, fast);
  set_block(&p, block_n);
  uint8_t* da = device_random(a_count(p), p.a_dtype, 1);
  uint8_t* db = device_random(b_count(p), p.b_dtype, 2);
  std::vector<float> ones(std::max(scale_count(p, true), scale_count(p, false)), 1.f);
  float* ds = to_device(ones);
  int32_t* dg = to_device(sizes);
  void* out = nullptr;
  CK(cudaMalloc(&out, size_t(out_count(p)) * 2));
  p.group_sizes = dg, p.a = da, p.b = db, p.out = out;
  if (p.a_dtype != DType::kBF16) p.a_scale_inv = ds, p.b_scale_inv = ds;
  p.workspace_bytes = grouped_gemm_workspace_bytes(p);
  CK(cudaMalloc(&p.workspace, std::max<size_t>(p.workspace_bytes, 1)));
  Status st;
  const double ms = time_ms([&] { st = grouped_gemm_cuda(p, nullptr); }, 20);
  CK(cudaDeviceSynchronize());
  for (void* ptr : {(void*)da, (void*)db, (void*)ds, (void*)dg, out, p.workspace})
    CK(cudaFree(ptr));
  if (!st.ok()) {
    std::printf("FAIL bench %s: %s\n", op_name(op), st.message.c_str());
    ++g_failures;
    return 0;
  }
  return ms;
}

double bench_dense(bool fp8, int64_t M, int64_t K, int64_t N) {
  GemmParams p;
  p.a_dtype = p.b_dtype = fp8 ? DType::kE4M3 : DType::kBF16;
  p.m = M, p.n = N, p.k = K;
  uint8_t* da = device_random(M * K, p.a_dtype, 3);
  uint8_t* db = device_random(N * K, p.b_dtype, 4);
  std::vector<float> one(1, 1.f);
  float* ds = to_device(one);
  void* out = nullptr;
  CK(cudaMalloc(&out, size_t(M * N) * 2));
  CK(cudaMalloc(&p.workspace, kGemmWorkspaceBytes));
  p.workspace_bytes = kGemmWorkspaceBytes;
  p.a = da, p.b = db, p.out = out;
  if (fp8) p.a_scale_inv = ds, p.b_scale_inv = ds, p.fast_accum = true;
  Status st;
  const double ms = time_ms([&] { st = gemm_cuda(p, nullptr); }, 20);
  CK(cudaDeviceSynchronize());
  for (void* ptr : {(void*)da, (void*)db, (void*)ds, out, p.workspace}) CK(cudaFree(ptr));
  if (!st.ok()) {
    std::printf("(dense cuBLASLt GEMM failed: %s)\n", st.message.c_str());
    return 0;
  }
  return ms;
}

// The block-scaled ragged-M GEMMs (fwd, dgrad; 128x128 weight blocks) on CUTLASS, each variant of
// lowbit's own sm90 kernel and the measured choice, at the MoE shapes of bench() (those of
// `python -m lowbit.bench grouped` and scripts/grouped_goal_probe.py: G = 8, 64, 128).
void bench_block() {
  struct B {
    int64_t G, rows, K, N;
  };
  const B cases[] = {{8, 32768, 4096, 14336}, {64, 65536, 2048, 1536}, {128, 16384, 4096, 1024}};
  std::mt19937_64 rng(11);
  std::printf(
      "\n| G | rows x K x N | sizes | op | backend | ms | TFLOP/s |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const B& c : cases) {
    const double flops = 2.0 * double(c.rows) * double(c.K) * double(c.N);
    for (int d = 0; d < 2; ++d) {
      const auto sizes = d == 0 ? std::vector<int32_t>(c.G, int32_t(c.rows / c.G))
                                : random_sizes(c.G, c.rows, rng, 1, 0.0);
      for (Op op : {Op::kFwdFp8, Op::kDgradFp8})
        for (const char* be : {"cutlass", "sm90own:n128/group8", "sm90own:n128_mc/group8",
                               "sm90own:n128/group16", "sm90own:n128_mc/group16", "auto"}) {
          const double ms = bench_grouped(op, c.rows, c.K, c.N, sizes, false, 128, be);
          std::printf("| %lld | %lldx%lldx%lld | %s | %s block | %s | %.3f | %.0f |\n",
                      (long long)c.G, (long long)c.rows, (long long)c.K, (long long)c.N,
                      d == 0 ? "balanced" : "dirichlet", op_name(op), be, ms,
                      ms > 0 ? flops / ms / 1e9 : 0.0);
        }
    }
  }
}

void bench() {
  struct B {
    int64_t G, rows, K, N;
  };
  const B cases[] = {{8, 32768, 4096, 14336}, {64, 65536, 2048, 1536}, {128, 16384, 4096, 1024}};
  std::mt19937_64 rng(7);
  std::printf("\n| G | rows x K x N | sizes | op | ms | TFLOP/s |\n|---|---|---|---|---|---|\n");
  for (const B& c : cases) {
    const double flops = 2.0 * double(c.rows) * double(c.K) * double(c.N);
    for (int d = 0; d < 2; ++d) {
      // Balanced, or Dirichlet(1) sizes of any value (FP8's wgrad then realigns most groups).
      const auto sizes = d == 0 ? std::vector<int32_t>(c.G, int32_t(c.rows / c.G))
                                : random_sizes(c.G, c.rows, rng, 1, 0.0);
      for (Op op : {Op::kFwdBf16, Op::kDgradBf16, Op::kWgradBf16, Op::kFwdFp8, Op::kDgradFp8,
                    Op::kWgradFp8}) {
        const double ms = bench_grouped(op, c.rows, c.K, c.N, sizes, op == Op::kFwdFp8);
        std::printf("| %lld | %lldx%lldx%lld | %s | %s | %.3f | %.0f |\n", (long long)c.G,
                    (long long)c.rows, (long long)c.K, (long long)c.N,
                    d == 0 ? "balanced" : "dirichlet", op_name(op), ms,
                    ms > 0 ? flops / ms / 1e9 : 0.0);
      }
      // Float8BlockScaling: fwd / dgrad with 128x128 weight blocks, wgrad 1x128 x 1x128.
      for (Op op : {Op::kFwdFp8, Op::kDgradFp8, Op::kWgradFp8}) {
        const int bn = op == Op::kWgradFp8 ? 1 : 128;
        const double ms = bench_grouped(op, c.rows, c.K, c.N, sizes, false, bn);
        std::printf("| %lld | %lldx%lldx%lld | %s | %s block | %.3f | %.0f |\n", (long long)c.G,
                    (long long)c.rows, (long long)c.K, (long long)c.N,
                    d == 0 ? "balanced" : "dirichlet", op_name(op), ms,
                    ms > 0 ? flops / ms / 1e9 : 0.0);
      }
    }
    for (int f = 0; f < 2; ++f) {
      const double ms = bench_dense(f == 1, c.rows, c.K, c.N);
      std::printf("| - | %lldx%lldx%lld | dense | cuBLASLt %s | %.3f | %.0f |\n", (long long)c.rows,
                  (long long)c.K, (long long)c.N, f ? "fp8" : "bf16", ms,
                  ms > 0 ? flops / ms / 1e9 : 0.0);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, do_bench = false, do_bench_block = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--bench" || a == "bench")
      do_bench = true;
    else if (a == "--bench-block")
      do_bench_block = true;
    else {
      std::printf("usage: %s [--quick | --bench | --bench-block]\n", argv[0]);
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (do_bench_block) {
    bench_block();
    std::printf("%s\n", g_failures ? "FAIL" : "PASS");
    return g_failures ? 1 : 0;
  }
  if (do_bench) {
    bench();
    std::printf("%s\n", g_failures ? "FAIL" : "PASS");
    return g_failures ? 1 : 0;
  }
  uint64_t seed = 1;
  for (const Shape& s : shapes(quick)) {
    for (Op op :
         {Op::kFwdBf16, Op::kDgradBf16, Op::kWgradBf16, Op::kFwdFp8, Op::kDgradFp8, Op::kWgradFp8})
      check(s.label, op, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, op == Op::kFwdFp8,
            false, seed++);
    // The E4M3-only recipe's backward, and the forward without fast accumulation.
    check(s.label + " e4m3", Op::kDgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE4M3,
          false, false, seed++);
    check(s.label + " e4m3", Op::kWgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE4M3,
          false, false, seed++);
    check(s.label + " no fast accum", Op::kFwdFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3,
          DType::kE5M2, false, false, seed++);
    // Float8BlockScaling: 128x128 and 1x128 weight blocks (E4M3, and HYBRID's E5M2 gradients).
    for (int bn : {128, 1}) {
      check(s.label, Op::kFwdFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, false,
            false, seed++, bn);
      check(s.label, Op::kDgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, false,
            false, seed++, bn);
      check(s.label + " e4m3", Op::kDgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE4M3,
            false, false, seed++, bn);
    }
    check(s.label, Op::kWgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE5M2, false,
          false, seed++, 1);
    check(s.label + " e4m3", Op::kWgradFp8, s.rows, s.K, s.N, s.sizes, DType::kE4M3, DType::kE4M3,
          false, false, seed++, 1);
  }
  // Captured in a CUDA graph and replayed (XLA command buffers).
  const auto s0 = shapes(true)[0];
  for (Op op : {Op::kFwdBf16, Op::kWgradBf16, Op::kFwdFp8, Op::kWgradFp8})
    check(s0.label, op, s0.rows, s0.K, s0.N, s0.sizes, DType::kE4M3, DType::kE5M2,
          op == Op::kFwdFp8, true, seed++);
  check(s0.label, Op::kFwdFp8, s0.rows, s0.K, s0.N, s0.sizes, DType::kE4M3, DType::kE5M2, false,
        true, seed++, 128);
  check(s0.label, Op::kWgradFp8, s0.rows, s0.K, s0.N, s0.sizes, DType::kE4M3, DType::kE5M2, false,
        true, seed++, 1);
  // lowbit's own sm90 kernel (sm_90 only; elsewhere the router keeps CUTLASS).
  if (prop.major == 9) {
    check_sm90(quick, seed);
    check_sm90_errors();
  }
  std::printf("%d/%d cases passed\n%s\n", g_cases - g_failures, g_cases,
              g_failures ? "FAIL" : "PASS");
  return g_failures ? 1 : 0;
}
