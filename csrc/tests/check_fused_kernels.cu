// Standalone checks of the fused norm / activation / softmax CUDA kernels against the CPU
// reference kernels (no JAX). Exit status 1 on any failure.
//   lowbit_check_fused_kernels            full set
//   lowbit_check_fused_kernels --quick    small shapes (for compute-sanitizer)
//   lowbit_check_fused_kernels --bench    GB/s of the fused kernels vs a device-to-device copy
//
// What is compared:
//  * y / dx / softmax outputs: GPU vs CPU within a few ulps of the output dtype (the row sums and
//    the transcendental functions round differently on the two sides);
//  * fused FP8 copies: bit for bit against the CPU quantize kernel run on the GPU's own
//    unquantized output (the documented contract: fused == lowbit.quantize(unfused)), and against
//    a launch that does not write the unquantized output;
//  * amax and scale_inv: exactly; dgamma/dbeta/dbias: within tolerance, and bitwise
//    reproducible across two launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_tensors.h"
#include "lowbit/activation.h"
#include "lowbit/formats.h"
#include "lowbit/norm.h"
#include "lowbit/quantize.h"
#include "lowbit/softmax.h"

using namespace lowbit;

namespace {

const char* dname(DType t) {
  return t == DType::kF32 ? "f32" : (t == DType::kBF16 ? "bf16" : "f16");
}

// Device buffer mirroring a host vector.
// |gpu - cpu| <= rtol * (|cpu| + floor * max|cpu|), element by element.
void compare(const std::vector<uint8_t>& g, const std::vector<uint8_t>& c, DType t, size_t n,
             const std::string& what, float rtol_scale = 1.0f, float floor = 1e-2f) {
  const float rtol =
      rtol_scale * (t == DType::kF32 ? 6e-5f : (t == DType::kBF16 ? 1.6e-2f : 2e-3f));
  float mx = 0.0f;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(get(c, t, i)));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    const float a = get(g, t, i), b = get(c, t, i);
    const bool ok =
        (std::isnan(a) && std::isnan(b)) || std::fabs(a - b) <= rtol * (std::fabs(b) + floor * mx);
    if (!ok && bad++ == 0) first = i;
  }
  char d[160] = "";
  if (bad)
    std::snprintf(d, sizeof d, "%zu of %zu differ, first at %zu: gpu %g cpu %g", bad, n, first,
                  get(g, t, first), get(c, t, first));
  report(bad == 0, what, d);
}

void compare_f32(const std::vector<float>& g, const std::vector<float>& c, const std::string& what,
                 float rtol, float floor = 1e-3f) {
  float mx = 0.0f;
  for (float v : c) mx = std::max(mx, std::fabs(v));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (!(std::fabs(g[i] - c[i]) <= rtol * (std::fabs(c[i]) + floor * mx)) && bad++ == 0) first = i;
  char d[160] = "";
  if (bad)
    std::snprintf(d, sizeof d, "%zu of %zu differ, first at %zu: gpu %g cpu %g", bad, c.size(),
                  first, g[first], c[first]);
  report(bad == 0, what, d);
}

void compare_bytes(const std::vector<uint8_t>& g, const std::vector<uint8_t>& c,
                   const std::string& what) {
  size_t bad = 0, first = 0;
  const size_t n = std::min(g.size(), c.size());
  for (size_t i = 0; i < n; ++i)
    if (g[i] != c[i] && bad++ == 0) first = i;
  char d[160] = "";
  if (bad || g.size() != c.size())
    std::snprintf(d, sizeof d, "%zu of %zu bytes differ (sizes %zu/%zu), first at %zu: %#x vs %#x",
                  bad, n, g.size(), c.size(), first, bad ? g[first] : 0, bad ? c[first] : 0);
  report(bad == 0 && g.size() == c.size(), what, d);
}

