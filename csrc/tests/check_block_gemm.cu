// Standalone check of the FP8 block-scaled GEMM (lowbit/block_gemm.h) against the CPU kernel.
//
// Build: cmake -DLOWBIT_BUILD_CHECKS=ON (target lowbit_check_block_gemm).
// Run:
//   check_block_gemm            every case
//   check_block_gemm --quick    small cases only (for compute-sanitizer memcheck)
//   check_block_gemm --bench    lowbit's own kernel (sm90own) timed beside cuBLASLt on the layer
//                               shapes (20 runs each, outputs compared; 1x128 x 128x128 and the
//                               wgrad's 1x128 x 1x128), then the routed GEMM's measurement (each
//                               candidate's time, then the winner), as LOWBIT_BLOCK_GEMM_LOG
//                               prints it
//   check_block_gemm --bench-sm90   the first part only
// Exit status: 0 when every comparison passed.
//
// Every CUTLASS variant runs on ragged shapes (M, N, K not multiples of the 128-wide tiles; K a
// multiple of 16, N of 8, what TMA needs), with no bias, a BF16 or an F32 bias; so does lowbit's
// own kernel (block_gemm_sm90, called directly: 1x128 x 128x128 in every configuration, 1x128 x
// 1x128 at n128 unicast, the only one it has); then the routed GEMM
// (gemm_cuda) under LOWBIT_BLOCK_GEMM=cublaslt, cutlass, sm90own and auto on the shapes
// lowbit.gemm hands it (M, N padded to 16, K to 128), and inside CUDA-graph captures.
//
// Bound (elementwise, stated from the kernel's arithmetic): per 128-deep K block the GPU sums the
// exact FP8 products in the tensor core, whose internal adder keeps ~14 significant bits
// (undocumented; DeepSeek-V3's measurement) across each k32 wgmma (4 per block, each truncating
// the 32 aligned products and the running partial sum: <= 2 x 2^-13 of the block's sum of
// |products|), then adds partial * (sa * sb) (1x128 x 1x128: (partial * sa) * sb) to a float32
// accumulator (the CUTLASS collective and sm90own alike: four m64nNk32 wgmmas into a zeroed
// partial, then one FFMA per element); the CPU reference sums the block in float32 (~K/128 x
// 2^-24, negligible). So
//   |gpu - cpu| <= 2^-8 * S + ulp_out(max(|gpu|, |cpu|)),   S = sum_kb |sa sb| sum_k |a b|,
// 2^-8 = 4 wgmmas x 2 x 2^-13 = 2^-10, times 4 for the adder's unknown width; one output ulp
// covers the two sides' final roundings (and the bias, added in float32 by both). On top,
// the relative Frobenius error must be <= 2e-3 (F32 out) / 6e-3 (BF16 out), which a wrong scale
// layout (errors of the size of the result) cannot meet. Outputs start as NaN (unwritten elements
// fail); scale padding entries are NaN for the CUTLASS and sm90own runs (a stored element never
// depends on them) and 1.0 (lowbit's value) where cuBLASLt may run.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "lowbit/block_gemm.h"
#include "lowbit/block_scaling.h"
#include "lowbit/formats.h"
#include "lowbit/gemm.h"

using namespace lowbit;

