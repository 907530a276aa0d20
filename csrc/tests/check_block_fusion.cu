// Standalone checks of the norm and activation kernels writing FP8 block-scaled copies
// (Float8BlockScaling: 1x128 / 128x128, float32 scales) against the CPU quantize kernel run on
// the GPU's own unquantized output (the contract: fused == lowbit.quantize(unfused), bit for
// bit: data, scales, amax), and against a launch that does not write the unquantized output.
// The backward's dbias (summed per 128-row tile inside the block cast, then over the tiles) is
// held to the float32 accumulation-order bound against a float64 sum of the GPU's dx, and must
// repeat bit for bit. Exit status 1 on any failure.
//   lowbit_check_block_fusion            full set
//   lowbit_check_block_fusion --quick    small shapes (for compute-sanitizer)
//   lowbit_check_block_fusion --bench    fused vs kernel-then-quantize at the seed layer's shapes
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check_tensors.h"
#include "lowbit/activation.h"
#include "lowbit/block_scaling.h"
#include "lowbit/formats.h"
#include "lowbit/norm.h"
#include "lowbit/quantize.h"

using namespace lowbit;

namespace {

void same_bytes(const std::vector<uint8_t>& g, const std::vector<uint8_t>& c,
                const std::string& what) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < std::min(g.size(), c.size()); ++i)
    if (g[i] != c[i] && bad++ == 0) first = i;
  char d[128] = "";
  if (bad || g.size() != c.size())
    std::snprintf(d, sizeof d, "%zu bytes differ (sizes %zu/%zu), first at %zu", bad, g.size(),
                  c.size(), first);
  report(bad == 0 && g.size() == c.size(), what, d);
}

// The block-scaled outputs of one (R, C) tensor: both copies, their scales, amax, dbias.
struct BlockOut {
  int64_t R, C;
  ScalingMode mode;
  Dev row, col, si, csi, amax, dbias;
  static size_t scales(ScalingMode m, int64_t r, int64_t c) {
    return size_t(fp8_block_scale_rows(m, r, c) * fp8_block_scale_cols(m, r, c)) * 4;
  }
  BlockOut(int64_t r, int64_t c, ScalingMode m, size_t dbias_bytes)
      : R(r),
        C(c),
        mode(m),
        row(size_t(r * c)),
        col(size_t(r * c)),
        si(scales(m, r, c)),
        csi(scales(m, c, r)),
        amax(4),
        dbias(dbias_bytes) {}
  template <typename P>
  void attach(P& p, DType q, bool pow2, float eps) const {
    p.mode = mode;
    p.q_dtype = q;
    p.power_2_scale = pow2;
    p.amax_epsilon = eps;
    p.data = row.as<uint8_t>();
    p.colwise_data = col.as<uint8_t>();
    p.scale_inv = si.as<float>();
    p.colwise_scale_inv = csi.as<float>();
    p.amax = amax.as<float>();
  }
};

// The contract: the CPU quantize of the GPU's unquantized output `y`.
void check_contract(const std::vector<uint8_t>& y, DType dt, const BlockOut& o, DType q, bool pow2,
                    float eps, const std::string& tag) {
  QuantizeParams qp;
  qp.x = y.data();
  qp.x_dtype = dt;
  qp.rows = o.R;
  qp.cols = o.C;
  qp.mode = o.mode;
  qp.q_dtype = q;
  qp.rowwise = qp.colwise = true;
  qp.power_2_scale = pow2;
  qp.amax_epsilon = eps;
  std::vector<uint8_t> row(o.row.bytes), col(o.col.bytes), si(o.si.bytes), csi(o.csi.bytes),
      amax(4);
  qp.data = row.data();
  qp.colwise_data = col.data();
  qp.scale_inv = si.data();
  qp.colwise_scale_inv = csi.data();
  qp.amax = reinterpret_cast<float*>(amax.data());
  status_ok(quantize_cpu(qp), tag + " quantize_cpu");
  same_bytes(o.row.host(), row, tag + " rowwise");
  same_bytes(o.col.host(), col, tag + " colwise");
  same_bytes(o.si.host(), si, tag + " scale_inv");
  same_bytes(o.csi.host(), csi, tag + " colwise scale_inv");
  same_bytes(o.amax.host(), amax, tag + " amax");
}