std::vector<float> to_f32(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

// The FP8 outputs of a fused launch on the device: rowwise and colwise copies of n bytes each,
// scale_inv, colwise scale_inv and amax.
struct Fp8Out {
  Dev row, col, si, csi, amax;
  explicit Fp8Out(size_t n) : row(n), col(n), si(4), csi(4), amax(4) {}
  // The FP8 request of launch params g (Norm/ActFwd/ActBwdParams): mode, q_dtype and scale, and
  // with `fp8` the output pointers.
  template <typename P>
  void attach(P& g, ScalingMode mode, DType q, const Dev& scale, bool fp8) const {
    g.mode = mode;
    g.q_dtype = q;
    g.scale = scale.as<float>();
    if (fp8) {
      g.data = row.as<uint8_t>();
      g.colwise_data = col.as<uint8_t>();
      g.scale_inv = si.as<float>();
      g.colwise_scale_inv = csi.as<float>();
      g.amax = amax.as<float>();
    }
  }
};

// The contract for fused FP8 outputs: the CPU quantize kernel on the GPU's unquantized output.
void check_fp8_contract(const std::vector<uint8_t>& y_gpu, DType dt, int64_t R, int64_t C,
                        ScalingMode mode, DType q, float scale, const Fp8Out& out,
                        const std::string& what) {
  QuantizeParams qp;
  qp.x = y_gpu.data();
  qp.x_dtype = dt;
  qp.rows = R;
  qp.cols = C;
  qp.mode = mode;
  qp.q_dtype = q;
  qp.rowwise = qp.colwise = true;
  qp.scale = &scale;
  std::vector<uint8_t> row(static_cast<size_t>(R * C)), col(static_cast<size_t>(R * C));
  float si = 0.0f, csi = 0.0f, amax = 0.0f;
  qp.data = row.data();
  qp.colwise_data = col.data();
  qp.scale_inv = &si;
  qp.colwise_scale_inv = &csi;
  qp.amax = &amax;
  status_ok(quantize_cpu(qp), what + " quantize_cpu");
  compare_bytes(out.row.host(), row, what + " rowwise fp8");
  compare_bytes(out.col.host(), col, what + " colwise fp8");
  const float g_amax = out.amax.scalar(), g_si = out.si.scalar(), g_csi = out.csi.scalar();
  report(std::memcmp(&g_amax, &amax, 4) == 0, what + " amax",
         std::to_string(g_amax) + " vs " + std::to_string(amax));
  report(std::memcmp(&g_si, &si, 4) == 0 && std::memcmp(&g_csi, &si, 4) == 0, what + " scale_inv",
         std::to_string(g_si) + "/" + std::to_string(g_csi) + " vs " + std::to_string(si));
}

// ---------------------------------------------------------------------------------------------
// norm

void check_norm(std::mt19937& rng, DType dt, int64_t R, int64_t C, NormType type, bool zc,
                bool beta, ScalingMode mode, DType q) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "norm %s %s %lldx%lld zc=%d beta=%d mode=%d q=%d",
                type == NormType::kRmsNorm ? "rms" : "ln", dname(dt), (long long)R, (long long)C,
                zc, beta, int(mode), int(q));
  const std::string tag = buf;
  const size_t n = size_t(R * C);
  auto x = random_tensor(rng, dt, n, 0.3f, 2.0f);
  std::vector<float> gamma(static_cast<size_t>(C)), bet(static_cast<size_t>(C));
  std::normal_distribution<float> nd(zc ? 0.0f : 1.0f, 0.2f);
  for (auto& g : gamma) g = nd(rng);
  for (auto& b : bet) b = nd(rng) - 1.0f;
  const float scale = 3.5f;
  const bool fp8 = is_tensor_scaling(mode);

  // CPU reference.
  std::vector<uint8_t> y_cpu(n * esize(dt));
  std::vector<float> mean_cpu(static_cast<size_t>(R)), rs_cpu(static_cast<size_t>(R));
  NormFwdParams p;
  p.x = x.data();
  p.x_dtype = dt;
  p.rows = R;
  p.cols = C;
  p.gamma = gamma.data();
  p.beta = beta ? bet.data() : nullptr;
  p.type = type;
  p.zero_centered_gamma = zc;
  p.epsilon = 1e-5f;
  p.y = y_cpu.data();
  p.mean = mean_cpu.data();
  p.rsigma = rs_cpu.data();
  status_ok(norm_fwd_cpu(p), tag + " cpu");

  // GPU: y and the FP8 copies in one call.
  Dev dx(x.data(), x.size()), dg(gamma.data(), 4 * C), db(bet.data(), 4 * C), ds(&scale, 4);
  Dev dy(n * esize(dt)), dmean(4 * R), drs(4 * R);
  Fp8Out fo(n);
  NormFwdParams g = p;
  g.x = dx.p;
  g.gamma = dg.as<float>();
  g.beta = beta ? db.as<float>() : nullptr;
  g.y = dy.p;
  g.mean = dmean.as<float>();
  g.rsigma = drs.as<float>();
  fo.attach(g, mode, q, ds, fp8);
  status_ok(norm_fwd_cuda(g, nullptr), tag + " cuda");
  CUDA_OK(cudaDeviceSynchronize());
  const auto y_gpu = dy.host();
  compare(y_gpu, y_cpu, dt, n, tag + " y");
  compare_f32(to_f32(drs.host()), rs_cpu, tag + " rsigma", 1e-5f);
  if (type == NormType::kLayerNorm)
    compare_f32(to_f32(dmean.host()), mean_cpu, tag + " mean", 1e-5f, 1e-2f);
  if (!fp8) return;
  check_fp8_contract(y_gpu, dt, R, C, mode, q, scale, fo, tag);
  // Without the y output (what lowbit.layernorm(quantize=...) launches): identical bytes.
  Dev drow2(n), dcol2(n);
  NormFwdParams g2 = g;
  g2.y = nullptr;
  g2.data = drow2.as<uint8_t>();
  g2.colwise_data = dcol2.as<uint8_t>();
  status_ok(norm_fwd_cuda(g2, nullptr), tag + " cuda no-y");
  compare_bytes(drow2.host(), fo.row.host(), tag + " rowwise without y");
  compare_bytes(dcol2.host(), fo.col.host(), tag + " colwise without y");
}

