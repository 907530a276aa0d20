// Standalone check of the cuDNN fused attention (lowbit/attention.h) against a CPU double
// reference, no JAX: forward and backward (GQA, causal, padding with uneven lengths, bias with
// dbias), ragged (THD) packing fwd/bwd, dropout (kept fraction and reproducibility from the
// device seed), FP8 forward within stated bounds. Exit code 0 when every case passes. Needs
// libcudnn.so.9 on the loader's path or in $LOWBIT_CUDNN_LIBRARY. Run under compute-sanitizer for
// memcheck.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "lowbit/attention.h"

using namespace lowbit;

namespace {

int g_failures = 0;

void expect(bool ok, const char* what, double got, double bound) {
  std::printf("%-48s %s (%.3g, bound %.3g)\n", what, ok ? "ok" : "FAIL", got, bound);
  if (!ok) ++g_failures;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  cudaMalloc(&d, h.size() * sizeof(T) + 16);
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

std::vector<__nv_bfloat16> bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

std::vector<float> f32(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

WorkspaceFn device_workspace(std::vector<void*>* owned) {
  return [owned](size_t n) -> void* {
    void* p = nullptr;
    if (cudaMalloc(&p, n) != cudaSuccess) return nullptr;
    owned->push_back(p);
    return p;
  };
}

struct Ref {
  std::vector<double> o, dq, dk, dv, dbias;
};

// Double reference of the forward and backward (BSHD, GQA, causal, padding, bias (1, h, sq, skv)).
Ref reference(const AttentionParams& p, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, const std::vector<float>& bias,
              const std::vector<float>& dout, const std::vector<int>& lq,
              const std::vector<int>& lk) {
  const int64_t B = p.b, H = p.h, G = p.hk, SQ = p.sq, SK = p.skv, D = p.d, DV = p.dv, R = H / G;
  Ref r;
  r.o.assign(B * SQ * H * DV, 0);
  r.dq.assign(B * SQ * H * D, 0);
  r.dk.assign(B * SK * G * D, 0);
  r.dv.assign(B * SK * G * DV, 0);
  r.dbias.assign(H * SQ * SK, 0);
  auto Q = [&](int64_t b, int64_t i, int64_t h, int64_t d) {
    return q[((b * SQ + i) * H + h) * D + d];
  };
  auto K = [&](int64_t b, int64_t j, int64_t g, int64_t d) {
    return k[((b * SK + j) * G + g) * D + d];
  };
  auto V = [&](int64_t b, int64_t j, int64_t g, int64_t d) {
    return v[((b * SK + j) * G + g) * DV + d];
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / R;
      for (int64_t i = 0; i < SQ; ++i) {
        std::vector<double> s(SK, -INFINITY), pr(SK, 0);
        double m = -INFINITY;
        for (int64_t j = 0; j < SK; ++j) {
          bool keep = !(p.causal && j > i) && !(p.padding && (i >= lq[b] || j >= lk[b]));
          if (!keep) continue;
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += (double)Q(b, i, h, d) * K(b, j, g, d);
          s[j] = acc * p.scale + (p.bias ? bias[(h * SQ + i) * SK + j] : 0.0);
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;  // fully masked row: zeros
        double sum = 0;
        for (int64_t j = 0; j < SK; ++j)
          sum += (pr[j] = s[j] == -INFINITY ? 0 : std::exp(s[j] - m));
        for (int64_t j = 0; j < SK; ++j) pr[j] /= sum;
        double* o = &r.o[((b * SQ + i) * H + h) * DV];
        for (int64_t j = 0; j < SK; ++j)
          for (int64_t d = 0; d < DV; ++d) o[d] += pr[j] * V(b, j, g, d);
        // Backward of this row.
        const float* go = &dout[((b * SQ + i) * H + h) * DV];
        double delta = 0;
        for (int64_t d = 0; d < DV; ++d) delta += go[d] * o[d];
        for (int64_t j = 0; j < SK; ++j) {
          if (pr[j] == 0) continue;
          double dp = 0;
          for (int64_t d = 0; d < DV; ++d) {
            dp += go[d] * V(b, j, g, d);
            r.dv[((b * SK + j) * G + g) * DV + d] += pr[j] * go[d];
          }
          const double ds = pr[j] * (dp - delta);
          r.dbias[(h * SQ + i) * SK + j] += ds;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[((b * SQ + i) * H + h) * D + d] += p.scale * ds * K(b, j, g, d);
            r.dk[((b * SK + j) * G + g) * D + d] += p.scale * ds * Q(b, i, h, d);
          }
        }
      }
    }
  return r;
}

// max |got - want| / max(1, max |want|), over the rows the reference defines.
double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0, m = 1;
  for (size_t i = 0; i < want.size(); ++i) {
    e = std::max(e, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(want[i]));
  }
  return e / m;
}

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = __bfloat162float(__float2bfloat16(nd(rng)));
  return x;
}

void check_fwd_bwd(bool causal) {
  AttentionParams p;
  p.b = 2, p.h = 4, p.hk = 2, p.sq = 40, p.skv = 72, p.d = 64, p.dv = 64;
  p.causal = causal, p.padding = true, p.scale = 0.125f;
  p.bias_b = 1, p.bias_h = p.h;
  std::mt19937 rng(causal ? 1 : 2);
  auto q = randn(p.b * p.sq * p.h * p.d, rng), k = randn(p.b * p.skv * p.hk * p.d, rng);
  auto v = randn(p.b * p.skv * p.hk * p.dv, rng), bias = randn(p.h * p.sq * p.skv, rng, 0.5f);
  auto dout = randn(p.b * p.sq * p.h * p.dv, rng);
  std::vector<int> lq = {40, 17}, lk = {72, 23};
  auto dq_ = to_device(bf16(q)), dk_ = to_device(bf16(k)), dv_ = to_device(bf16(v));
  auto db_ = to_device(bf16(bias)), ddo = to_device(bf16(dout));
  auto dlq = to_device(lq), dlk = to_device(lk);
  __nv_bfloat16 *o, *gq, *gk, *gv, *gb;
  float* stats;
  cudaMalloc(&o, p.b * p.sq * p.h * p.dv * 2);
  cudaMalloc(&gq, q.size() * 2);
  cudaMalloc(&gk, k.size() * 2);
  cudaMalloc(&gv, v.size() * 2);
  cudaMalloc(&gb, bias.size() * 2);
  cudaMalloc(&stats, p.b * p.h * p.sq * 4);
  cudaMemset(o, 0, p.b * p.sq * p.h * p.dv * 2);
  p.q = dq_, p.k = dk_, p.v = dv_, p.bias = db_, p.o = o, p.stats = stats;
  p.seqlens_q = dlq, p.seqlens_kv = dlk;
  p.dout = ddo, p.grad_q = gq, p.grad_k = gk, p.grad_v = gv, p.grad_bias = gb;
  std::vector<void*> ws;
  Status s = attention_fwd_cuda(p, nullptr, device_workspace(&ws));
  if (s.ok()) s = attention_bwd_cuda(p, nullptr, device_workspace(&ws));
  cudaDeviceSynchronize();
  const char* tag = causal ? "causal" : "full";
  if (!s.ok()) {
    std::printf("%s: %s\nFAIL\n", tag, s.message.c_str());
    ++g_failures;
    return;
  }
  Ref r = reference(p, q, k, v, bias, dout, lq, lk);
  auto ho = f32(to_host(o, r.o.size()));
  // Rows past seqlens_q are left to the caller (the Python op zeroes them): compare valid rows.
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t i = lq[b]; i < p.sq; ++i)
      for (int64_t c = 0; c < p.h * p.dv; ++c) ho[(b * p.sq + i) * p.h * p.dv + c] = 0;
  auto hq = f32(to_host(gq, q.size()));
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t i = lq[b]; i < p.sq; ++i)
      for (int64_t c = 0; c < p.h * p.d; ++c) hq[(b * p.sq + i) * p.h * p.d + c] = 0;
  auto hk = f32(to_host(gk, k.size())), hv = f32(to_host(gv, v.size()));
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t j = lk[b]; j < p.skv; ++j)
      for (int64_t c = 0; c < p.hk * p.d; ++c)
        hk[(b * p.skv + j) * p.hk * p.d + c] = hv[(b * p.skv + j) * p.hk * p.d + c] = 0;
  const double tol = 2e-2;  // bf16 inputs/outputs, float32 accumulation
  char name[64];
  std::snprintf(name, sizeof(name), "%s o", tag);
  expect(rel_err(ho, r.o) < tol, name, rel_err(ho, r.o), tol);
  std::snprintf(name, sizeof(name), "%s dq", tag);
  expect(rel_err(hq, r.dq) < tol, name, rel_err(hq, r.dq), tol);
  std::snprintf(name, sizeof(name), "%s dk", tag);
  expect(rel_err(hk, r.dk) < tol, name, rel_err(hk, r.dk), tol);
  std::snprintf(name, sizeof(name), "%s dv", tag);
  expect(rel_err(hv, r.dv) < tol, name, rel_err(hv, r.dv), tol);
  auto hb = f32(to_host(gb, bias.size()));
  std::snprintf(name, sizeof(name), "%s dbias (1, h, sq, skv)", tag);
  expect(rel_err(hb, r.dbias) < tol, name, rel_err(hb, r.dbias), tol);
  for (void* x : ws) cudaFree(x);
  for (void* x : std::vector<void*>{dq_, dk_, dv_, db_, ddo, dlq, dlk, o, gq, gk, gv, gb, stats})
    cudaFree(x);
}