// dbias (W,) in dt is a float32 sum of the (R, W) dx's rows in some order, rounded once: a float32
// sum of n terms is within (n - 1) 2^-24 sum|x| of the exact sum s (first order, any order), and
// the rounding adds u_out |result| (2^-8 bf16, 2^-11 f16, 2^-24 f32). Checked with 1% slack plus
// one subnormal against s in float64.
void check_dbias_bound(const std::vector<uint8_t>& dx, const std::vector<uint8_t>& db, DType dt,
                       int64_t R, int64_t W, const std::string& tag) {
  const double u_out = dt == DType::kBF16 ? 0x1p-8 : dt == DType::kF16 ? 0x1p-11 : 0x1p-24;
  const double tiny = dt == DType::kBF16 ? 0x1p-133 : dt == DType::kF16 ? 0x1p-24 : 0x1p-149;
  std::vector<double> sum(size_t(W), 0.0), abs_sum(size_t(W), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < W; ++c) {
      const double v = get(dx, dt, size_t(r * W + c));
      sum[size_t(c)] += v, abs_sum[size_t(c)] += std::fabs(v);
    }
  int64_t bad = 0, first = -1;
  double worst = 0.0;  // largest err / bound
  for (int64_t c = 0; c < W; ++c) {
    const double s = sum[size_t(c)];
    const double acc = double(std::max<int64_t>(R - 1, 0)) * 0x1p-24 * abs_sum[size_t(c)];
    const double bound = 1.01 * (acc + u_out * (std::fabs(s) + acc)) + tiny;
    const double err = std::fabs(double(get(db, dt, size_t(c))) - s);
    worst = std::max(worst, err / bound);
    if (err > bound && bad++ == 0) first = c;
  }
  char d[128];
  std::snprintf(d, sizeof d, "%lld of %lld columns outside, first %lld; max err/bound %.3g",
                (long long)bad, (long long)W, (long long)first, worst);
  report(bad == 0, tag + " dbias within the float32 order bound", bad ? d : "");
}

void check_norm(std::mt19937& rng, DType dt, int64_t R, int64_t C, NormType type, ScalingMode m,
                DType q, bool pow2, float eps) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "norm %s dt=%d %lldx%lld mode=%d q=%d pow2=%d eps=%g",
                type == NormType::kRmsNorm ? "rms" : "ln", int(dt), (long long)R, (long long)C,
                int(m), int(q), pow2, eps);
  const std::string tag = buf;
  const size_t n = size_t(R * C);
  auto x = random_tensor(rng, dt, n, 0.3f, 2.0f);
  std::vector<float> gamma(static_cast<size_t>(C)), beta(static_cast<size_t>(C));
  std::normal_distribution<float> nd(1.0f, 0.3f);
  for (size_t i = 0; i < gamma.size(); ++i) gamma[i] = nd(rng), beta[i] = nd(rng) - 1.0f;
  Dev dx(x.data(), x.size()), dg(gamma.data(), 4 * C), db(beta.data(), 4 * C);
  Dev dy(n * esize(dt)), dmean(4 * R), drs(4 * R);
  BlockOut o(R, C, m, 0), o2(R, C, m, 0);
  NormFwdParams g;
  g.x = dx.p;
  g.x_dtype = dt;
  g.rows = R;
  g.cols = C;
  g.gamma = dg.as<float>();
  g.beta = type == NormType::kLayerNorm ? db.as<float>() : nullptr;
  g.type = type;
  g.epsilon = 1e-5f;
  g.y = dy.p;
  g.mean = dmean.as<float>();
  g.rsigma = drs.as<float>();
  o.attach(g, q, pow2, eps);
  status_ok(norm_fwd_cuda(g, nullptr), tag + " cuda");
  CUDA_OK(cudaDeviceSynchronize());
  check_contract(dy.host(), dt, o, q, pow2, eps, tag);
  NormFwdParams g2 = g;  // without y (what the fused layer launches): the same bytes
  g2.y = nullptr;
  o2.attach(g2, q, pow2, eps);
  status_ok(norm_fwd_cuda(g2, nullptr), tag + " cuda no-y");
  CUDA_OK(cudaDeviceSynchronize());
  same_bytes(o2.row.host(), o.row.host(), tag + " rowwise without y");
  same_bytes(o2.col.host(), o.col.host(), tag + " colwise without y");
  same_bytes(o2.csi.host(), o.csi.host(), tag + " colwise scales without y");
}