namespace {

int g_failures = 0, g_cases = 0;

struct Combo {
  const char* name;
  DType a, b;
  int b_block;
};
const Combo kCombos[] = {
    {"1x128 e4m3 . 128x128 e4m3 (fprop)", DType::kE4M3, DType::kE4M3, abi::kGemmBlock_2d},
    {"1x128 e5m2 . 128x128 e4m3 (dgrad)", DType::kE5M2, DType::kE4M3, abi::kGemmBlock_2d},
    {"1x128 e4m3 . 1x128 e4m3 (wgrad)", DType::kE4M3, DType::kE4M3, abi::kGemmBlock_1d},
    {"1x128 e4m3 . 1x128 e5m2 (wgrad)", DType::kE4M3, DType::kE5M2, abi::kGemmBlock_1d},
};

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  if (h.empty()) return nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<uint8_t> random_codes(DType t, int64_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const SmallFloat f = t == DType::kE4M3 ? kE4M3 : kE5M2;
  const float fmax = t == DType::kE4M3 ? kE4M3Max : kE5M2Max;
  std::vector<uint8_t> out(static_cast<size_t>(count));
  for (auto& c : out) c = uint8_t(encode_rne(std::max(-fmax, std::min(fmax, nd(rng) * 64.f)), f));
  return out;
}

// A block-scale array in lowbit's layout: 2^U(-2, 2) per block, `pad` in the padding entries.
std::vector<float> random_scales(ScalingMode m, int64_t rows, int64_t k, float pad,
                                 std::mt19937_64& rng) {
  const int64_t sr = fp8_block_scale_rows(m, rows, k), sc = fp8_block_scale_cols(m, rows, k);
  std::vector<float> s(static_cast<size_t>(sr * sc), pad);
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  for (int64_t r = 0; r < rows; r += (m == ScalingMode::kBlock2d ? 128 : 1))
    for (int64_t c = 0; c < k; c += 128)
      s[fp8_block_scale_index(m, rows, k, r, c)] = std::exp2(ud(rng));
  return s;
}

float out_value(const std::vector<uint8_t>& o, DType t, int64_t i) {
  if (t == DType::kF32) {
    float v;
    std::memcpy(&v, o.data() + 4 * i, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, o.data() + 2 * i, 2);
  return bf16_to_float(b);
}

double ulp(double x, DType t) {
  const int mant = t == DType::kF32 ? 23 : 7;
  const double a = std::max(std::fabs(x), 1e-30);
  return std::ldexp(1.0, std::ilogb(a) - mant);
}

enum class Run { kCutlass, kSm90, kRouted };

// lowbit's own kernel's configuration `v` (bit 0 multicast, bit 1 BLOCK_N 192) with tile group
// `group`, and its name as LOWBIT_BLOCK_GEMM=sm90own:<name> spells it.
BlockGemmSm90Config sm90_config(int v, int group) {
  BlockGemmSm90Config c;
  c.block_n = v & 2 ? 192 : 128;
  c.multicast = v & 1;
  c.group = group;
  return c;
}
std::string sm90_label(int v, int group) {
  return std::string("sm90own:n") + (v & 2 ? "192" : "128") + (v & 1 ? "_mc" : "") + "/group" +
         std::to_string(group);
}

struct Case {
  int64_t m, n, k;
  const Combo* combo;
  DType out;
  int bias;  // 0 none, 1 BF16, 2 F32
};

std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "M=%-5lld N=%-5lld K=%-5lld %-36s out=%s bias=%s", (long long)c.m,
                (long long)c.n, (long long)c.k, c.combo->name,
                c.out == DType::kF32 ? "f32 " : "bf16",
                c.bias == 0   ? "none"
                : c.bias == 1 ? "bf16"
                              : "f32");
  return buf;
}