// q = k = 0 and v = 1: every kept weight is (1/skv)/(1-rate), so o[.., 0] * (1-rate) is the
// row's kept fraction.
void check_dropout() {
  AttentionParams p;
  p.b = 1, p.h = 4, p.hk = 4, p.sq = 128, p.skv = 256, p.d = 64, p.dv = 64;
  p.dropout = true, p.dropout_rate = 0.2f, p.scale = 1.0f;
  std::vector<__nv_bfloat16> zq(p.sq * p.h * p.d, __float2bfloat16(0.f));
  std::vector<__nv_bfloat16> zk(p.skv * p.h * p.d, __float2bfloat16(0.f));
  std::vector<__nv_bfloat16> ones(p.skv * p.h * p.dv, __float2bfloat16(1.f));
  auto q = to_device(zq), k = to_device(zk), v = to_device(ones);
  auto seed = to_device(std::vector<int64_t>{12345}), off = to_device(std::vector<int64_t>{0});
  const size_t n = p.sq * p.h * p.dv;
  __nv_bfloat16 *o1, *o2;
  float* stats;
  cudaMalloc(&o1, n * 2);
  cudaMalloc(&o2, n * 2);
  cudaMalloc(&stats, p.h * p.sq * 4);
  p.q = q, p.k = k, p.v = v, p.seed = seed, p.offset = off, p.stats = stats;
  std::vector<void*> ws;
  p.o = o1;
  Status s = attention_fwd_cuda(p, nullptr, device_workspace(&ws));
  p.o = o2;
  if (s.ok()) s = attention_fwd_cuda(p, nullptr, device_workspace(&ws));
  cudaDeviceSynchronize();
  if (!s.ok()) {
    std::printf("dropout: %s\nFAIL\n", s.message.c_str());
    ++g_failures;
    return;
  }
  auto a = f32(to_host(o1, n)), b = f32(to_host(o2, n));
  expect(std::memcmp(a.data(), b.data(), n * 4) == 0, "dropout: same seed, same output", 0, 0);
  double mean = 0, var = 0;
  const int64_t rows = p.sq * p.h;
  for (int64_t r = 0; r < rows; ++r) mean += a[r * p.dv] * (1 - p.dropout_rate);
  mean /= rows;
  for (int64_t r = 0; r < rows; ++r) var += std::pow(a[r * p.dv] * (1 - p.dropout_rate) - mean, 2);
  const double sd = std::sqrt(var / rows), r = p.dropout_rate;
  const double want_sd = std::sqrt(r * (1 - r) / p.skv);
  const double bound = 5 * want_sd / std::sqrt((double)rows) + 0.01;  // + bf16 rounding of o
  expect(std::fabs(mean - (1 - r)) < bound, "dropout: mean kept fraction = 1 - rate",
         std::fabs(mean - (1 - r)), bound);
  expect(std::fabs(sd - want_sd) < 0.3 * want_sd, "dropout: row spread = binomial's",
         std::fabs(sd - want_sd), 0.3 * want_sd);
  for (void* x : ws) cudaFree(x);
  for (void* x : std::vector<void*>{q, k, v, seed, off, o1, o2, stats}) cudaFree(x);
}