void check_act(std::mt19937& rng, DType dt, int64_t R, int64_t H, ActKind act, bool gated,
               ScalingMode m, DType q, bool pow2) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "act %d%s dt=%d %lldx%lld mode=%d q=%d pow2=%d", int(act),
                gated ? "+glu" : "", int(dt), (long long)R, (long long)H, int(m), int(q), pow2);
  const std::string tag = buf;
  const int64_t W = gated ? 2 * H : H;
  auto x = random_tensor(rng, dt, size_t(R * W), 0.0f, 2.0f);
  auto dyv = random_tensor(rng, dt, size_t(R * H), 0.0f, 1.0f);
  Dev dx(x.data(), x.size()), ddy(dyv.data(), dyv.size());
  // forward: y and the copies, then the copies alone
  Dev y(size_t(R * H) * esize(dt));
  BlockOut fo(R, H, m, 0), fo2(R, H, m, 0);
  ActFwdParams f;
  f.x = dx.p;
  f.x_dtype = dt;
  f.rows = R;
  f.cols = H;
  f.act = act;
  f.gated = gated;
  f.y = y.p;
  fo.attach(f, q, pow2, 0.0f);
  status_ok(act_fwd_cuda(f, nullptr), tag + " fwd cuda");
  CUDA_OK(cudaDeviceSynchronize());
  check_contract(y.host(), dt, fo, q, pow2, 0.0f, tag + " fwd");
  f.y = nullptr;
  fo2.attach(f, q, pow2, 0.0f);
  status_ok(act_fwd_cuda(f, nullptr), tag + " fwd cuda no-y");
  CUDA_OK(cudaDeviceSynchronize());
  same_bytes(fo2.row.host(), fo.row.host(), tag + " fwd rowwise without y");
  same_bytes(fo2.col.host(), fo.col.host(), tag + " fwd colwise without y");
  // backward with dbias: dx and the copies, then the copies alone
  Dev dxo(size_t(R * W) * esize(dt));
  BlockOut bo(R, W, m, size_t(W) * esize(dt)), bo2(R, W, m, size_t(W) * esize(dt));
  Dev ws(act_bwd_workspace_bytes(R, H, gated, true));
  ActBwdParams b;
  b.dy = ddy.p;
  b.x = dx.p;
  b.x_dtype = dt;
  b.rows = R;
  b.cols = H;
  b.act = act;
  b.gated = gated;
  b.dx = dxo.p;
  b.dbias = bo.dbias.p;
  b.workspace = ws.p;
  bo.attach(b, q, pow2, 0.0f);
  status_ok(act_bwd_cuda(b, nullptr), tag + " bwd cuda");
  CUDA_OK(cudaDeviceSynchronize());
  const auto dx_host = dxo.host();
  check_contract(dx_host, dt, bo, q, pow2, 0.0f, tag + " bwd");
  check_dbias_bound(dx_host, bo.dbias.host(), dt, R, W, tag + " bwd");
  b.dx = nullptr;
  b.dbias = bo2.dbias.p;
  bo2.attach(b, q, pow2, 0.0f);
  status_ok(act_bwd_cuda(b, nullptr), tag + " bwd cuda no-dx");
  CUDA_OK(cudaDeviceSynchronize());
  same_bytes(bo2.row.host(), bo.row.host(), tag + " bwd rowwise without dx");
  same_bytes(bo2.col.host(), bo.col.host(), tag + " bwd colwise without dx");
  same_bytes(bo2.dbias.host(), bo.dbias.host(), tag + " bwd dbias without dx");
  // One copy only: the column phase still sums dbias where it writes no colwise copy.
  for (int only_row = 0; only_row < 2; ++only_row) {
    BlockOut b3(R, W, m, size_t(W) * esize(dt));
    ActBwdParams b1 = b;
    b3.attach(b1, q, pow2, 0.0f);
    b1.dbias = b3.dbias.p;
    if (only_row)
      b1.colwise_data = nullptr, b1.colwise_scale_inv = nullptr;
    else
      b1.data = nullptr, b1.scale_inv = nullptr;
    const std::string t1 = tag + (only_row ? " bwd rowwise only" : " bwd colwise only");
    status_ok(act_bwd_cuda(b1, nullptr), t1 + " cuda");
    CUDA_OK(cudaDeviceSynchronize());
    if (only_row)
      same_bytes(b3.row.host(), bo.row.host(), t1 + " rowwise");
    else
      same_bytes(b3.col.host(), bo.col.host(), t1 + " colwise");
    same_bytes(b3.dbias.host(), bo.dbias.host(), t1 + " dbias");
  }
}