void check_norm_bwd(std::mt19937& rng, DType dt, int64_t R, int64_t C, NormType type, bool zc) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "norm_bwd %s %s %lldx%lld zc=%d",
                type == NormType::kRmsNorm ? "rms" : "ln", dname(dt), (long long)R, (long long)C,
                zc);
  const std::string tag = buf;
  const size_t n = size_t(R * C);
  auto x = random_tensor(rng, dt, n, 0.5f, 1.5f);
  auto dyv = random_tensor(rng, dt, n, 0.0f, 1.0f);
  std::vector<float> gamma(static_cast<size_t>(C)), mean(static_cast<size_t>(R)),
      rs(static_cast<size_t>(R));
  std::normal_distribution<float> nd(1.0f, 0.3f);
  for (auto& g : gamma) g = nd(rng);
  // Statistics from the CPU forward, as the backward receives them.
  NormFwdParams f;
  f.x = x.data();
  f.x_dtype = dt;
  f.rows = R;
  f.cols = C;
  f.gamma = gamma.data();
  f.type = type;
  f.zero_centered_gamma = zc;
  f.mean = mean.data();
  f.rsigma = rs.data();
  status_ok(norm_fwd_cpu(f), tag + " stats");

  std::vector<uint8_t> dx_cpu(n * esize(dt));
  std::vector<float> dg_cpu(static_cast<size_t>(C)), db_cpu(static_cast<size_t>(C));
  NormBwdParams p;
  p.dy = dyv.data();
  p.x = x.data();
  p.x_dtype = dt;
  p.rows = R;
  p.cols = C;
  p.mean = type == NormType::kLayerNorm ? mean.data() : nullptr;
  p.rsigma = rs.data();
  p.gamma = gamma.data();
  p.type = type;
  p.zero_centered_gamma = zc;
  p.dx = dx_cpu.data();
  p.dgamma = dg_cpu.data();
  p.dbeta = db_cpu.data();
  status_ok(norm_bwd_cpu(p), tag + " cpu");

  Dev ddy(dyv.data(), dyv.size()), dx(x.data(), x.size()), dmean(mean.data(), 4 * R),
      drs(rs.data(), 4 * R), dg(gamma.data(), 4 * C), ddx(n * esize(dt)), ddg(4 * C), ddb(4 * C),
      dws(norm_bwd_workspace_bytes(R, C));
  NormBwdParams g = p;
  g.dy = ddy.p;
  g.x = dx.p;
  g.mean = type == NormType::kLayerNorm ? dmean.as<float>() : nullptr;
  g.rsigma = drs.as<float>();
  g.gamma = dg.as<float>();
  g.dx = ddx.p;
  g.dgamma = ddg.as<float>();
  g.dbeta = ddb.as<float>();
  g.workspace = dws.p;
  status_ok(norm_bwd_cuda(g, nullptr), tag + " cuda");
  CUDA_OK(cudaDeviceSynchronize());
  compare(ddx.host(), dx_cpu, dt, n, tag + " dx", 2.0f);
  const auto dg1 = ddg.host(), db1 = ddb.host();
  compare_f32(to_f32(dg1), dg_cpu, tag + " dgamma", 2e-4f, 1e-2f);
  compare_f32(to_f32(db1), db_cpu, tag + " dbeta", 2e-4f, 1e-2f);
  status_ok(norm_bwd_cuda(g, nullptr), tag + " cuda again");
  compare_bytes(ddg.host(), dg1, tag + " dgamma reproducible");
  compare_bytes(ddb.host(), db1, tag + " dbeta reproducible");
}

