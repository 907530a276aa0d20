// Standalone checks of the MoE CUDA kernels against the CPU reference kernels (no JAX). Exit
// status 1 on any failure.
//   lowbit_check_moe          full set
//   lowbit_check_moe --bench  microseconds per kernel at the benchmark's MoE shapes
//
// Compared: router experts exactly and weights / dlogits within float32 rounding (exp and the
// sums round differently); the dispatch plan exactly (also past one 1024-pair chunk, with
// alignment and capacity); the plain and the FP8 permutation (rowwise, colwise, scale_inv,
// amax) exactly; combine output (float32 and bf16) and dy exactly (same summation order; every
// element written, padding rows included: the device buffers start as NaN bytes), dw within
// float32 rounding. Vector (d % 8 == 0) and scalar (d = 44) combine kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check_common.h"
#include "lowbit/formats.h"
#include "lowbit/moe.h"

using namespace lowbit;

namespace {

template <typename T>
T* dev(const std::vector<T>& h) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CUDA_OK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> host(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
template <typename T>
T* zeros(size_t n) {
  return dev(std::vector<T>(n, T(0)));
}
// A device buffer of NaN bytes: every element a kernel should write is checked to be written.
template <typename T>
T* garbage(size_t n) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)));
  CUDA_OK(cudaMemset(d, 0xff, n * sizeof(T)));
  return d;
}

float max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0.0f;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(a[i] - b[i]) / std::max(1e-6f, std::fabs(b[i])));
  return m;
}

void check_router(std::mt19937& rng, int64_t T, int64_t E, int k, MoeScore fn, bool pre, int G,
                  int gk, bool bias) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> z(T * E), b(E), dw(T * k);
  for (auto& v : z) v = nd(rng);
  for (auto& v : b) v = 0.1f * nd(rng);
  for (auto& v : dw) v = nd(rng);
  MoeRouterParams p;
  p.T = T, p.E = E, p.topk = k, p.score = fn, p.pre_softmax = pre, p.num_groups = G;
  p.group_topk = gk, p.scaling = 1.5f;
  std::vector<float> w(T * k);
  std::vector<int32_t> ex(T * k);
  p.logits = z.data(), p.bias = bias ? b.data() : nullptr, p.weights = w.data(),
  p.experts = ex.data();
  report(moe_router_fwd_cpu(p).ok(), "router cpu", "status");
  MoeRouterParams q = p;
  q.logits = dev(z), q.bias = bias ? dev(b) : nullptr, q.weights = zeros<float>(T * k);
  q.experts = zeros<int32_t>(T * k);
  report(moe_router_fwd_cuda(q, nullptr).ok(), "router cuda", "status");
  CUDA_OK(cudaDeviceSynchronize());
  char msg[160];
  std::snprintf(msg, sizeof msg, "T=%ld E=%ld k=%d fn=%d pre=%d G=%d", long(T), long(E), k, int(fn),
                pre, G);
  report(host(q.experts, T * k) == ex, "router experts", msg);
  report(max_rel(host(q.weights, T * k), w) < 1e-5f, "router weights", msg);
  MoeRouterBwdParams bp;
  bp.T = T, bp.E = E, bp.topk = k, bp.score = fn, bp.pre_softmax = pre, bp.scaling = 1.5f;
  std::vector<float> dz(T * E);
  bp.logits = z.data(), bp.experts = ex.data(), bp.dweights = dw.data(), bp.dlogits = dz.data();
  report(moe_router_bwd_cpu(bp).ok(), "router bwd cpu", "status");
  MoeRouterBwdParams bq = bp;
  bq.logits = q.logits, bq.experts = dev(ex), bq.dweights = dev(dw),
  bq.dlogits = zeros<float>(T * E);
  report(moe_router_bwd_cuda(bq, nullptr).ok(), "router bwd cuda", "status");
  CUDA_OK(cudaDeviceSynchronize());
  auto g = host(bq.dlogits, T * E);
  float err = 0.0f, scale = 1e-6f;
  for (size_t i = 0; i < g.size(); ++i) {
    err = std::max(err, std::fabs(g[i] - dz[i]));
    scale = std::max(scale, std::fabs(dz[i]));
  }
  report(err <= 1e-5f * scale, "router dlogits", msg);
}