// Ragged (THD) packing as lowbit.ops.fused_attention_ragged drives it: sequences of uneven
// lengths packed token by token, one empty slot at the end (length 0, offset = the end), causal;
// forward and backward against the padded BSHD double reference of the same sequences.
void check_ragged() {
  AttentionParams p;  // the padded BSHD view the reference runs on
  p.b = 4, p.h = 4, p.hk = 2, p.sq = 32, p.skv = 32, p.d = 64, p.dv = 64;
  p.causal = true, p.padding = true, p.scale = 0.125f;
  const std::vector<int> lens = {24, 9, 31, 0};
  std::vector<int> start(p.b + 1, 0);
  for (int64_t b = 0; b < p.b; ++b) start[b + 1] = start[b] + lens[b];
  const int64_t T = start[p.b];
  std::mt19937 rng(5);
  const int64_t qrow = p.h * p.d, krow = p.hk * p.d;
  auto q = randn(p.b * p.sq * qrow, rng), k = randn(p.b * p.skv * krow, rng);
  auto v = randn(p.b * p.skv * krow, rng), dout = randn(p.b * p.sq * qrow, rng);
  // Packed copies: row i of sequence b is token start[b] + i.
  auto pack = [&](const std::vector<float>& x, int64_t row) {
    std::vector<float> y(T * row);
    for (int64_t b = 0; b < p.b; ++b)
      for (int64_t i = 0; i < lens[b]; ++i)
        std::memcpy(&y[(start[b] + i) * row], &x[(b * p.sq + i) * row], row * sizeof(float));
    return y;
  };
  auto pq = to_device(bf16(pack(q, qrow))), pk = to_device(bf16(pack(k, krow)));
  auto pv = to_device(bf16(pack(v, krow))), pdo = to_device(bf16(pack(dout, qrow)));
  std::vector<int32_t> offs(4 * (p.b + 1));
  for (int64_t b = 0; b <= p.b; ++b) {
    offs[b] = start[b] * qrow;
    offs[(p.b + 1) + b] = start[b] * krow;
    offs[2 * (p.b + 1) + b] = start[b] * krow;
    offs[3 * (p.b + 1) + b] = start[b] * qrow;
  }
  auto doffs = to_device(offs), dl = to_device(lens);
  __nv_bfloat16 *o, *gq, *gk, *gv;
  float* stats;
  cudaMalloc(&o, T * qrow * 2);
  cudaMalloc(&gq, T * qrow * 2);
  cudaMalloc(&gk, T * krow * 2);
  cudaMalloc(&gv, T * krow * 2);
  cudaMalloc(&stats, p.b * p.h * p.sq * 4);
  AttentionParams r = p;
  r.ragged = true, r.ragged_offsets = doffs, r.ragged_stride = p.b + 1;
  r.seqlens_q = dl, r.seqlens_kv = dl;
  r.q = pq, r.k = pk, r.v = pv, r.o = o, r.stats = stats;
  r.dout = pdo, r.grad_q = gq, r.grad_k = gk, r.grad_v = gv;
  std::vector<void*> ws;
  Status st = attention_fwd_cuda(r, nullptr, device_workspace(&ws));
  if (st.ok()) st = attention_bwd_cuda(r, nullptr, device_workspace(&ws));
  cudaDeviceSynchronize();
  if (!st.ok()) {
    std::printf("ragged: %s\nFAIL\n", st.message.c_str());
    ++g_failures;
    return;
  }
  Ref ref = reference(p, q, k, v, {}, dout, lens, lens);
  auto packed_ref = [&](const std::vector<double>& x, int64_t row) {
    std::vector<double> y(T * row);
    for (int64_t b = 0; b < p.b; ++b)
      for (int64_t i = 0; i < lens[b]; ++i)
        for (int64_t c = 0; c < row; ++c) y[(start[b] + i) * row + c] = x[(b * p.sq + i) * row + c];
    return y;
  };
  const double tol = 2e-2;  // bf16 inputs/outputs, float32 accumulation
  const struct {
    const char* name;
    __nv_bfloat16* got;
    const std::vector<double>* want;
    int64_t row;
  } outs[] = {{"ragged o", o, &ref.o, qrow},
              {"ragged dq", gq, &ref.dq, qrow},
              {"ragged dk", gk, &ref.dk, krow},
              {"ragged dv", gv, &ref.dv, krow}};
  for (const auto& x : outs) {
    const double e = rel_err(f32(to_host(x.got, T * x.row)), packed_ref(*x.want, x.row));
    expect(e < tol, x.name, e, tol);
  }
  for (void* x : ws) cudaFree(x);
  for (void* x : std::vector<void*>{pq, pk, pv, pdo, doffs, dl, o, gq, gk, gv, stats}) cudaFree(x);
}