// ---------------------------------------------------------------------------------------------
// activations

const char* act_name(ActKind k) {
  static const char* names[] = {"linear", "gelu",       "gelu_exact",  "relu",
                                "silu",   "quick_gelu", "squared_relu"};
  return names[int(k)];
}

void check_act(std::mt19937& rng, DType dt, int64_t R, int64_t H, ActKind act, bool gated,
               ScalingMode mode, DType q) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "act %s%s %s %lldx%lld mode=%d q=%d", act_name(act),
                gated ? "+glu" : "", dname(dt), (long long)R, (long long)H, int(mode), int(q));
  const std::string tag = buf;
  const int64_t W = gated ? 2 * H : H;
  const size_t nx = size_t(R * W), ny = size_t(R * H);
  auto x = random_tensor(rng, dt, nx, 0.0f, 2.0f);
  auto dyv = random_tensor(rng, dt, ny, 0.0f, 1.0f);
  const float scale = 2.0f;
  const bool fp8 = is_tensor_scaling(mode);

  // forward
  std::vector<uint8_t> y_cpu(ny * esize(dt));
  ActFwdParams p;
  p.x = x.data();
  p.x_dtype = dt;
  p.rows = R;
  p.cols = H;
  p.act = act;
  p.gated = gated;
  p.y = y_cpu.data();
  status_ok(act_fwd_cpu(p), tag + " fwd cpu");
  Dev dx(x.data(), x.size()), dy(ny * esize(dt)), ds(&scale, 4);
  Fp8Out fo(ny);
  ActFwdParams g = p;
  g.x = dx.p;
  g.y = dy.p;
  fo.attach(g, mode, q, ds, fp8);
  status_ok(act_fwd_cuda(g, nullptr), tag + " fwd cuda");
  CUDA_OK(cudaDeviceSynchronize());
  const auto y_gpu = dy.host();
  compare(y_gpu, y_cpu, dt, ny, tag + " y");
  if (fp8) {
    check_fp8_contract(y_gpu, dt, R, H, mode, q, scale, fo, tag + " fwd");
    Dev drow2(ny), dcol2(ny);
    ActFwdParams g2 = g;
    g2.y = nullptr;
    g2.data = drow2.as<uint8_t>();
    g2.colwise_data = dcol2.as<uint8_t>();
    status_ok(act_fwd_cuda(g2, nullptr), tag + " fwd cuda no-y");
    compare_bytes(drow2.host(), fo.row.host(), tag + " fwd rowwise without y");
    compare_bytes(dcol2.host(), fo.col.host(), tag + " fwd colwise without y");
  }

  // backward with dbias
  std::vector<uint8_t> dx_cpu(nx * esize(dt)), dbias_cpu(static_cast<size_t>(W) * esize(dt));
  ActBwdParams b;
  b.dy = dyv.data();
  b.x = x.data();
  b.x_dtype = dt;
  b.rows = R;
  b.cols = H;
  b.act = act;
  b.gated = gated;
  b.dx = dx_cpu.data();
  b.dbias = dbias_cpu.data();
  status_ok(act_bwd_cpu(b), tag + " bwd cpu");
  Dev ddy(dyv.data(), dyv.size()), ddx(nx * esize(dt)), ddb(size_t(W) * esize(dt)),
      ws(act_bwd_workspace_bytes(R, H, gated, true));
  Fp8Out bo(nx);
  ActBwdParams gb = b;
  gb.dy = ddy.p;
  gb.x = dx.p;
  gb.dx = ddx.p;
  gb.dbias = ddb.p;
  gb.workspace = ws.p;
  bo.attach(gb, mode, q, ds, fp8);
  status_ok(act_bwd_cuda(gb, nullptr), tag + " bwd cuda");
  CUDA_OK(cudaDeviceSynchronize());
  const auto dx_gpu = ddx.host();
  compare(dx_gpu, dx_cpu, dt, nx, tag + " dx", 2.0f);
  const auto db1 = ddb.host();
  // dbias sums rounded values in another order: compare loosely, and against the CPU dbias of
  // the GPU's own dx for a tighter check of the summation.
  std::vector<uint8_t> dbias_of_gpu(static_cast<size_t>(W) * esize(dt));
  {
    std::vector<float> s(size_t(W), 0.0f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < W; ++c) s[c] += get(dx_gpu, dt, size_t(r * W + c));
    for (int64_t c = 0; c < W; ++c) put(dbias_of_gpu, dt, size_t(c), s[c]);
  }
  compare(db1, dbias_of_gpu, dt, size_t(W), tag + " dbias", 2.0f, 0.05f);
  status_ok(act_bwd_cuda(gb, nullptr), tag + " bwd cuda again");
  compare_bytes(ddb.host(), db1, tag + " dbias reproducible");
  if (fp8) {
    check_fp8_contract(dx_gpu, dt, R, W, mode, q, scale, bo, tag + " bwd");
    Dev brow2(nx), bcol2(nx), ddb2(size_t(W) * esize(dt));
    ActBwdParams gb2 = gb;
    gb2.dx = nullptr;
    gb2.dbias = ddb2.p;
    gb2.data = brow2.as<uint8_t>();
    gb2.colwise_data = bcol2.as<uint8_t>();
    status_ok(act_bwd_cuda(gb2, nullptr), tag + " bwd cuda no-dx");
    compare_bytes(brow2.host(), bo.row.host(), tag + " bwd rowwise without dx");
    compare_bytes(bcol2.host(), bo.col.host(), tag + " bwd colwise without dx");
    compare_bytes(ddb2.host(), db1, tag + " bwd dbias without dx");
  }
}