void check_dispatch(std::mt19937& rng, int64_t T, int64_t k, int64_t E, int64_t align, int64_t cap,
                    int64_t d) {
  std::vector<int32_t> ex(T * k);
  for (int64_t t = 0; t < T; ++t) {  // k distinct experts per token
    std::vector<int32_t> all(E);
    for (int e = 0; e < E; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < k; ++j) ex[t * k + j] = all[j];
  }
  const int64_t P = T * k, a = std::max<int64_t>(align, 1);
  int64_t rows = P + E * (a - 1);
  if (cap >= 0) rows = std::min(rows, E * ((cap + a - 1) / a * a));
  // align 0 means none: the kernels take align >= 1 (lowbit.ops._ffi.moe.plan passes
  // max(align, 1)) and refuse 0.
  MoePlanParams p;
  p.T = T, p.k = k, p.E = E, p.rows = rows, p.align = 0, p.capacity = cap;
  std::vector<int32_t> dest(P), src(rows), sz(E), off(E), cnt(E);
  p.experts = ex.data(), p.dest = dest.data(), p.src = src.data(), p.sizes = sz.data();
  p.offsets = off.data(), p.counts = cnt.data();
  report(!moe_plan_cpu(p).ok(), "plan cpu", "align 0 accepted");
  p.align = a;
  const Status planned = moe_plan_cpu(p);
  report(planned.ok(), "plan cpu", planned.message.c_str());
  if (!planned.ok()) return;  // nothing valid to compare the GPU against
  MoePlanParams q = p;
  q.experts = dev(ex), q.dest = zeros<int32_t>(P), q.src = zeros<int32_t>(rows);
  q.sizes = zeros<int32_t>(E), q.offsets = zeros<int32_t>(E), q.counts = zeros<int32_t>(E);
  q.scratch_len = moe_plan_scratch_len(T, k, E);
  q.scratch = zeros<int32_t>(q.scratch_len);
  MoePlanParams q0 = q;
  q0.align = 0;
  report(!moe_plan_cuda(q0, nullptr).ok(), "plan cuda", "align 0 accepted");
  report(moe_plan_cuda(q, nullptr).ok(), "plan cuda", "status");
  CUDA_OK(cudaDeviceSynchronize());
  char msg[160];
  std::snprintf(msg, sizeof msg, "T=%ld k=%ld E=%ld align=%ld cap=%ld", long(T), long(k), long(E),
                long(align), long(cap));
  report(host(q.dest, P) == dest && host(q.src, rows) == src && host(q.sizes, E) == sz &&
             host(q.offsets, E) == off && host(q.counts, E) == cnt,
         "plan", msg);
  // permute, FP8 (current and delayed, E4M3) and combine on bf16 tokens
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<uint16_t> x(T * d), y(rows * d), g(T * d);
  for (auto& v : x) v = float_to_bf16(nd(rng));
  for (auto& v : y) v = float_to_bf16(nd(rng));
  for (auto& v : g) v = float_to_bf16(nd(rng));
  std::vector<float> delayed(E), w(P);
  for (auto& v : delayed) v = 20.0f + std::fabs(nd(rng));
  for (auto& v : w) v = std::fabs(nd(rng));
  for (int mode = 0; mode < 3; ++mode) {
    MoePermuteParams pp;
    pp.T = T, pp.k = k, pp.d = d, pp.rows = rows, pp.E = E, pp.dtype = DType::kBF16;
    pp.mode = mode == 0 ? ScalingMode::kNoScaling
                        : (mode == 1 ? ScalingMode::kCurrentTensor : ScalingMode::kDelayedTensor);
    const size_t ob = mode == 0 ? 2 : 1;
    std::vector<uint8_t> out(rows * d * ob), col(mode ? rows * d : 0);
    std::vector<float> si(E), am(E), ra(T);
    // delayed is set in every mode on purpose: current scaling must ignore it.
    pp.x = x.data(), pp.src = src.data(), pp.experts = ex.data(), pp.delayed = delayed.data();
    pp.out = out.data(), pp.out_col = mode ? col.data() : nullptr, pp.scale_inv = si.data();
    pp.amax = am.data(), pp.row_amax = ra.data();
    report(moe_permute_cpu(pp).ok(), "permute cpu", "status");
    MoePermuteParams pq = pp;
    pq.x = dev(x), pq.src = q.src, pq.experts = q.experts, pq.delayed = dev(delayed);
    pq.out = zeros<uint8_t>(out.size()), pq.out_col = mode ? zeros<uint8_t>(col.size()) : nullptr;
    pq.scale_inv = zeros<float>(E), pq.amax = zeros<float>(E), pq.row_amax = zeros<float>(T);
    report(moe_permute_cuda(pq, nullptr).ok(), "permute cuda", "status");
    CUDA_OK(cudaDeviceSynchronize());
    bool ok = host(static_cast<uint8_t*>(pq.out), out.size()) == out;
    if (mode)
      ok = ok && host(pq.out_col, col.size()) == col && host(pq.scale_inv, E) == si &&
           host(pq.amax, E) == am;
    report(ok, mode == 0 ? "permute" : (mode == 1 ? "permute fp8 current" : "permute fp8 delayed"),
           msg);
  }
  for (DType od : {DType::kF32, DType::kBF16}) {  // the weighted sum rounded once to od
    MoeCombineParams cp;
    cp.T = T, cp.k = k, cp.d = d, cp.rows = rows, cp.y_dtype = DType::kBF16, cp.out_dtype = od;
    std::vector<uint8_t> out(T * d * dtype_bytes(od));
    cp.y = y.data(), cp.w = w.data(), cp.dest = dest.data(), cp.out = out.data();
    report(moe_combine_fwd_cpu(cp).ok(), "combine cpu", "status");
    MoeCombineParams cq = cp;
    cq.y = dev(y), cq.w = dev(w), cq.dest = q.dest, cq.out = garbage<uint8_t>(out.size());
    report(moe_combine_fwd_cuda(cq, nullptr).ok(), "combine cuda", "status");
    CUDA_OK(cudaDeviceSynchronize());
    report(host(static_cast<uint8_t*>(cq.out), out.size()) == out, "combine (same order: exact)",
           msg);
  }
  MoeCombineBwdParams bp;
  bp.T = T, bp.k = k, bp.d = d, bp.rows = rows, bp.y_dtype = DType::kBF16,
  bp.g_dtype = DType::kBF16;
  std::vector<uint16_t> dy(rows * d);
  std::vector<float> dw(P);
  bp.g = g.data(), bp.y = y.data(), bp.w = w.data(), bp.dest = dest.data(), bp.src = src.data();
  bp.dy = dy.data(), bp.dw = dw.data();
  report(moe_combine_bwd_cpu(bp).ok(), "combine bwd cpu", "status");
  MoeCombineBwdParams bq = bp;
  bq.g = dev(g), bq.y = dev(y), bq.w = dev(w), bq.dest = q.dest, bq.src = q.src;
  bq.dy = garbage<uint16_t>(rows * d), bq.dw = garbage<float>(P);  // padding rows: zeroed
  report(moe_combine_bwd_cuda(bq, nullptr).ok(), "combine bwd cuda", "status");
  CUDA_OK(cudaDeviceSynchronize());
  report(host(static_cast<uint16_t*>(bq.dy), rows * d) == dy, "combine dy", msg);
  auto dwg = host(bq.dw, P);
  float err = 0.0f;
  for (int64_t i = 0; i < P; ++i)
    err = std::max(err, std::fabs(dwg[i] - dw[i]) / (1.0f + std::fabs(dw[i])));
  report(err < 1e-4f, "combine dw", msg);
}