// Runs `c` through the CUTLASS variant `variant` (Run::kCutlass), lowbit's own kernel in
// configuration sm90_config(variant, swizzle) (Run::kSm90) or gemm_cuda (Run::kRouted,
// optionally captured in a graph) and compares with the CPU kernel. `expect_error`: the call must
// refuse with a Status instead.
void check(const Case& c, Run run, int variant, int swizzle, bool graph, const std::string& tag,
           bool expect_error = false) {
  ++g_cases;
  std::mt19937_64 rng(uint64_t(c.m * 1000003 + c.n * 1009 + c.k + c.bias));
  const ScalingMode mb = gemm_block_mode(c.combo->b_block);
  const float pad = run == Run::kRouted ? 1.0f : NAN;
  const auto ha = random_codes(c.combo->a, c.m * c.k, rng);
  const auto hb = random_codes(c.combo->b, c.n * c.k, rng);
  const auto sa = random_scales(ScalingMode::kBlock1d, c.m, c.k, pad, rng);
  const auto sb = random_scales(mb, c.n, c.k, pad, rng);
  std::vector<float> bias_f(static_cast<size_t>(c.n));
  std::normal_distribution<float> nd(0.f, 4.f);
  for (auto& v : bias_f) v = nd(rng);
  std::vector<uint16_t> bias_h(bias_f.size());
  for (size_t i = 0; i < bias_f.size(); ++i) {
    bias_h[i] = float_to_bf16(bias_f[i]);
    if (c.bias == 1) bias_f[i] = bf16_to_float(bias_h[i]);
  }
  const int osz = c.out == DType::kF32 ? 4 : 2;
  const int64_t oc = c.m * c.n;

  GemmParams p;
  p.a_dtype = c.combo->a, p.b_dtype = c.combo->b;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.a_block = abi::kGemmBlock_1d, p.b_block = c.combo->b_block;
  p.out_dtype = c.out;
  p.bias_dtype = c.bias == 2 ? DType::kF32 : DType::kBF16;

  // CPU reference and the bound's S (float64, independent of both kernels).
  std::vector<uint8_t> ref(static_cast<size_t>(oc * osz));
  GemmParams pc = p;
  pc.a = ha.data(), pc.b = hb.data(), pc.a_scale_inv = sa.data(), pc.b_scale_inv = sb.data();
  pc.out = ref.data();
  if (c.bias) pc.bias = c.bias == 2 ? (const void*)bias_f.data() : (const void*)bias_h.data();
  Status s = gemm_cpu(pc);
  if (!s.ok()) {
    std::printf("FAIL %s [%s]: CPU: %s\n", describe(c).c_str(), tag.c_str(), s.message.c_str());
    ++g_failures;
    return;
  }

  uint8_t* da = to_device(ha);
  uint8_t* db = to_device(hb);
  float* dsa = to_device(sa);
  float* dsb = to_device(sb);
  void* dbias = c.bias == 2   ? (void*)to_device(bias_f)
                : c.bias == 1 ? (void*)to_device(bias_h)
                              : nullptr;
  uint8_t* dout = nullptr;
  CK(cudaMalloc(&dout, size_t(oc) * osz));
  CK(cudaMemset(dout, 0xFF, size_t(oc) * osz));  // NaN
  void* ws = nullptr;
  CK(cudaMalloc(&ws, kGemmWorkspaceBytes));
  CK(cudaMemset(ws, 0xA5, kGemmWorkspaceBytes));
  GemmParams pg = p;
  pg.a = da, pg.b = db, pg.a_scale_inv = dsa, pg.b_scale_inv = dsb, pg.bias = dbias, pg.out = dout;
  pg.workspace = ws, pg.workspace_bytes = kGemmWorkspaceBytes;
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    s = gemm_cuda(pg, stream);
    CK(cudaStreamEndCapture(stream, &g));
    if (s.ok()) {
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphLaunch(ge, stream));
      CK(cudaGraphLaunch(ge, stream));
      CK(cudaGraphExecDestroy(ge));
    }
    CK(cudaGraphDestroy(g));
  } else if (run == Run::kCutlass) {
    s = block_gemm_cutlass(pg, variant, swizzle, stream);
  } else if (run == Run::kSm90) {
    s = block_gemm_sm90(pg, sm90_config(variant, swizzle), stream);
  } else {
    s = gemm_cuda(pg, stream);
  }
  CK(cudaStreamSynchronize(stream));
  CK(cudaGetLastError());
  std::vector<uint8_t> got(static_cast<size_t>(oc * osz));
  CK(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
  CK(cudaStreamDestroy(stream));
  for (void* ptr : {(void*)da, (void*)db, (void*)dsa, (void*)dsb, dbias, (void*)dout, ws})
    if (ptr) CK(cudaFree(ptr));
  if (expect_error || !s.ok()) {
    const bool ok = expect_error && !s.ok();
    if (!ok) ++g_failures;
    std::printf("%s %s [%s] %s\n", ok ? "PASS" : "FAIL", describe(c).c_str(), tag.c_str(),
                s.ok() ? "ran but should have refused" : ("refused: " + s.message).c_str());
    return;
  }

  // Decoded operands for S.
  const SmallFloat fa = c.combo->a == DType::kE4M3 ? kE4M3 : kE5M2;
  const SmallFloat fb = c.combo->b == DType::kE4M3 ? kE4M3 : kE5M2;
  std::vector<double> va(ha.size()), vb(hb.size());
  for (size_t i = 0; i < ha.size(); ++i) va[i] = std::fabs(decode(ha[i], fa));
  for (size_t i = 0; i < hb.size(); ++i) vb[i] = std::fabs(decode(hb[i], fb));
  int64_t bad = 0, over = 0;
  double num = 0, den = 0, worst = 0;
  for (int64_t m = 0; m < c.m; ++m)
    for (int64_t n = 0; n < c.n; ++n) {
      double S = 0;
      for (int64_t k0 = 0; k0 < c.k; k0 += 128) {
        double blk = 0;
        for (int64_t k = k0; k < std::min(c.k, k0 + 128); ++k)
          blk += va[m * c.k + k] * vb[n * c.k + k];
        S += blk *
             std::fabs(double(sa[fp8_block_scale_index(ScalingMode::kBlock1d, c.m, c.k, m, k0)]) *
                       double(sb[fp8_block_scale_index(mb, c.n, c.k, n, k0)]));
      }
      const int64_t i = m * c.n + n;
      const double r = out_value(ref, c.out, i), v = out_value(got, c.out, i);
      if (!std::isfinite(v)) {
        ++bad;
        continue;
      }
      const double err = std::fabs(v - r);
      const double bound = std::ldexp(S, -8) + ulp(std::max(std::fabs(v), std::fabs(r)), c.out);
      if (err > bound) ++over;
      worst = std::max(worst, err / bound);
      num += (v - r) * (v - r);
      den += r * r;
    }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const double tol = c.out == DType::kF32 ? 2e-3 : 6e-3;
  const bool ok = bad == 0 && over == 0 && rel <= tol;
  if (!ok) ++g_failures;
  std::printf("%s %s [%s] rel=%.2e err/bound max=%.3f%s%s\n", ok ? "PASS" : "FAIL",
              describe(c).c_str(), tag.c_str(), rel, worst, bad ? " (non-finite/unwritten)" : "",
              over ? " (over the bound)" : "");
}