// ---------------------------------------------------------------------------------------------
// softmax

void check_softmax(std::mt19937& rng, DType dt, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                   SoftmaxType type, int mask_kind) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "softmax type=%d mask=%d %s %lldx%lldx%lldx%lld", int(type),
                mask_kind, dname(dt), (long long)B, (long long)H, (long long)Sq, (long long)Sk);
  const std::string tag = buf;
  const size_t n = size_t(B * H * Sq * Sk);
  auto x = random_tensor(rng, dt, n, 0.0f, 3.0f);
  // Special rows in the first (b, h) slice (lowbit/softmax.h): a kept NaN makes the row NaN, a
  // -inf entry weighs 0, an all -inf row is zeros, +inf gives a NaN row. Both backends must put
  // NaN and 0 in the same places (compare() takes NaN == NaN).
  if (Sq >= 6 && Sk >= 2) {
    const float nan = NAN, inf = INFINITY;
    put(x, dt, size_t(1 * Sk + 0), nan);
    for (int64_t j = 0; j < Sk; ++j) put(x, dt, size_t(2 * Sk + j), -inf);
    put(x, dt, size_t(3 * Sk + 1), inf);
    for (int64_t j = 0; j < Sk; ++j) put(x, dt, size_t(4 * Sk + j), nan);
    put(x, dt, size_t(5 * Sk + 1), -inf);
  }
  // Mask (B, 1, Sq, Sk): random, with row 0 of each batch fully masked.
  std::vector<uint8_t> mask(static_cast<size_t>(B * Sq * Sk));
  std::bernoulli_distribution coin(0.3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sq; ++i)
      for (int64_t j = 0; j < Sk; ++j)
        mask[size_t((b * Sq + i) * Sk + j)] = (i == 0 && mask_kind == 2) ? 1 : coin(rng);
  SoftmaxFwdParams p;
  p.x = x.data();
  p.dtype = dt;
  p.dims[0] = B, p.dims[1] = H, p.dims[2] = Sq, p.dims[3] = Sk;
  p.scale = 0.37f;
  p.type = type;
  if (type == SoftmaxType::kMasked) {
    p.mask = mask.data();
    p.mask_strides[0] = Sq * Sk, p.mask_strides[1] = 0, p.mask_strides[2] = Sk,
    p.mask_strides[3] = 1;
  }
  std::vector<uint8_t> y_cpu(n * esize(dt));
  p.y = y_cpu.data();
  status_ok(softmax_fwd_cpu(p), tag + " cpu");
  Dev dx(x.data(), x.size()), dm(mask.data(), mask.size()), dy(n * esize(dt));
  SoftmaxFwdParams g = p;
  g.x = dx.p;
  g.y = dy.p;
  if (type == SoftmaxType::kMasked) g.mask = dm.as<uint8_t>();
  status_ok(softmax_fwd_cuda(g, nullptr), tag + " cuda");
  CUDA_OK(cudaDeviceSynchronize());
  const auto y_gpu = dy.host();
  compare(y_gpu, y_cpu, dt, n, tag + " y", 1.0f, 1e-3f);
  if (type == SoftmaxType::kMasked && mask_kind == 2) {
    bool zeros = true;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < Sk; ++j)
          zeros &= get(y_gpu, dt, size_t(((b * H + h) * Sq) * Sk + j)) == 0.0f;
    report(zeros, tag + " fully masked rows are zero");
  }
  // backward from the CPU forward output
  auto dyv = random_tensor(rng, dt, n, 0.0f, 1.0f);
  SoftmaxBwdParams bp;
  bp.dy = dyv.data();
  bp.y = y_cpu.data();
  bp.dtype = dt;
  bp.rows = B * H * Sq;
  bp.cols = Sk;
  bp.scale = p.scale;
  std::vector<uint8_t> dx_cpu(n * esize(dt));
  bp.dx = dx_cpu.data();
  status_ok(softmax_bwd_cpu(bp), tag + " bwd cpu");
  Dev ddy(dyv.data(), dyv.size()), dyc(y_cpu.data(), y_cpu.size()), ddx(n * esize(dt));
  SoftmaxBwdParams gb = bp;
  gb.dy = ddy.p;
  gb.y = dyc.p;
  gb.dx = ddx.p;
  status_ok(softmax_bwd_cuda(gb, nullptr), tag + " bwd cuda");
  CUDA_OK(cudaDeviceSynchronize());
  compare(ddx.host(), dx_cpu, dt, n, tag + " dx", 2.0f, 1e-2f);
}