// ---- --bench: fused vs the unfused pair (kernel writing bf16, then quantize) ----

double time_us(const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  CUDA_OK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  const int iters = 20;
  CUDA_OK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) f();
  CUDA_OK(cudaEventRecord(b));
  CUDA_OK(cudaEventSynchronize(b));
  float ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  return 1000.0 * ms / iters;
}

void bench() {
  std::mt19937 rng(7);
  const DType dt = DType::kBF16;
  const ScalingMode m = ScalingMode::kBlock1d;
  const int64_t M = 8192, K = 4096, F = 16384;  // batch 4 x 2048 tokens, hidden, ffn
  auto x = random_tensor(rng, dt, size_t(M * F), 0.0f, 1.0f);
  Dev dx(x.data(), x.size()), dy2(x.data(), x.size()), tmp(size_t(M * F) * 2);
  std::vector<float> ones(static_cast<size_t>(K), 1.0f);
  Dev dg(ones.data(), 4 * K), dmean(4 * M), drs(4 * M);
  BlockOut on(M, K, m, 0), oa(M, F, m, size_t(F) * 2);
  Dev ws(act_bwd_workspace_bytes(M, F, false, true)), qws(1 << 20);
  QuantizeParams qp;
  qp.x_dtype = dt;
  qp.mode = m;
  qp.q_dtype = DType::kE4M3;
  qp.rowwise = qp.colwise = true;
  qp.workspace = qws.p;
  auto quantize = [&](const void* src, int64_t r, int64_t c, const BlockOut& o, bool dbias) {
    QuantizeParams q = qp;
    q.x = src, q.rows = r, q.cols = c;
    q.data = o.row.p, q.colwise_data = o.col.p, q.scale_inv = o.si.p, q.colwise_scale_inv = o.csi.p;
    q.amax = o.amax.as<float>();
    q.dbias = dbias ? o.dbias.p : nullptr;
    quantize_cuda(q, nullptr);
  };
  NormFwdParams n;
  n.x = dx.p, n.x_dtype = dt, n.rows = M, n.cols = K, n.gamma = dg.as<float>();
  n.mean = dmean.as<float>(), n.rsigma = drs.as<float>();
  NormFwdParams nf = n;
  on.attach(nf, DType::kE4M3, false, 0.0f);
  NormFwdParams nu = n;
  nu.y = tmp.p;
  const double n_f = time_us([&] { norm_fwd_cuda(nf, nullptr); });
  const double n_u = time_us([&] {
    norm_fwd_cuda(nu, nullptr);
    quantize(tmp.p, M, K, on, false);
  });
  ActFwdParams a;
  a.x = dx.p, a.x_dtype = dt, a.rows = M, a.cols = F, a.act = ActKind::kGeluTanh;
  ActFwdParams af = a;
  oa.attach(af, DType::kE4M3, false, 0.0f);
  ActFwdParams au = a;
  au.y = tmp.p;
  const double a_f = time_us([&] { act_fwd_cuda(af, nullptr); });
  const double a_u = time_us([&] {
    act_fwd_cuda(au, nullptr);
    quantize(tmp.p, M, F, oa, false);
  });
  ActBwdParams b;
  b.dy = dy2.p, b.x = dx.p, b.x_dtype = dt, b.rows = M, b.cols = F, b.act = ActKind::kGeluTanh;
  b.workspace = ws.p;
  ActBwdParams bf = b;
  oa.attach(bf, DType::kE4M3, false, 0.0f);
  bf.dbias = oa.dbias.p;
  ActBwdParams bu = b;
  bu.dx = tmp.p;
  const double b_f = time_us([&] { act_bwd_cuda(bf, nullptr); });
  ActBwdParams bn = bf;  // the same launch without dbias: what the per-tile sums cost
  bn.dbias = nullptr;
  const double b_n = time_us([&] { act_bwd_cuda(bn, nullptr); });
  const double b_u = time_us([&] {
    act_bwd_cuda(bu, nullptr);
    quantize(tmp.p, M, F, oa, true);
  });
  CUDA_OK(cudaDeviceSynchronize());
  std::printf("block 1x128 bf16, us: fused vs unfused (kernel + quantize)\n");
  std::printf("  layernorm %lldx%lld      %8.1f  %8.1f\n", (long long)M, (long long)K, n_f, n_u);
  std::printf("  gelu fwd  %lldx%lld     %8.1f  %8.1f\n", (long long)M, (long long)F, a_f, a_u);
  std::printf("  gelu bwd+dbias %lldx%lld %8.1f  %8.1f\n", (long long)M, (long long)F, b_f, b_u);
  // Floor of the fused backward: read dy and h (2 + 2 B), write both copies and scales (2.06 B).
  const double gb = double(M) * double(F) * 6.0625 / 1e9;
  std::printf("  gelu bwd, no dbias, fused  %8.1f (bwd+dbias fused: %.0f GB/s over %.2f GB)\n", b_n,
              gb / (b_f * 1e-6), gb);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--bench")) {
      bench();
      return 0;
    }
  }
  std::mt19937 rng(1234);
  const ScalingMode b1 = ScalingMode::kBlock1d, b2 = ScalingMode::kBlock2d;
  // Whole 16x16 chunks with partial 128 tiles on both axes, and whole tiles.
  std::vector<std::pair<int64_t, int64_t>> shapes = {{144, 400}, {256, 256}};
  if (!quick) shapes.push_back({1040, 4096});
  for (auto [R, C] : shapes)
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      check_norm(rng, dt, R, C, NormType::kLayerNorm, b1, DType::kE4M3, true, 0.0f);
      check_norm(rng, dt, R, C, NormType::kRmsNorm, b1, DType::kE5M2, false, 1e-2f);
      check_norm(rng, dt, R, C, NormType::kLayerNorm, b2, DType::kE4M3, false, 0.0f);
    }
  const ActKind acts[] = {ActKind::kLinear,     ActKind::kGeluTanh, ActKind::kGeluExact,
                          ActKind::kRelu,       ActKind::kSilu,     ActKind::kQuickGelu,
                          ActKind::kSquaredRelu};
  // The seed layer's GELU backward (8192 x 16384 bf16, 64 row tiles of the dbias partials).
  if (!quick)
    check_act(rng, DType::kBF16, 8192, 16384, ActKind::kGeluTanh, false, b1, DType::kE4M3, false);
  for (auto [R, H] : shapes)
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
      for (ActKind a : acts)
        for (bool gated : {false, true}) {
          if (quick && a != ActKind::kGeluTanh && a != ActKind::kSilu) continue;
          const bool odd = (int(a) + int(gated)) % 2;
          check_act(rng, dt, R, H, a, gated, odd && dt == DType::kBF16 ? b2 : b1,
                    odd ? DType::kE5M2 : DType::kE4M3, !odd);
        }
  return summary();
}