float time_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0f;
}

// Microseconds per call of each kernel at T tokens, E experts, top-k, hidden d (bf16).
void bench(int64_t T, int64_t E, int k, int64_t d) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> z(T * E);
  for (auto& v : z) v = nd(rng);
  MoeRouterParams rp;
  rp.T = T, rp.E = E, rp.topk = k, rp.logits = dev(z), rp.weights = zeros<float>(T * k);
  rp.experts = zeros<int32_t>(T * k);
  MoePlanParams pp;
  pp.T = T, pp.k = k, pp.E = E, pp.rows = T * k, pp.experts = rp.experts;
  pp.dest = zeros<int32_t>(T * k), pp.src = zeros<int32_t>(T * k), pp.sizes = zeros<int32_t>(E);
  pp.offsets = zeros<int32_t>(E), pp.counts = zeros<int32_t>(E);
  pp.scratch_len = moe_plan_scratch_len(T, k, E), pp.scratch = zeros<int32_t>(pp.scratch_len);
  MoePermuteParams mp;
  mp.T = T, mp.k = k, mp.d = d, mp.rows = T * k, mp.E = E, mp.x = zeros<uint16_t>(T * d);
  mp.src = pp.src, mp.experts = rp.experts, mp.out = zeros<uint8_t>(T * k * d * 2);
  MoePermuteParams fp = mp;
  fp.mode = ScalingMode::kCurrentTensor, fp.out_col = zeros<uint8_t>(T * k * d);
  fp.scale_inv = zeros<float>(E), fp.amax = zeros<float>(E), fp.row_amax = zeros<float>(T);
  MoeCombineParams cp;
  cp.T = T, cp.k = k, cp.d = d, cp.rows = T * k, cp.y = mp.out, cp.w = rp.weights;
  cp.dest = pp.dest, cp.out = zeros<uint16_t>(T * d);
  MoeCombineBwdParams bp;
  bp.T = T, bp.k = k, bp.d = d, bp.rows = T * k, bp.g = cp.out, bp.y = mp.out, bp.w = rp.weights;
  bp.dest = pp.dest, bp.src = pp.src, bp.dy = zeros<uint16_t>(T * k * d),
  bp.dw = zeros<float>(T * k);
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  // bytes: what the kernel must move at the least (bf16 rows), for the GB/s column.
  auto run = [&](const char* name, double bytes, auto fn) {
    fn();
    CUDA_OK(cudaEventRecord(a));
    for (int i = 0; i < 20; ++i) fn();
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    const float us = time_us(a, b) / 20;
    std::printf("T=%ld E=%ld k=%d d=%ld %-22s %9.1f us %7.0f GB/s\n", long(T), long(E), k, long(d),
                name, us, bytes / us * 1e-3);
  };
  const double tok = double(T) * d * 2, pair = tok * k;  // bf16 bytes of x and of the rows
  run("router fwd", double(T) * E * 4, [&] { (void)moe_router_fwd_cuda(rp, nullptr); });
  run("plan", double(T) * k * 12, [&] { (void)moe_plan_cuda(pp, nullptr); });
  run("permute bf16", tok + pair, [&] { (void)moe_permute_cuda(mp, nullptr); });
  run("permute fp8 row+col", 2 * tok + pair, [&] { (void)moe_permute_cuda(fp, nullptr); });
  // combine fwd is also the permute's backward (weights 1)
  run("combine fwd", pair + tok, [&] { (void)moe_combine_fwd_cuda(cp, nullptr); });
  run("combine bwd (dy + dw)", tok + 2 * pair, [&] { (void)moe_combine_bwd_cuda(bp, nullptr); });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && !std::strcmp(argv[1], "--bench")) {
    bench(16384, 8, 2, 4096);
    bench(16384, 64, 6, 4096);
    bench(4096, 128, 4, 4096);
    return 0;
  }
  std::mt19937 rng(1234);
  const MoeScore fns[] = {MoeScore::kSoftmax, MoeScore::kSigmoid, MoeScore::kSqrtSoftplus};
  for (MoeScore fn : fns)
    for (int pre = 0; pre < 2; ++pre) {
      check_router(rng, 300, 8, 2, fn, pre, 0, 0, false);
      check_router(rng, 200, 64, 6, fn, pre, 0, 0, fn != MoeScore::kSoftmax);
      check_router(rng, 100, 128, 8, fn, pre, 8, 4, fn != MoeScore::kSoftmax);
      check_router(rng, 50, 1000, 40, fn, pre, 0, 0, false);
    }
  check_dispatch(rng, 100, 2, 8, 0, -1, 64);
  check_dispatch(rng, 900, 3, 40, 16, -1, 96);  // > one chunk
  check_dispatch(rng, 500, 4, 16, 8, 90, 40);   // capacity, ragged tiles
  check_dispatch(rng, 1, 1, 1, 0, -1, 16);
  check_dispatch(rng, 300, 2, 8, 4, -1, 44);    // d % 8 != 0: the scalar combine kernels
  check_dispatch(rng, 400, 6, 64, 8, -1, 256);  // G64-like routing, padding rows, vector kernels
  return summary();
}