// ---------------------------------------------------------------------------------------------
// benchmark

template <typename F>
float time_ms(F&& f, int iters = 20) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  CUDA_OK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) f();
  CUDA_OK(cudaEventRecord(b));
  CUDA_OK(cudaEventSynchronize(b));
  float ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}

void bench() {
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s\n", prop.name);
  // Copy bandwidth: a device-to-device copy of 256 MiB moves 512 MiB.
  const size_t cb = size_t(256) << 20;
  Dev c0(cb), c1(cb);
  const float copy_ms =
      time_ms([&] { CUDA_OK(cudaMemcpyAsync(c1.p, c0.p, cb, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * double(cb) / (copy_ms * 1e6);
  std::printf("%-58s %8.3f ms %8.1f GB/s\n", "device-to-device copy 256 MiB", copy_ms, copy_gbs);
  auto line = [&](const char* what, double bytes, float ms) {
    const double gbs = bytes / (ms * 1e6);
    std::printf("%-58s %8.3f ms %8.1f GB/s  %5.1f%% of copy\n", what, ms, gbs,
                100.0 * gbs / copy_gbs);
  };
  std::mt19937 rng(7);
  {  // LayerNorm 8192 x 4096 bf16
    const int64_t R = 8192, C = 4096;
    const size_t n = size_t(R * C);
    auto x = random_tensor(rng, DType::kBF16, n, 0.0f, 1.0f);
    std::vector<float> gamma(size_t(C), 1.1f), beta(size_t(C), 0.1f);
    const float scale = 4.0f;
    Dev dx(x.data(), x.size()), dg(gamma.data(), 4 * C), db(beta.data(), 4 * C), ds(&scale, 4),
        dy(2 * n), dmean(4 * R), drs(4 * R);
    Fp8Out fo(n);
    NormFwdParams p;
    p.x = dx.p;
    p.x_dtype = DType::kBF16;
    p.rows = R;
    p.cols = C;
    p.gamma = dg.as<float>();
    p.beta = db.as<float>();
    p.mean = dmean.as<float>();
    p.rsigma = drs.as<float>();
    const double stats = 8.0 * R + 8.0 * C;
    NormFwdParams h = p;
    h.y = dy.p;
    line("layernorm bf16 8192x4096 -> bf16", 4.0 * n + stats,
         time_ms([&] { norm_fwd_cuda(h, nullptr); }));
    NormFwdParams q = p;
    fo.attach(q, ScalingMode::kDelayedTensor, q.q_dtype, ds, true);
    line("layernorm+quantize delayed bf16 8192x4096 -> fp8 row+col", 4.0 * n + stats,
         time_ms([&] { norm_fwd_cuda(q, nullptr); }));
    q.mode = ScalingMode::kCurrentTensor;
    line("layernorm+quantize current bf16 8192x4096 -> fp8 row+col", 4.0 * n + stats,
         time_ms([&] { norm_fwd_cuda(q, nullptr); }));
    q.mode = ScalingMode::kDelayedTensor;
    q.type = NormType::kRmsNorm;
    q.beta = nullptr;
    q.mean = nullptr;
    line("rmsnorm+quantize delayed bf16 8192x4096 -> fp8 row+col", 4.0 * n + stats,
         time_ms([&] { norm_fwd_cuda(q, nullptr); }));
    Dev ddx(2 * n), ddg(4 * C), ddb(4 * C), ws(norm_bwd_workspace_bytes(R, C));
    NormBwdParams b;
    b.dy = dx.p;
    b.x = dx.p;
    b.x_dtype = DType::kBF16;
    b.rows = R;
    b.cols = C;
    b.mean = dmean.as<float>();
    b.rsigma = drs.as<float>();
    b.gamma = dg.as<float>();
    b.dx = ddx.p;
    b.dgamma = ddg.as<float>();
    b.dbeta = ddb.as<float>();
    b.workspace = ws.p;
    line("layernorm backward bf16 8192x4096 (dx, dgamma, dbeta)", 6.0 * n + stats,
         time_ms([&] { norm_bwd_cuda(b, nullptr); }));
  }
  for (bool gated : {false, true}) {  // activations, output 8192 x 16384 bf16
    const int64_t R = 8192, H = 16384, W = gated ? 2 * H : H;
    const size_t ny = size_t(R * H), nx = size_t(R * W);
    auto x = random_tensor(rng, DType::kBF16, nx, 0.0f, 1.0f);
    const float scale = 4.0f;
    Dev dx(x.data(), x.size()), ds(&scale, 4), dy(2 * ny);
    Fp8Out fo(nx);
    ActFwdParams p;
    p.x = dx.p;
    p.x_dtype = DType::kBF16;
    p.rows = R;
    p.cols = H;
    p.act = ActKind::kGeluTanh;
    p.gated = gated;
    ActFwdParams h = p;
    h.y = dy.p;
    const char* nm = gated ? "geglu" : "gelu";
    std::string s = std::string(nm) + " bf16 8192x" + std::to_string(W) + " -> bf16";
    line(s.c_str(), 2.0 * nx + 2.0 * ny, time_ms([&] { act_fwd_cuda(h, nullptr); }));
    ActFwdParams q = p;
    fo.attach(q, ScalingMode::kDelayedTensor, q.q_dtype, ds, true);
    s = std::string(nm) + "+quantize delayed bf16 8192x" + std::to_string(W) + " -> fp8 row+col";
    line(s.c_str(), 2.0 * nx + 2.0 * ny, time_ms([&] { act_fwd_cuda(q, nullptr); }));
    q.mode = ScalingMode::kCurrentTensor;
    s = std::string(nm) + "+quantize current bf16 8192x" + std::to_string(W) + " -> fp8 row+col";
    line(s.c_str(), 2.0 * nx + 2.0 * ny, time_ms([&] { act_fwd_cuda(q, nullptr); }));
    // backward: dy (R, H) + x (R, W) -> dx fp8 row+col (R, W) + dbias
    Dev ddy(2 * ny), ddb(2 * W), ws(act_bwd_workspace_bytes(R, H, gated, true));
    ActBwdParams b;
    b.dy = ddy.p;
    b.x = dx.p;
    b.x_dtype = DType::kBF16;
    b.rows = R;
    b.cols = H;
    b.act = ActKind::kGeluTanh;
    b.gated = gated;
    fo.attach(b, ScalingMode::kDelayedTensor, DType::kE5M2, ds, true);
    b.dbias = ddb.p;
    b.workspace = ws.p;
    s = std::string("d") + nm + "+dbias+quantize delayed bf16 -> fp8 row+col";
    line(s.c_str(), 2.0 * ny + 2.0 * nx + 2.0 * nx, time_ms([&] { act_bwd_cuda(b, nullptr); }));
  }
  {  // softmax, causal, (4, 32, 2048, 2048) bf16
    const int64_t B = 4, H = 32, S = 2048;
    const size_t n = size_t(B * H * S * S);
    Dev dx(2 * n), dy(2 * n);
    CUDA_OK(cudaMemset(dx.p, 0, 2 * n));
    SoftmaxFwdParams p;
    p.x = dx.p;
    p.y = dy.p;
    p.dtype = DType::kBF16;
    p.dims[0] = B, p.dims[1] = H, p.dims[2] = S, p.dims[3] = S;
    p.type = SoftmaxType::kCausal;
    p.scale = 0.125f;
    line("softmax causal bf16 4x32x2048x2048", 4.0 * n,
         time_ms([&] { softmax_fwd_cuda(p, nullptr); }, 5));
  }
  CUDA_OK(cudaGetLastError());
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, do_bench = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--bench")) do_bench = true;
  }
  if (do_bench) {
    bench();
    return 0;
  }
  std::mt19937 rng(1234);
  const DType dts[] = {DType::kF32, DType::kBF16, DType::kF16};
  const ScalingMode modes[] = {ScalingMode::kNoScaling, ScalingMode::kDelayedTensor,
                               ScalingMode::kCurrentTensor};

  // norm: fast path (vectorised rows), partial bands, generic path (odd C, too-long rows); FP8
  // copies through the tile cast where rows and columns are multiples of 16 ({144, 1040}: a
  // partial 128x64 tile on both axes), through the norm kernel's own stores otherwise.
  std::vector<std::pair<int64_t, int64_t>> norm_shapes = {
      {64, 256}, {37, 1024}, {48, 200}, {16, 33}, {144, 1040}};
  if (!quick) {
    norm_shapes.push_back({256, 4096});
    norm_shapes.push_back({40, 8192});
    norm_shapes.push_back({96, 768});
  }
  for (auto [R, C] : norm_shapes)
    for (DType dt : dts)
      for (NormType nt : {NormType::kLayerNorm, NormType::kRmsNorm})
        for (ScalingMode m : modes) {
          const bool zc = (R + int(m)) % 2 == 1;
          check_norm(rng, dt, R, C, nt, zc, nt == NormType::kLayerNorm, m,
                     m == ScalingMode::kCurrentTensor ? DType::kE5M2 : DType::kE4M3);
        }
  if (!quick) {
    // More bands than resident blocks (the persistent loop and its cross-band prefetch), with a
    // 16-row last band.
    check_norm(rng, DType::kBF16, 8240, 4096, NormType::kLayerNorm, false, true,
               ScalingMode::kDelayedTensor, DType::kE4M3);
    check_norm(rng, DType::kBF16, 8240, 4096, NormType::kRmsNorm, true, false,
               ScalingMode::kCurrentTensor, DType::kE5M2);
    check_norm(rng, DType::kF16, 9000, 1024, NormType::kLayerNorm, false, true,
               ScalingMode::kCurrentTensor, DType::kE4M3);
  }
  std::vector<std::pair<int64_t, int64_t>> bwd_shapes = {{64, 256}, {37, 1000}, {16, 33}};
  if (!quick) {
    bwd_shapes.push_back({300, 4096});
    bwd_shapes.push_back({20, 20000});
  }
  for (auto [R, C] : bwd_shapes)
    for (DType dt : dts)
      for (NormType nt : {NormType::kLayerNorm, NormType::kRmsNorm})
        check_norm_bwd(rng, dt, R, C, nt, R % 2 == 1);

  // activations: tile path with partial tiles, generic path (odd H).
  std::vector<std::pair<int64_t, int64_t>> act_shapes = {{64, 128}, {70, 200}, {33, 45}};
  if (!quick) act_shapes.push_back({256, 1024});
  const ActKind acts[] = {ActKind::kLinear,     ActKind::kGeluTanh, ActKind::kGeluExact,
                          ActKind::kRelu,       ActKind::kSilu,     ActKind::kQuickGelu,
                          ActKind::kSquaredRelu};
  for (auto [R, H] : act_shapes)
    for (DType dt : dts)
      for (ActKind a : acts)
        for (bool gated : {false, true})
          for (ScalingMode m : modes) {
            if (quick && a != ActKind::kGeluTanh && a != ActKind::kSilu) continue;
            check_act(rng, dt, R, H, a, gated, m,
                      (int(a) + int(gated)) % 2 ? DType::kE5M2 : DType::kE4M3);
          }

  // softmax: fast path and generic path (long / odd rows), every type.
  struct S4 {
    int64_t b, h, sq, sk;
  };
  std::vector<S4> sm_shapes = {{2, 3, 16, 16}, {1, 2, 33, 33}, {2, 1, 8, 300}};
  if (!quick) {
    sm_shapes.push_back({2, 4, 128, 128});
    sm_shapes.push_back({1, 2, 64, 4096});
  }
  for (auto s : sm_shapes)
    for (DType dt : dts) {
      check_softmax(rng, dt, s.b, s.h, s.sq, s.sk, SoftmaxType::kScaled, 0);
      check_softmax(rng, dt, s.b, s.h, s.sq, s.sk, SoftmaxType::kMasked, 1);
      check_softmax(rng, dt, s.b, s.h, s.sq, s.sk, SoftmaxType::kMasked, 2);
      if (s.sq == s.sk) check_softmax(rng, dt, s.b, s.h, s.sq, s.sk, SoftmaxType::kCausal, 0);
    }

  return summary();
}