void set_mode(const char* m) { setenv("LOWBIT_BLOCK_GEMM", m, 1); }

void bench() {
  setenv("LOWBIT_BLOCK_GEMM_LOG", "1", 1);
  set_mode("auto");
  const int64_t shapes[][3] = {{8192, 8192, 8192},  {8192, 12288, 4096}, {8192, 4096, 4096},
                               {8192, 16384, 4096}, {8192, 4096, 16384}, {4096, 16384, 8192},
                               {16384, 4096, 8192}};
  for (const Combo& cb : kCombos) {
    if (cb.a != DType::kE4M3 || cb.b != DType::kE4M3) continue;
    std::printf("--- %s\n", cb.name);
    for (const auto& sh : shapes) {
      const int64_t M = sh[0], N = sh[1], K = sh[2];
      GemmParams p;
      p.a_dtype = cb.a, p.b_dtype = cb.b, p.m = M, p.n = N, p.k = K;
      p.a_block = abi::kGemmBlock_1d, p.b_block = cb.b_block, p.out_dtype = DType::kBF16;
      const ScalingMode mb = gemm_block_mode(cb.b_block);
      void *a, *b, *sa, *sb, *out, *ws;
      CK(cudaMalloc(&a, M * K));
      CK(cudaMalloc(&b, N * K));
      CK(cudaMemset(a, 0x38, M * K));  // 1.0 in E4M3
      CK(cudaMemset(b, 0x38, N * K));
      const size_t nsa = fp8_block_scale_rows(ScalingMode::kBlock1d, M, K) *
                         fp8_block_scale_cols(ScalingMode::kBlock1d, M, K);
      const size_t nsb = fp8_block_scale_rows(mb, N, K) * fp8_block_scale_cols(mb, N, K);
      std::vector<float> ones(std::max(nsa, nsb), 1.0f);
      CK(cudaMalloc(&sa, nsa * 4));
      CK(cudaMalloc(&sb, nsb * 4));
      CK(cudaMemcpy(sa, ones.data(), nsa * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sb, ones.data(), nsb * 4, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&out, M * N * 2));
      CK(cudaMalloc(&ws, kGemmWorkspaceBytes));
      p.a = a, p.b = b, p.a_scale_inv = (float*)sa, p.b_scale_inv = (float*)sb, p.out = out;
      p.workspace = ws, p.workspace_bytes = kGemmWorkspaceBytes;
      const Status s = gemm_cuda(p, nullptr);
      CK(cudaDeviceSynchronize());
      if (!s.ok()) std::printf("FAIL %s\n", s.message.c_str()), ++g_failures;
      for (void* ptr : {a, b, sa, sb, out, ws}) CK(cudaFree(ptr));
    }
  }
}