// FP8 forward (E4M3 q, k, v, o; per-tensor scales) against the double reference.
void check_fp8() {
  AttentionParams p;
  p.b = 2, p.h = 2, p.hk = 2, p.sq = 128, p.skv = 128, p.d = 128, p.dv = 128;
  p.fp8 = true, p.causal = true, p.scale = 1.0f / std::sqrt(128.0f);
  p.dtype = p.o_dtype = DType::kE4M3;
  std::mt19937 rng(3);
  auto q = randn(p.b * p.sq * p.h * p.d, rng), k = randn(q.size(), rng), v = randn(q.size(), rng);
  const float sx = 448.0f / 5.0f, ss = 448.0f, so = 448.0f / 5.0f;
  auto enc = [&](const std::vector<float>& x, std::vector<float>* back) {
    std::vector<__nv_fp8_e4m3> y(x.size());
    back->resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      y[i] = __nv_fp8_e4m3(x[i] * sx);
      (*back)[i] = float(y[i]) / sx;
    }
    return y;
  };
  std::vector<float> qb, kb, vb;
  auto dq8 = to_device(enc(q, &qb)), dk8 = to_device(enc(k, &kb)), dv8 = to_device(enc(v, &vb));
  std::vector<float> scales(6 * abi::kAttnScaleStride, 0.f);
  const float rows[6] = {1 / sx, 1 / sx, 1 / sx, 1 / ss, ss, so};
  for (int i = 0; i < 6; ++i) scales[i * abi::kAttnScaleStride] = rows[i];
  auto dsc = to_device(scales);
  __nv_fp8_e4m3* o;
  float *stats, *amax;
  cudaMalloc(&o, q.size());
  cudaMalloc(&stats, p.b * p.h * p.sq * 4);
  cudaMalloc(&amax, 2 * abi::kAttnScaleStride * 4);
  p.q = dq8, p.k = dk8, p.v = dv8, p.o = o, p.stats = stats, p.fp8_scales = dsc, p.amax = amax;
  std::vector<void*> ws;
  Status s = attention_fwd_cuda(p, nullptr, device_workspace(&ws));
  cudaDeviceSynchronize();
  if (!s.ok()) {
    std::printf("fp8: %s\nFAIL\n", s.message.c_str());
    ++g_failures;
    return;
  }
  std::vector<float> dummy(q.size(), 0.f);
  Ref r = reference(p, qb, kb, vb, {}, dummy, {}, {});
  auto h8 = to_host(o, q.size());
  std::vector<float> ho(q.size());
  for (size_t i = 0; i < ho.size(); ++i) ho[i] = float(h8[i]) / so;
  // E4M3 output: relative rounding 2^-4, plus P quantized to E4M3 inside the kernel.
  const double tol = 0.1;
  expect(rel_err(ho, r.o) < tol, "fp8 forward o (E4M3)", rel_err(ho, r.o), tol);
  auto am = to_host(amax, 2 * abi::kAttnScaleStride);
  double want_amax = 0;
  for (double x : r.o) want_amax = std::max(want_amax, std::fabs(x));
  expect(std::fabs(am[abi::kAttnScaleStride] - want_amax) < 0.1 * want_amax, "fp8 amax(o)",
         am[abi::kAttnScaleStride], want_amax);
  for (void* x : ws) cudaFree(x);
  for (void* x : std::vector<void*>{dq8, dk8, dv8, dsc, o, stats, amax}) cudaFree(x);
}

}  // namespace

int main() {
  char err[1024];
  if (attention_cudnn_load(nullptr, err, sizeof(err)) != 0) {
    std::printf("%s\nFAIL\n", err);
    return 1;
  }
  std::printf("cuDNN %lld\n", (long long)attention_cudnn_version());
  check_fwd_bwd(false);
  check_fwd_bwd(true);
  check_dropout();
  check_ragged();
  check_fp8();
  std::printf(g_failures ? "FAILED: %d\n" : "all passed\n", g_failures);
  return g_failures ? 1 : 0;
}