// Mean ms of `reps` runs of f after two warm-ups (events on the legacy stream).
template <class F>
double time_ms(F f, int reps) {
  for (int i = 0; i < 2; ++i) f();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) f();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return double(ms) / reps;
}

// lowbit's own kernel beside cuBLASLt for one dtype / block-mode pair `cb` at `shapes`, each timed
// alone (not the router's short first-call measurement), on random codes (no NaN: bit 6 clear)
// and random block scales, every configuration `configs` names (sm90_config's v) x tile groups 8
// and 16; the two BF16 outputs must agree (relative Frobenius difference <= 6e-3).
void bench_sm90_combo(const Combo& cb, const std::vector<std::array<int64_t, 3>>& shapes,
                      const std::vector<int>& configs, std::mt19937_64& rng) {
  std::printf("--- sm90own vs cuBLASLt, %s, BF16 out (TFLOP/s)\n", cb.name);
  const ScalingMode mb = gemm_block_mode(cb.b_block);
  for (const auto& sh : shapes) {
    const int64_t M = sh[0], N = sh[1], K = sh[2];
    std::vector<uint8_t> ha(size_t(M * K)), hb(size_t(N * K));
    for (auto* v : {&ha, &hb})
      for (size_t i = 0; i < v->size(); i += 8) {
        const uint64_t r = rng() & 0xBFBFBFBFBFBFBFBFull;
        std::memcpy(v->data() + i, &r, std::min<size_t>(8, v->size() - i));
      }
    GemmParams p;
    p.a_dtype = cb.a, p.b_dtype = cb.b, p.m = M, p.n = N, p.k = K;
    p.a_block = abi::kGemmBlock_1d, p.b_block = cb.b_block, p.out_dtype = DType::kBF16;
    const auto sa = random_scales(ScalingMode::kBlock1d, M, K, 1.0f, rng);
    const auto sb = random_scales(mb, N, K, 1.0f, rng);
    uint8_t *da = to_device(ha), *db = to_device(hb);
    float *dsa = to_device(sa), *dsb = to_device(sb);
    void *out_ref, *out_own, *ws;
    CK(cudaMalloc(&out_ref, M * N * 2));
    CK(cudaMalloc(&out_own, M * N * 2));
    CK(cudaMalloc(&ws, kGemmWorkspaceBytes));
    p.a = da, p.b = db, p.a_scale_inv = dsa, p.b_scale_inv = dsb;
    p.workspace = ws, p.workspace_bytes = kGemmWorkspaceBytes;
    const double flop = 2.0 * double(M) * double(N) * double(K);
    set_mode("cublaslt");
    GemmParams pr = p;
    pr.out = out_ref;
    Status st = Status::Ok();
    const double t_ref = time_ms([&] { st = gemm_cuda(pr, nullptr); }, 20);
    std::printf("%5lld x %5lld x %5lld  cublaslt %6.0f", (long long)M, (long long)N, (long long)K,
                flop / (t_ref * 1e9));
    if (!st.ok()) std::printf(" FAIL %s", st.message.c_str()), ++g_failures;
    GemmParams po = p;
    po.out = out_own;
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> r(size_t(M * N)), o(size_t(M * N));
    CK(cudaMemcpy(r.data(), out_ref, r.size() * 2, cudaMemcpyDeviceToHost));
    std::printf("\n");
    for (int v : configs)
      for (int group : {8, 16}) {
        CK(cudaMemset(out_own, 0xFF, M * N * 2));  // NaN: an unwritten element fails
        const BlockGemmSm90Config cfg = sm90_config(v, group);
        const double t = time_ms([&] { st = block_gemm_sm90(po, cfg, nullptr); }, 20);
        std::printf("    %-26s %6.0f (%.3f of cublaslt)", sm90_label(v, group).c_str(),
                    flop / (t * 1e9), t_ref / t);
        if (!st.ok()) std::printf(" FAIL %s", st.message.c_str()), ++g_failures;
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(o.data(), out_own, o.size() * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (size_t i = 0; i < r.size(); ++i) {
          const double a = bf16_to_float(r[i]), b = bf16_to_float(o[i]);
          num += (a - b) * (a - b), den += a * a;
        }
        const double rel = std::sqrt(num / std::max(den, 1e-300));
        const bool ok = std::isfinite(rel) && rel <= 6e-3;
        if (!ok) ++g_failures;
        std::printf("  vs cublaslt rel=%.2e %s\n", rel, ok ? "PASS" : "FAIL");
      }
    for (void* ptr : {(void*)da, (void*)db, (void*)dsa, (void*)dsb, out_ref, out_own, ws})
      CK(cudaFree(ptr));
  }
  set_mode("auto");
}

// The 1x128 x 128x128 layer shapes (fprop, dgrad: every configuration), then the layer's wgrad
// shapes in 1x128 x 1x128 (E4M3 x E4M3; n128 unicast, the only configuration it has).
void bench_sm90() {
  std::mt19937_64 rng(7);
  bench_sm90_combo(kCombos[0],
                   {{8192, 8192, 8192},
                    {8192, 4096, 16384},
                    {4096, 16384, 8192},
                    {16384, 4096, 8192},
                    {8192, 16384, 4096}},
                   {0, 1, 2, 3}, rng);
  bench_sm90_combo(kCombos[2], {{16384, 4096, 8192}, {4096, 16384, 8192}, {8192, 8192, 8192}},
                   {0, 1}, rng);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a kill (a hung kernel under timeout)
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 1 && std::strcmp(argv[1], "--bench-sm90") == 0) {
    bench_sm90();
    return g_failures ? 1 : 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) {
    bench_sm90();
    bench();
    return g_failures ? 1 : 0;
  }
  if (!block_gemm_cutlass_built()) {
    std::printf("FAIL built without CUTLASS\n");
    return 1;
  }
  // Ragged shapes for the CUTLASS variants: M anything, N % 8, K % 16 (one K not a multiple of
  // 128: the last K block is partial and TMA fills it with zeros).
  std::vector<std::array<int64_t, 3>> ragged = {
      {200, 136, 448}, {77, 264, 256}, {1, 128, 128}, {130, 392, 640}, {256, 256, 1024}};
  if (!quick) ragged.push_back({1000, 1048, 2304}), ragged.push_back({300, 520, 1152});
  const DType outs[] = {DType::kBF16, DType::kF32};
  int idx = 0;
  for (const auto& sh : ragged)
    for (const Combo& cb : kCombos)
      for (DType o : outs) {
        const Case c{sh[0], sh[1], sh[2], &cb, o, idx++ % 3};
        GemmParams q;
        q.a_dtype = cb.a, q.b_dtype = cb.b, q.a_block = abi::kGemmBlock_1d, q.b_block = cb.b_block;
        q.out_dtype = o;
        for (int v = 0; v < block_gemm_cutlass_variants(q); ++v)
          check(c, Run::kCutlass, v, 1 + 3 * (idx % 2), false,
                std::string("cutlass:") + block_gemm_cutlass_name(q, v));
      }

  // lowbit's own kernel: 1x128 x 128x128 at BLOCK_N 128 and 192 (tiles straddling two B
  // scale blocks), with and without multicast, on the same ragged shapes (odd and even N tile
  // counts: a multicast pair's second CTA past N), tile groups 3 (runs of unequal length) and 8;
  // the full run adds shapes with more tiles than SMs (each CTA walks several tiles) and more K
  // blocks than pipeline stages.
  // 1x128 x 1x128 (wgrad, E4M3 x E4M3 and E4M3 x E5M2) has n128 only: configurations 0 and 1
  // (unicast, multicast) per shape and output (tile groups 3 and 8, biases rotating).
  for (const auto& sh : ragged)
    for (const Combo& cb : kCombos) {
      const bool b1d = cb.b_block == abi::kGemmBlock_1d;
      for (DType o : outs)
        for (int i = 0; i < 4; ++i) {
          const int v = i;
          if (b1d && i >= 2) break;
          const Case c{sh[0], sh[1], sh[2], &cb, o, idx++ % 3};
          const int group = idx % 2 ? 3 : 8;
          check(c, Run::kSm90, v, group, false, sm90_label(v, group));
        }
    }
  // The 1x128 x 1x128 kernel refuses BLOCK_N 192 with a Status.
  for (int v = 2; v < 4; ++v)
    check(Case{200, 136, 448, &kCombos[2], DType::kBF16, 0}, Run::kSm90, v, 8, false,
          sm90_label(v, 8) + " 1x128 refused", true);
  // The large shapes once per configuration (their CPU reference takes seconds), dtypes rotating.
  // 1x128 x 1x128 adds its two dtype pairs per shape at n128.
  if (!quick)
    for (const auto& sh : {std::array<int64_t, 3>{2200, 2056, 400}, {1300, 2184, 1040}}) {
      for (int v = 0; v < 4; ++v) {
        const Case c{sh[0], sh[1], sh[2], &kCombos[v % 2], outs[(v / 2 + idx) % 2], idx % 3};
        ++idx;
        check(c, Run::kSm90, v, 16, false, sm90_label(v, 16));
      }
      for (int w = 2; w < 4; ++w) {
        const Case c{sh[0], sh[1], sh[2], &kCombos[w], outs[(w + idx) % 2], idx % 3};
        ++idx;
        check(c, Run::kSm90, w - 2, 16, false, sm90_label(w - 2, 16));
      }
    }

  // The routed GEMM on what lowbit.gemm passes (M, N multiples of 16, K of 128).
  // Every bias on the small shapes of the full run; one bias per case otherwise (--quick keeps
  // memcheck's share of the measurement's launches small; the large shape's reference is slow).
  std::vector<std::array<int64_t, 3>> padded = {{64, 128, 128}};
  if (!quick) padded.push_back({208, 144, 512}), padded.push_back({1024, 1536, 2048});
  int n_case = 0;
  for (const char* mode : {"cublaslt", "cutlass", "sm90own", "auto"}) {
    set_mode(mode);
    for (const auto& sh : padded)
      for (const Combo& cb : kCombos)
        for (DType o : outs) {
          const bool every_bias = !quick && sh[0] * sh[1] * sh[2] < (int64_t(1) << 26);
          const int pick = n_case++ % 3;
          for (int bias = 0; bias < 3; ++bias) {
            if (!every_bias && bias != pick) continue;
            const Case c{sh[0], sh[1], sh[2], &cb, o, bias};
            // cuBLASLt alone cannot add a bias to a BF16 output (it would round twice).
            const bool refuse = std::strcmp(mode, "cublaslt") == 0 && bias && o == DType::kBF16;
            check(c, Run::kRouted, 0, 1, false, std::string("routed ") + mode, refuse);
          }
        }
  }
  // Inside a graph capture on a fresh key: no measurement, the first candidate runs.
  set_mode("auto");
  check(Case{96, 160, 384, &kCombos[0], DType::kBF16, 1}, Run::kRouted, 0, 1, true,
        "routed auto graph");
  set_mode("sm90own:n128/group8");  // one candidate: it runs inside the capture
  check(Case{96, 160, 384, &kCombos[1], DType::kF32, 2}, Run::kRouted, 0, 1, true,
        "routed sm90own graph");
  check(Case{96, 160, 384, &kCombos[3], DType::kBF16, 1}, Run::kRouted, 0, 1, true,
        "routed sm90own graph");
  set_mode("bogus");
  check(Case{64, 128, 128, &kCombos[0], DType::kBF16, 0}, Run::kRouted, 0, 1, false, "bad env",
        true);
  std::printf("%s: %d of %d cases failed\n", g_failures ? "FAIL" : "PASS", g_failures, g_cases);
  return g_failures ? 1 : 0;
}
