// Standalone check of the CUDA quantization kernels against the CPU kernels (no JAX).
//
// Build (from the repository root; the CPU kernels and validate() are linked in):
//   mkdir -p build && nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc/include \
//     csrc/tests/check_quantize_cuda.cu csrc/kernels/cuda/quantize.cu \
//     csrc/kernels/cuda/dequantize.cu csrc/kernels/cuda/grouped_quantize.cu \
//     csrc/kernels/cpu/*.cc csrc/kernels/common/*.cc -o build/check_quantize_cuda
// Run:
//   build/check_quantize_cuda            all cases (quantize, dequantize, grouped, CUDA graph)
//   build/check_quantize_cuda --quick    a subset (for compute-sanitizer)
//   compute-sanitizer --tool memcheck --error-exitcode 9 build/check_quantize_cuda --quick
//   build/check_quantize_cuda bench      bf16 -> FP8 rowwise+colwise at 8192x16384 vs a D2D copy
//                                        (bench mxfp8: only the cases whose name contains "mxfp8";
//                                        bench block: the FP8 block scaling cases)
//   build/check_quantize_cuda bench grouped   the grouped per-tensor cast at the MoE layer's
//                                        shapes (issue 27), with a bitwise check of its kernels
//   build/check_quantize_cuda cvtcheck   hardware FP8 cvt vs encode_rne over all 2^32 floats
// Exit status: 0 when every comparison passed.
//
// Every output is compared bit for bit with the CPU kernel, except dbias (float32 sums in another
// order): it must match the CPU bits or lie within a float32-summation bound of a float64 sum.
// GPU outputs start poisoned, GPU workspaces start as garbage, and buffers are allocated at their
// exact sizes so that memcheck sees any stray access.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/cuda/cast_kernels.cuh"
#include "check_common.h"
#include "lowbit/block_scaling.h"
#include "lowbit/formats.h"
#include "lowbit/quantize.h"

using namespace lowbit;

namespace {

int g_failures = 0, g_cases = 0;
bool g_verbose = false;

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  int range(int lo, int hi) { return lo + int(next() % uint64_t(hi - lo + 1)); }
};

size_t esize(DType t) {
  return t == DType::kF32 ? 4 : (t == DType::kBF16 || t == DType::kF16 ? 2 : 1);
}
const char* dname(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kE2M1: return "e2m1";
    default: return "?";
  }
}
const char* mname(ScalingMode m) {
  switch (m) {
    case ScalingMode::kNoScaling: return "none";
    case ScalingMode::kDelayedTensor: return "delayed";
    case ScalingMode::kCurrentTensor: return "current";
    case ScalingMode::kMxfp8_1d: return "mxfp8";
    case ScalingMode::kNvfp4_1d: return "nvfp4_1d";
    case ScalingMode::kNvfp4_2d: return "nvfp4_2d";
    case ScalingMode::kBlock1d: return "block1d";
    case ScalingMode::kBlock2d: return "block2d";
  }
  return "?";
}

float host_to_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}
void host_store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
  }
}

// Input generator. special: 0 clean, 1 Inf/NaN/subnormal/huge/-0 sprinkled, 2 like 1 without
// Inf/huge (dbias cases: a float32 overflow would depend on the summation order).
// Magnitudes vary per 16x32 patch (MX/NVFP4 block scales of many exponents), and a 32x32 block
// plus one row are zero.
std::vector<uint8_t> make_input(DType t, int64_t R, int64_t C, int special, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint8_t> buf(size_t(R * C) * esize(t) + 64);
  const bool f16 = t == DType::kF16;
  std::vector<int> patch_exp(size_t(((R + 15) / 16) * ((C + 31) / 32) + 1));
  for (auto& e : patch_exp) e = f16 ? rng.range(-10, 8) : rng.range(-30, 30);
  const float huge = f16 ? 65504.0f : 3.0e38f;
  const float subn[3] = {f16 ? 3.0e-6f : 1.0e-40f, f16 ? -6.0e-8f : -3.0e-42f,
                         f16 ? 5.9e-8f : 1.4e-45f};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      float v = float(rng.normal() *
                      std::ldexp(1.0, patch_exp[size_t((r / 16) * ((C + 31) / 32) + c / 32)]));
      if (special) {
        const uint64_t k = rng.next() % 400;
        if (k == 0)
          v = std::nanf("");
        else if (k == 1)
          v = bits_float(0xffc00123u);  // negative NaN with a payload
        else if (k == 2 && special == 1)
          v = INFINITY;
        else if (k == 3 && special == 1)
          v = -INFINITY;
        else if (k == 4)
          v = subn[rng.next() % 3];
        else if (k == 5 && special == 1)
          v = (rng.next() & 1) ? huge : -huge;
        else if (k == 6)
          v = -0.0f;
        else if (k == 7)
          v = -1e-30f;
      }
      if (r < 32 && c >= 32 && c < 64) v = 0.0f;  // an all-zero block
      if (r == 5) v = 0.0f;                       // an all-zero row
      host_store(buf.data(), t, r * C + c, v);
    }
  return buf;
}

struct Dev {
  void* p = nullptr;
  size_t n = 0;
  Dev() = default;
  explicit Dev(size_t bytes, int fill = 0xA5) : n(bytes) {
    if (bytes) {
      CK(cudaMalloc(&p, bytes));
      CK(cudaMemset(p, fill, bytes));
    }
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (p) cudaFree(p);
  }
  void up(const void* h, size_t bytes) { CK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice)); }
  std::vector<uint8_t> down() const {
    std::vector<uint8_t> h(n);
    if (n) CK(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
    return h;
  }
};

// Bitwise comparison; `fkind` (a float dtype) makes any NaN equal any NaN.
bool same(const std::string& what, const uint8_t* cpu, const uint8_t* gpu, size_t bytes,
          DType fkind = DType::kE8M0) {
  const size_t es =
      (fkind == DType::kF32 || fkind == DType::kBF16 || fkind == DType::kF16) ? esize(fkind) : 1;
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < bytes / es; ++i) {
    if (std::memcmp(cpu + i * es, gpu + i * es, es) == 0) continue;
    if (es > 1) {
      const bool cn = std::isnan(host_to_float(cpu, fkind, int64_t(i))),
                 gn = std::isnan(host_to_float(gpu, fkind, int64_t(i)));
      if (cn && gn) continue;
    }
    if (first == SIZE_MAX) first = i;
    ++bad;
  }
  if (bad) {
    std::printf("    %s: %zu of %zu differ; first at element %zu: cpu=0x", what.c_str(), bad,
                bytes / es, first);
    for (size_t b = es; b-- > 0;) std::printf("%02x", cpu[first * es + b]);
    std::printf(" gpu=0x");
    for (size_t b = es; b-- > 0;) std::printf("%02x", gpu[first * es + b]);
    std::printf("\n");
  }
  return bad == 0;
}

// dbias: equal to the CPU bits, or within the float32 summation bound of the float64 sum.
bool dbias_ok(const uint8_t* x, DType t, int64_t R, int64_t C, const uint8_t* cpu,
              const uint8_t* gpu) {
  int bad = 0;
  for (int64_t c = 0; c < C; ++c) {
    const float g = host_to_float(gpu, t, c), h = host_to_float(cpu, t, c);
    if (std::memcmp(cpu + c * esize(t), gpu + c * esize(t), esize(t)) == 0) continue;
    if (std::isnan(g) && std::isnan(h)) continue;
    double s = 0, sa = 0;
    for (int64_t r = 0; r < R; ++r) {
      const double v = host_to_float(x, t, r * C + c);
      s += v;
      sa += std::fabs(v);
    }
    const double out_ulp = t == DType::kF32 ? 0x1p-23 : (t == DType::kBF16 ? 0x1p-7 : 0x1p-10);
    const double tol = 2.0 * double(R) * 0x1p-24 * sa + out_ulp * std::fabs(s) + 1e-30;
    if (!(std::fabs(double(g) - s) <= tol)) {
      if (bad++ < 3)
        std::printf("    dbias[%lld]: gpu=%.9g cpu=%.9g f64=%.9g tol=%.3g\n", (long long)c, g, h, s,
                    tol);
    }
  }
  return bad == 0;
}

void report(bool ok, const std::string& name) {
  ++g_cases;
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %s\n", name.c_str());
  } else if (g_verbose) {
    std::printf("PASS %s\n", name.c_str());
  }
}

size_t data_bytes(ScalingMode m, DType xdt, int64_t rows, int64_t cols) {
  if (m == ScalingMode::kNoScaling) return size_t(rows * cols) * esize(xdt);
  if (is_nvfp4(m)) return size_t(rows * cols / 2);
  return size_t(rows * cols);
}
size_t sinv_bytes(ScalingMode m, int64_t rows, int64_t cols) {
  if (m == ScalingMode::kNoScaling) return 0;
  if (is_tensor_scaling(m)) return 4;
  if (is_fp8_block(m))
    return size_t(fp8_block_scale_rows(m, rows, cols) * fp8_block_scale_cols(m, rows, cols)) * 4;
  return size_t(rows * cols / block_size(m));
}

struct QCase {
  DType xdt;
  int64_t R, C;
  ScalingMode mode;
  DType qdt;
  bool row, col, sr, rht, dbias;
  int special;
  int misalign;   // elements by which x is offset from an aligned address (forces the generic path)
  int parts = 0;  // > 0: the GPU reads x as this many column blocks in separate buffers (x_parts)
};

std::string qname(const QCase& q) {
  char b[256];
  std::snprintf(b, sizeof b, "quantize %s %s->%s %lldx%lld %s%s%s%s%s special=%d%s", mname(q.mode),
                dname(q.xdt), dname(q.qdt), (long long)q.R, (long long)q.C, q.row ? "row" : "",
                q.col ? "+col" : "", q.sr ? " sr" : "", q.rht ? " rht" : "",
                q.dbias ? " dbias" : "", q.special, q.misalign ? " misaligned" : "");
  std::string out = b;
  if (q.parts) out += " in " + std::to_string(q.parts) + " parts";
  return out;
}

// Dequantizes one CPU-quantized copy on both backends and compares.
void check_dequant(const QCase& q, const char* which, const std::vector<uint8_t>& data,
                   const std::vector<uint8_t>& sinv, float gsi, int64_t rows, int64_t cols,
                   bool rht, DType out, cudaStream_t st) {
  DequantizeParams p;
  p.q_dtype = q.qdt;
  p.rows = rows;
  p.cols = cols;
  p.mode = q.mode;
  p.rht = rht;
  p.out_dtype = out;
  const size_t ob = size_t(rows * cols) * esize(out);
  std::vector<uint8_t> hout(ob, 0xA5);
  p.data = data.data();
  p.scale_inv = sinv.data();
  p.global_scale_inv = &gsi;
  p.out = hout.data();
  Status sc = dequantize_cpu(p);
  if (!sc.ok()) return;  // e.g. a block size the copy does not allow
  Dev dd(data.size()), ds(sinv.size()), dg(sizeof(float)), dout(ob);
  dd.up(data.data(), data.size());
  ds.up(sinv.data(), sinv.size());
  dg.up(&gsi, sizeof(float));
  p.data = dd.p;
  p.scale_inv = ds.p;
  p.global_scale_inv = static_cast<const float*>(dg.p);
  p.out = dout.p;
  Status sg = dequantize_cuda(p, st);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  std::string name = "dequantize " + std::string(which) + " of [" + qname(q) + "] -> " + dname(out);
  bool ok = sg.ok();
  if (!ok) std::printf("    cuda status: %s\n", sg.message.c_str());
  if (ok) ok = same("out", hout.data(), dout.down().data(), ob, out);
  report(ok, name);
}

void run_quantize_case(const QCase& q, uint64_t seed, cudaStream_t st, bool with_dequant) {
  const int64_t R = q.R, C = q.C, n = R * C;
  std::vector<uint8_t> xin = make_input(q.xdt, R, C, q.special, seed);
  const size_t xoff = size_t(q.misalign) * esize(q.xdt);
  std::vector<uint8_t> xh(size_t(n) * esize(q.xdt) + xoff + 16);
  std::memcpy(xh.data() + xoff, xin.data(), size_t(n) * esize(q.xdt));
  const uint8_t* xptr = xh.data() + xoff;
  Rng rng(seed ^ 0x5eed);
  const uint32_t seed2[2] = {uint32_t(rng.next()), uint32_t(rng.next())};
  // Delayed scale: about right for the data, off by a random factor (some saturation).
  float amax_est = 0.0f;
  for (int64_t i = 0; i < n; ++i)
    amax_est = std::max(amax_est, abs_ignore_nan(host_to_float(xptr, q.xdt, i)));
  const float fmax = q.qdt == DType::kE5M2 ? 57344.0f : 448.0f;
  float dscale = scale_from_amax(std::isinf(amax_est) ? 1.0f : amax_est, fmax) *
                 float(std::ldexp(1.0, rng.range(-2, 2)));
  if (!std::isfinite(dscale) || dscale == 0.0f) dscale = 1.0f;

  const size_t db = data_bytes(q.mode, q.xdt, R, C), cdb = data_bytes(q.mode, q.xdt, C, R);
  const size_t sb = sinv_bytes(q.mode, R, C), csb = sinv_bytes(q.mode, C, R);
  const bool nv = is_nvfp4(q.mode);

  // CPU
  std::vector<uint8_t> h_data(db, 0xA5), h_sinv(sb, 0xA5), h_cdata(cdb, 0xA5), h_csinv(csb, 0xA5);
  std::vector<uint8_t> h_dbias(size_t(C) * esize(q.xdt), 0xA5);
  float h_amax = -1.0f, h_gsi[2] = {-1.0f, -1.0f};
  QuantizeParams pc;
  pc.x = xptr;
  pc.x_dtype = q.xdt;
  pc.rows = R;
  pc.cols = C;
  pc.mode = q.mode;
  pc.q_dtype = q.qdt;
  pc.rowwise = q.row;
  pc.colwise = q.col;
  pc.scale = &dscale;
  pc.sr_seed = q.sr ? seed2 : nullptr;
  pc.rht = q.rht;
  // FP8 block scaling: power-of-two scales on every other case, an amax floor on every third.
  pc.power_2_scale = is_fp8_block(q.mode) && (seed & 1);
  pc.amax_epsilon = is_fp8_block(q.mode) && seed % 3 == 0 ? 1e-3f : 0.0f;
  pc.data = q.row ? h_data.data() : nullptr;
  pc.scale_inv = q.row ? h_sinv.data() : nullptr;
  pc.colwise_data = q.col ? h_cdata.data() : nullptr;
  pc.colwise_scale_inv = q.col ? h_csinv.data() : nullptr;
  pc.amax = &h_amax;
  pc.global_scale_inv = nv ? h_gsi : nullptr;
  pc.dbias = q.dbias ? h_dbias.data() : nullptr;
  const Status sc = quantize_cpu(pc);

  // GPU: only the requested outputs exist.
  Dev dx(size_t(n) * esize(q.xdt) + xoff + 16, 0);
  dx.up(xh.data(), xh.size());
  Dev d_data(q.row ? db : 0), d_sinv(q.row ? sb : 0), d_cdata(q.col ? cdb : 0),
      d_csinv(q.col ? csb : 0);
  Dev d_dbias(q.dbias ? size_t(C) * esize(q.xdt) : 0), d_amax(4), d_gsi(nv ? 8 : 0), d_scale(4),
      d_seed(8);
  d_scale.up(&dscale, 4);
  d_seed.up(seed2, 8);
  QuantizeParams pg = pc;
  pg.x = static_cast<uint8_t*>(dx.p) + xoff;
  // In parts: column block i of x in its own buffer (the CPU reference reads x whole).
  std::vector<std::unique_ptr<Dev>> d_parts;
  if (q.parts) {
    const int64_t P = C / q.parts;
    const size_t pb = size_t(P) * esize(q.xdt);
    for (int i = 0; i < q.parts; ++i) {
      std::vector<uint8_t> block(size_t(R) * pb);
      for (int64_t r = 0; r < R; ++r)
        std::memcpy(block.data() + size_t(r) * pb,
                    xptr + (size_t(r * C) + size_t(i * P)) * esize(q.xdt), pb);
      d_parts.push_back(std::make_unique<Dev>(block.size()));
      d_parts.back()->up(block.data(), block.size());
    }
    for (int i = 0; i < q.parts; ++i) pg.x_parts[i] = d_parts[i]->p;
    pg.x = d_parts[0]->p;
    pg.n_parts = q.parts;
    pg.part_cols = P;
  }
  pg.scale = static_cast<const float*>(d_scale.p);
  pg.sr_seed = q.sr ? static_cast<const uint32_t*>(d_seed.p) : nullptr;
  pg.data = d_data.p;
  pg.scale_inv = d_sinv.p;
  pg.colwise_data = d_cdata.p;
  pg.colwise_scale_inv = d_csinv.p;
  pg.amax = static_cast<float*>(d_amax.p);
  pg.global_scale_inv = static_cast<float*>(d_gsi.p);
  pg.dbias = d_dbias.p;
  Dev d_ws(quantize_workspace_bytes(pg), 0xFF);  // garbage: kernels must not rely on zeros
  pg.workspace = d_ws.p;
  const Status sg = quantize_cuda(pg, st);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());

  const std::string name = qname(q);
  if (!sc.ok()) {  // invalid combination: the GPU must refuse it too
    report(!sg.ok(), name + " (invalid: " + sc.message + ")");
    return;
  }
  bool ok = sg.ok();
  if (!ok) std::printf("    cuda status: %s\n", sg.message.c_str());
  if (ok) {
    const DType fk = q.mode == ScalingMode::kNoScaling ? q.xdt : DType::kE8M0;
    if (q.row) ok &= same("data", h_data.data(), d_data.down().data(), db, fk);
    if (q.row && sb) ok &= same("scale_inv", h_sinv.data(), d_sinv.down().data(), sb);
    if (q.col) ok &= same("colwise_data", h_cdata.data(), d_cdata.down().data(), cdb, fk);
    if (q.col && csb) ok &= same("colwise_scale_inv", h_csinv.data(), d_csinv.down().data(), csb);
    ok &= same("amax", reinterpret_cast<uint8_t*>(&h_amax), d_amax.down().data(), 4);
    if (nv)
      ok &= same("global_scale_inv", reinterpret_cast<uint8_t*>(h_gsi), d_gsi.down().data(), 8);
    if (q.dbias) ok &= dbias_ok(xptr, q.xdt, R, C, h_dbias.data(), d_dbias.down().data());
  }
  report(ok, name);

  if (with_dequant && ok && q.mode != ScalingMode::kNoScaling && n > 0) {
    for (DType out : {q.xdt, DType::kF32}) {
      if (q.row)
        check_dequant(q, "rowwise", h_data, h_sinv, nv ? h_gsi[0] : 0.0f, R, C, false, out, st);
      if (q.col)
        check_dequant(q, "colwise", h_cdata, h_csinv, nv ? h_gsi[1] : 0.0f, C, R, q.rht, out, st);
      if (out == DType::kF32) break;
    }
  }
}

struct GCase {
  DType xdt;
  int64_t M, K;
  ScalingMode mode;
  DType qdt;
  bool row, col;
  std::vector<int32_t> sizes;
  int special;
  int64_t inf_row = -1;  // >= 0: one +Inf in this row (a non-finite amax in its group only)
};

// G group sizes summing to M, multiples of `align` (the last takes the rest), drawn at random.
std::vector<int32_t> ragged_sizes(int64_t M, int G, int align, uint64_t seed) {
  Rng rng(seed);
  std::vector<double> w(static_cast<size_t>(G));
  double sum = 0.0;
  for (auto& x : w) sum += (x = 0.2 + rng.uniform());
  std::vector<int32_t> sizes(static_cast<size_t>(G));
  int64_t left = M;
  for (int g = 0; g < G; ++g) {
    int64_t n = g + 1 < G ? int64_t(double(M) * w[size_t(g)] / sum) / align * align : left;
    n = std::min(n, left);
    sizes[size_t(g)] = int32_t(n);
    left -= n;
  }
  return sizes;
}

void run_grouped_case(const GCase& q, uint64_t seed, cudaStream_t st) {
  const int64_t M = q.M, K = q.K, G = int64_t(q.sizes.size()), n = M * K;
  std::vector<uint8_t> xh = make_input(q.xdt, M, K, q.special, seed);
  if (q.inf_row >= 0 && q.inf_row < M && K > 0)
    host_store(xh.data(), q.xdt, q.inf_row * K + K / 2, INFINITY);
  Rng rng(seed ^ 0x6006);
  std::vector<float> scales(size_t(std::max<int64_t>(G, 1)));
  for (auto& s : scales) s = float(std::ldexp(1.0, rng.range(-8, 8)) * (1.0 + rng.uniform()));
  const bool mx = q.mode == ScalingMode::kMxfp8_1d, blk = q.mode == ScalingMode::kBlock1d;
  // BLOCK_1D: the grouped layouts of lowbit/block_scaling.h (float32).
  const size_t db = size_t(n),
               sb = mx    ? size_t(n / 32)
                    : blk ? size_t(M * ((K + 127) / 128)) * 4
                          : size_t(G) * 4,
               csb = blk ? size_t(grouped_block_colwise_rows(M, G) * K) * 4 : size_t(G) * 4;

  std::vector<uint8_t> h_data(db, 0xA5), h_sinv(sb, 0xA5), h_cdata(db, 0xA5), h_csinv(csb, 0xA5);
  std::vector<float> h_amax(size_t(G), -1.0f);
  GroupedQuantizeParams pc;
  pc.x = xh.data();
  pc.x_dtype = q.xdt;
  pc.rows = M;
  pc.cols = K;
  pc.group_sizes = q.sizes.data();
  pc.num_groups = G;
  pc.mode = q.mode;
  pc.q_dtype = q.qdt;
  pc.rowwise = q.row;
  pc.colwise = q.col;
  pc.scale = scales.data();
  pc.power_2_scale = blk && (seed & 1);
  pc.amax_epsilon = blk && (seed & 2) ? 1e-3f : 0.0f;
  pc.data = q.row ? h_data.data() : nullptr;
  pc.scale_inv = q.row ? h_sinv.data() : nullptr;
  pc.colwise_data = q.col ? h_cdata.data() : nullptr;
  pc.colwise_scale_inv = q.col ? h_csinv.data() : nullptr;
  pc.amax = h_amax.data();
  const Status sc = grouped_quantize_cpu(pc);

  Dev dx(xh.size(), 0), dsz(size_t(G) * 4), dsc(scales.size() * 4);
  dx.up(xh.data(), xh.size());
  dsz.up(q.sizes.data(), size_t(G) * 4);
  dsc.up(scales.data(), scales.size() * 4);
  Dev d_data(q.row ? db : 0), d_sinv(q.row ? sb : 0), d_cdata(q.col ? db : 0),
      d_csinv(q.col ? csb : 0), d_amax(size_t(G) * 4);
  GroupedQuantizeParams pg = pc;
  pg.x = dx.p;
  pg.group_sizes = static_cast<const int32_t*>(dsz.p);
  pg.scale = static_cast<const float*>(dsc.p);
  pg.data = d_data.p;
  pg.scale_inv = d_sinv.p;
  pg.colwise_data = d_cdata.p;
  pg.colwise_scale_inv = d_csinv.p;
  pg.amax = static_cast<float*>(d_amax.p);
  Dev d_ws(grouped_quantize_workspace_bytes(pg), 0xFF);
  pg.workspace = d_ws.p;
  const Status sg = grouped_quantize_cuda(pg, st);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());

  char b[256];
  std::snprintf(b, sizeof b, "grouped %s %s->%s %lldx%lld %s%s G=%lld sizes[0]=%d special=%d",
                mname(q.mode), dname(q.xdt), dname(q.qdt), (long long)M, (long long)K,
                q.row ? "row" : "", q.col ? "+col" : "", (long long)G, G ? q.sizes[0] : 0,
                q.special);
  if (!sc.ok()) {
    report(!sg.ok(), std::string(b) + " (invalid: " + sc.message + ")");
    return;
  }
  bool ok = sg.ok();
  if (!ok) std::printf("    cuda status: %s\n", sg.message.c_str());
  if (ok) {
    if (q.row) ok &= same("data", h_data.data(), d_data.down().data(), db);
    if (q.row) ok &= same("scale_inv", h_sinv.data(), d_sinv.down().data(), sb);
    if (q.col) ok &= same("colwise_data", h_cdata.data(), d_cdata.down().data(), db);
    if (q.col) ok &= same("colwise_scale_inv", h_csinv.data(), d_csinv.down().data(), csb);
    ok &= same("amax", reinterpret_cast<uint8_t*>(h_amax.data()), d_amax.down().data(),
               size_t(G) * 4);
  }
  report(ok, b);
}

// Captures quantize_cuda into a CUDA graph, replays it twice on fresh inputs, compares with CPU.
void run_graph_case(DType xdt, int64_t R, int64_t C, ScalingMode mode, DType qdt, bool sr,
                    bool rht) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int64_t n = R * C;
  const bool nv = is_nvfp4(mode);
  const size_t db = data_bytes(mode, xdt, R, C), sb = sinv_bytes(mode, R, C),
               csb = sinv_bytes(mode, C, R);
  Dev dx(size_t(n) * esize(xdt)), d_data(db), d_sinv(sb), d_cdata(db), d_csinv(csb), d_amax(4),
      d_gsi(8), d_dbias(size_t(C) * esize(xdt)), d_seed(8), d_scale(4);
  const uint32_t seed2[2] = {0x12345678u, 0x9abcdef0u};
  d_seed.up(seed2, 8);
  QuantizeParams pg;
  pg.x = dx.p;
  pg.x_dtype = xdt;
  pg.rows = R;
  pg.cols = C;
  pg.mode = mode;
  pg.q_dtype = qdt;
  pg.rowwise = pg.colwise = true;
  pg.sr_seed = sr ? static_cast<const uint32_t*>(d_seed.p) : nullptr;
  pg.rht = rht;
  pg.data = d_data.p;
  pg.scale_inv = d_sinv.p;
  pg.colwise_data = d_cdata.p;
  pg.colwise_scale_inv = d_csinv.p;
  pg.amax = static_cast<float*>(d_amax.p);
  pg.global_scale_inv = nv ? static_cast<float*>(d_gsi.p) : nullptr;
  pg.dbias = d_dbias.p;
  pg.scale = static_cast<const float*>(d_scale.p);
  Dev d_ws(quantize_workspace_bytes(pg), 0xFF);
  pg.workspace = d_ws.p;
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  const Status s = quantize_cuda(pg, st);
  CK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  bool ok = s.ok();
  for (int rep = 0; rep < 2 && ok; ++rep) {
    std::vector<uint8_t> xh = make_input(xdt, R, C, 0, 777 + rep);
    dx.up(xh.data(), size_t(n) * esize(xdt));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    std::vector<uint8_t> h_data(db), h_sinv(sb), h_cdata(db), h_csinv(csb),
        h_dbias(size_t(C) * esize(xdt));
    float h_amax, h_gsi[2];
    QuantizeParams pc = pg;
    pc.x = xh.data();
    pc.scale = nullptr;
    pc.sr_seed = sr ? seed2 : nullptr;
    pc.data = h_data.data();
    pc.scale_inv = h_sinv.data();
    pc.colwise_data = h_cdata.data();
    pc.colwise_scale_inv = h_csinv.data();
    pc.amax = &h_amax;
    pc.global_scale_inv = nv ? h_gsi : nullptr;
    pc.dbias = h_dbias.data();
    pc.workspace = nullptr;
    ok &= quantize_cpu(pc).ok();
    ok &= same("data", h_data.data(), d_data.down().data(), db);
    ok &= same("colwise_data", h_cdata.data(), d_cdata.down().data(), db);
    ok &= same("scale_inv", h_sinv.data(), d_sinv.down().data(), sb);
    ok &= same("colwise_scale_inv", h_csinv.data(), d_csinv.down().data(), csb);
    ok &= same("amax", reinterpret_cast<uint8_t*>(&h_amax), d_amax.down().data(), 4);
    ok &= dbias_ok(xh.data(), xdt, R, C, h_dbias.data(), d_dbias.down().data());
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  char b[160];
  std::snprintf(b, sizeof b, "cuda-graph replay quantize %s %s %lldx%lld%s%s", mname(mode),
                dname(xdt), (long long)R, (long long)C, sr ? " sr" : "", rht ? " rht" : "");
  report(ok, b);
}

int run_checks(bool quick) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  struct Shape {
    int64_t R, C;
  };
  const std::vector<Shape> shapes_full = {{64, 64},   {48, 96},   {128, 256}, {96, 160}, {16, 16},
                                          {32, 32},   {256, 512}, {192, 320}, {7, 13},   {33, 50},
                                          {1, 1},     {100, 48},  {0, 64},    {64, 0},   {1024, 64},
                                          {32, 2048}, {130, 300}, {257, 129}, {272, 400}};
  const std::vector<Shape> shapes_quick = {{64, 64}, {48, 96}, {7, 13}, {32, 32}, {96, 160}};
  const auto& shapes = quick ? shapes_quick : shapes_full;
  const std::vector<DType> xdts = quick
                                      ? std::vector<DType>{DType::kBF16, DType::kF32}
                                      : std::vector<DType>{DType::kF32, DType::kBF16, DType::kF16};
  struct Layout {
    bool row, col;
  };
  const Layout layouts[3] = {{true, false}, {false, true}, {true, true}};
  uint64_t seed = 1;
  int counter = 0;

  // --- quantize (+ dequantize of each copy) ---
  for (DType xdt : xdts)
    for (const Shape& sh : shapes)
      for (ScalingMode mode :
           {ScalingMode::kNoScaling, ScalingMode::kDelayedTensor, ScalingMode::kCurrentTensor,
            ScalingMode::kMxfp8_1d, ScalingMode::kNvfp4_1d, ScalingMode::kNvfp4_2d,
            ScalingMode::kBlock1d, ScalingMode::kBlock2d}) {
        std::vector<DType> qdts;
        if (mode == ScalingMode::kNoScaling)
          qdts = {xdt};
        else if (is_nvfp4(mode))
          qdts = {DType::kE2M1};
        else
          qdts = {DType::kE4M3, DType::kE5M2};
        for (DType qdt : qdts)
          for (const Layout& lay : layouts)
            for (int sr = 0; sr < (is_nvfp4(mode) ? 2 : 1); ++sr)
              for (int rht = 0; rht < (mode == ScalingMode::kNvfp4_1d ? 2 : 1); ++rht)
                for (int variant = 0; variant < 3; ++variant) {
                  // variant 0: specials; 1: dbias with NaN/subnormals; 2: clean data
                  if (quick && (counter++ % 5) != 0) continue;
                  QCase q{xdt,
                          sh.R,
                          sh.C,
                          mode,
                          qdt,
                          lay.row,
                          lay.col,
                          sr == 1,
                          rht == 1,
                          variant == 1,
                          variant == 0 ? 1 : (variant == 1 ? 2 : 0),
                          0};
                  run_quantize_case(q, seed++, st, true);
                }
      }
  // Misaligned x (generic kernels on shapes the fast kernel would take).
  for (ScalingMode mode : {ScalingMode::kDelayedTensor, ScalingMode::kCurrentTensor,
                           ScalingMode::kMxfp8_1d, ScalingMode::kNvfp4_1d, ScalingMode::kNvfp4_2d,
                           ScalingMode::kBlock1d, ScalingMode::kBlock2d})
    for (int sr = 0; sr < 2; ++sr) {
      if (sr && !is_nvfp4(mode)) continue;
      QCase q{DType::kBF16,
              64,
              96,
              mode,
              is_nvfp4(mode) ? DType::kE2M1 : DType::kE4M3,
              true,
              true,
              sr == 1,
              mode == ScalingMode::kNvfp4_1d,
              true,
              2,
              1};
      run_quantize_case(q, seed++, st, false);
    }
  // x in separate column blocks (the PARTS cast: dq, dk, dv of a fused QKV projection).
  // Block modes too (block_cast.cuh's PartsBlockLoad): 64-column parts put 1x128 blocks and
  // 128x128 tiles across two parts; 192 rows make a partial 128-row tile.
  for (ScalingMode mode : {ScalingMode::kDelayedTensor, ScalingMode::kCurrentTensor,
                           ScalingMode::kBlock1d, ScalingMode::kBlock2d})
    for (DType xdt : {DType::kBF16, DType::kF32})
      for (int parts : {2, 3})
        for (const Layout& lay : layouts)
          for (int dbias = 0; dbias < 2; ++dbias) {
            if (quick && (counter++ % 3) != 0) continue;
            QCase q{xdt,   64,         64 * parts,    mode, DType::kE5M2, lay.row, lay.col, false,
                    false, dbias == 1, dbias ? 2 : 1, 0,    parts};
            run_quantize_case(q, seed++, st, false);
            q.R = 32;
            q.C = 128 * parts;
            run_quantize_case(q, seed++, st, false);
            if (mode == ScalingMode::kBlock1d || mode == ScalingMode::kBlock2d) {
              q.R = 192;
              q.C = 192 * parts;
              run_quantize_case(q, seed++, st, false);
            }
          }
  std::printf("%s quantize/dequantize: %d cases, %d failures\n", g_failures ? "FAIL" : "PASS",
              g_cases, g_failures);

  // --- grouped quantize ---
  const int f0 = g_failures, c0 = g_cases;
  struct GShape {
    int64_t M, K;
  };
  const std::vector<GShape> gshapes =
      quick ? std::vector<GShape>{{128, 64}, {48, 96}, {7, 13}}
            : std::vector<GShape>{{128, 64}, {96, 96},   {48, 96}, {256, 320},
                                  {7, 13},   {2048, 64}, {64, 33}, {512, 256}};
  for (DType xdt : xdts)
    for (const GShape& sh : gshapes) {
      const int M = int(sh.M);
      std::vector<std::vector<int32_t>> size_sets = {
          {M / 2, M - M / 2},         // exact split
          {M / 4, 0, -3, M / 4 + 5},  // empty, negative, sum < M (rows left over)
          {M / 2, M, 7},              // sum > M (clamped)
          {M},                        // one group
          {0, 0, M / 3},              // leading empty groups
      };
      if (!quick) {
        std::vector<int32_t> many(1500);  // > 1024 groups: the scan walks in chunks
        Rng r(M);
        for (auto& s : many) s = int32_t(r.next() % 3) - (r.next() % 7 == 0 ? 1 : 0);
        size_sets.push_back(many);
      }
      for (ScalingMode mode : {ScalingMode::kDelayedTensor, ScalingMode::kCurrentTensor,
                               ScalingMode::kMxfp8_1d, ScalingMode::kBlock1d})
        for (DType qdt : {DType::kE4M3, DType::kE5M2})
          for (const Layout& lay : layouts) {
            if (mode == ScalingMode::kMxfp8_1d && lay.col) continue;  // rowwise only
            for (size_t k = 0; k < size_sets.size(); ++k) {
              if (quick && (counter++ % 3) != 0) continue;
              GCase q{xdt, sh.M, sh.K, mode, qdt, lay.row, lay.col, size_sets[k], int(k % 2)};
              run_grouped_case(q, seed++, st);
            }
          }
    }
  std::printf("%s grouped quantize: %d cases, %d failures\n", g_failures > f0 ? "FAIL" : "PASS",
              g_cases - c0, g_failures - f0);

  // --- grouped tile cast: 128-row tiles in one group (kGroupTiles), across group ends
  //     (kGroupRows), in no group (zeros) ---
  const int ft = g_failures, ct = g_cases;
  {
    const int M = 1024;
    std::vector<std::vector<int32_t>> size_sets = {
        {128, 256, 640},                  // every group end on a tile edge: no per-row tile
        {100, 28, 300, 5, 0, 591},        // ends inside tiles, an empty group, a group of 5 rows
        {200, 300},                       // rows past the last group: tiles 4..7 in no group
        {0, 0},                           // every row in no group
        ragged_sizes(M, 64, 1, 7),        // 64 ragged groups (the MoE tokens)
        ragged_sizes(M, 64, 16, 8),       // 64 ragged groups of multiples of 16 rows
        ragged_sizes(M - 37, 200, 1, 9),  // many groups per tile, 37 rows in no group
    };
    for (DType xdt : xdts)
      for (ScalingMode mode :
           {ScalingMode::kDelayedTensor, ScalingMode::kCurrentTensor, ScalingMode::kMxfp8_1d})
        for (DType qdt : {DType::kE4M3, DType::kE5M2})
          for (const Layout& lay : layouts) {
            if (mode == ScalingMode::kMxfp8_1d && lay.col) continue;  // rowwise only
            for (size_t k = 0; k < size_sets.size(); ++k)
              for (int v = 0; v < 3; ++v) {  // clean; specials everywhere; one Inf in one group
                if (quick && (counter++ % 4) != 0) continue;
                GCase q{xdt, M, 128, mode, qdt, lay.row, lay.col, size_sets[k], v == 1 ? 1 : 0};
                if (v == 2) q.inf_row = 310;  // group 2 of set 1, a one-group tile of set 0
                run_grouped_case(q, seed++, st);
              }
          }
  }
  std::printf("%s grouped tile cast: %d cases, %d failures\n", g_failures > ft ? "FAIL" : "PASS",
              g_cases - ct, g_failures - ft);

  // --- CUDA graph capture ---
  const int f1 = g_failures, c1 = g_cases;
  run_graph_case(DType::kBF16, 256, 512, ScalingMode::kCurrentTensor, DType::kE4M3, false, false);
  run_graph_case(DType::kBF16, 256, 512, ScalingMode::kMxfp8_1d, DType::kE4M3, false, false);
  run_graph_case(DType::kBF16, 256, 512, ScalingMode::kNvfp4_1d, DType::kE2M1, true, true);
  run_graph_case(DType::kF32, 96, 160, ScalingMode::kNvfp4_2d, DType::kE2M1, true, false);
  // FP8 block scaling: the fast kernel (bf16: 32 KB of shared memory; f32: 64 KB, with
  // cudaFuncSetAttribute inside the capture) and the generic one (66 KB, same).
  run_graph_case(DType::kBF16, 256, 512, ScalingMode::kBlock1d, DType::kE4M3, false, false);
  run_graph_case(DType::kF32, 256, 384, ScalingMode::kBlock1d, DType::kE4M3, false, false);
  run_graph_case(DType::kF32, 130, 300, ScalingMode::kBlock2d, DType::kE5M2, false, false);
  std::printf("%s cuda graph capture: %d cases, %d failures\n", g_failures > f1 ? "FAIL" : "PASS",
              g_cases - c1, g_failures - f1);

  CK(cudaStreamDestroy(st));
  std::printf("%s: %d cases, %d failures\n", g_failures ? "FAIL" : "PASS", g_cases, g_failures);
  return g_failures ? 1 : 0;
}

// ---- cvtcheck: hardware FP8 conversion vs encode_rne over every float32 bit pattern ----
__global__ void cvt_check_kernel(unsigned long long* bad, uint32_t* first) {
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float v = __uint_as_float(uint32_t(i));
    const float w = __uint_as_float(uint32_t(i) ^ 0x80000000u);
    const uint32_t h4 = __nv_cvt_float2_to_fp8x2(make_float2(v, w), __NV_SATFINITE, __NV_E4M3);
    const uint32_t h5 = __nv_cvt_float2_to_fp8x2(make_float2(v, w), __NV_SATFINITE, __NV_E5M2);
    const uint32_t s4 = encode_rne(v, kE4M3) | (encode_rne(w, kE4M3) << 8);
    const uint32_t s5 = encode_rne(v, kE5M2) | (encode_rne(w, kE5M2) << 8);
    const uint32_t k4 = cuda::enc_fp8x2<cuda::kFmtE4M3>(v, w),
                   k5 = cuda::enc_fp8x2<cuda::kFmtE5M2>(v, w);
    if (h4 != s4 || k4 != s4) {
      if (atomicAdd(&bad[0], 1ull) == 0) first[0] = uint32_t(i), first[1] = h4, first[2] = s4;
    }
    if (h5 != s5 || k5 != s5) {
      if (atomicAdd(&bad[1], 1ull) == 0) first[3] = uint32_t(i), first[4] = h5, first[5] = s5;
    }
  }
}

// The fast E2M1 encoder and the per-block MX factor against the formats.h reference.
__global__ void fast_check_kernel(unsigned long long* bad, uint32_t* first) {
  const uint8_t bs[7] = {0, 1, 100, 127, 200, 253, 254};
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float v = __uint_as_float(uint32_t(i));
    const uint32_t f = cuda::e2m1_rn(v), s = encode_rne(v, kE2M1);
    if (f != s && atomicAdd(&bad[0], 1ull) == 0) first[0] = uint32_t(i), first[1] = f, first[2] = s;
    for (int k = 0; k < 7; ++k) {
      const float a = cuda::mx_apply(v, bs[k], cuda::mx_factor(bs[k])),
                  r = apply_e8m0_encode(v, bs[k]);
      if (__float_as_uint(a) != __float_as_uint(r) && !(isnan(a) && isnan(r)) &&
          atomicAdd(&bad[1], 1ull) == 0)
        first[3] = uint32_t(i), first[4] = __float_as_uint(a), first[5] = bs[k];
    }
  }
}

int run_cvtcheck() {
  Dev bad(16, 0), first(24, 0), bad2(16, 0), first2(24, 0);
  cvt_check_kernel<<<4096, 256>>>(static_cast<unsigned long long*>(bad.p),
                                  static_cast<uint32_t*>(first.p));
  CK(cudaGetLastError());
  fast_check_kernel<<<4096, 256>>>(static_cast<unsigned long long*>(bad2.p),
                                   static_cast<uint32_t*>(first2.p));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  {
    std::vector<uint8_t> b = bad2.down(), f = first2.down();
    unsigned long long nb[2];
    uint32_t fi[6];
    std::memcpy(nb, b.data(), 16);
    std::memcpy(fi, f.data(), 24);
    std::printf(
        "%s fast e2m1 encoder vs encode_rne: %llu mismatches of 2^32 (first x=0x%08x fast=%u "
        "ref=%u)\n",
        nb[0] ? "FAIL" : "PASS", nb[0], fi[0], fi[1], fi[2]);
    std::printf(
        "%s mx factor vs apply_e8m0_encode: %llu mismatches of 7*2^32 (first x=0x%08x got=0x%08x "
        "b=%u)\n",
        nb[1] ? "FAIL" : "PASS", nb[1], fi[3], fi[4], fi[5]);
    if (nb[0] || nb[1]) ++g_failures;
  }
  std::vector<uint8_t> b = bad.down(), f = first.down();
  unsigned long long nb[2];
  uint32_t fi[6];
  std::memcpy(nb, b.data(), 16);
  std::memcpy(fi, f.data(), 24);
  std::printf("%s cvtcheck e4m3: %llu mismatches of 2^32 (first x=0x%08x hw=0x%04x sw=0x%04x)\n",
              nb[0] ? "FAIL" : "PASS", nb[0], fi[0], fi[1], fi[2]);
  std::printf("%s cvtcheck e5m2: %llu mismatches of 2^32 (first x=0x%08x hw=0x%04x sw=0x%04x)\n",
              nb[1] ? "FAIL" : "PASS", nb[1], fi[3], fi[4], fi[5]);
  std::printf("kernels built with LOWBIT_HW_FP8=%d\n", LOWBIT_HW_FP8);
  return (nb[0] || nb[1] || g_failures) ? 1 : 0;
}

// ---- bench ----
__global__ void fill_bf16_kernel(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = fmix32(uint32_t(i) * 0x9E3779B1u ^ seed);
    const float v = (float(h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 8.0f;  // [-4, 4)
    x[i] = uint16_t(__float_as_uint(v) >> 16);
  }
}

template <typename F>
float time_ms(F&& f, cudaStream_t st, int iters = 20) {
  for (int i = 0; i < 3; ++i) f();
  CK(cudaStreamSynchronize(st));
  std::vector<float> t;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, st));
    f();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int run_bench(const std::string& filter) {
  const int64_t R = 8192, C = 16384, n = R * C;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  Dev x{size_t(n) * 2}, y{size_t(n) * 2}, q{size_t(n)}, qc{size_t(n)}, s{size_t(n) / 16},
      sc{size_t(n) / 16}, amax(4), gsi(8), scale(4), dbias(size_t(C) * 2);
  fill_bf16_kernel<<<4096, 256, 0, st>>>(static_cast<uint16_t*>(x.p), n, 1234u);
  const float one = 1.0f;
  scale.up(&one, 4);
  CK(cudaStreamSynchronize(st));

  const double in_bytes = double(n) * 2;
  const float t_copy = time_ms(
      [&] { CK(cudaMemcpyAsync(y.p, x.p, size_t(in_bytes), cudaMemcpyDeviceToDevice, st)); }, st);
  const double bw_copy = 2.0 * in_bytes / (t_copy * 1e-3) / 1e9;
  std::printf("bench D2D copy of %.0f MB: %.1f us, %.0f GB/s (read+write)\n", in_bytes / 1e6,
              t_copy * 1e3, bw_copy);

  auto run = [&](const char* name, ScalingMode mode, DType qdt, bool rht, bool with_dbias,
                 double bytes_per_elem, double extra_read) {
    if (!filter.empty() && std::string(name).find(filter) == std::string::npos) return;
    QuantizeParams p;
    p.x = x.p;
    p.x_dtype = DType::kBF16;
    p.rows = R;
    p.cols = C;
    p.mode = mode;
    p.q_dtype = qdt;
    p.rowwise = p.colwise = true;
    p.scale = static_cast<const float*>(scale.p);
    p.rht = rht;
    p.data = q.p;
    p.colwise_data = qc.p;
    p.scale_inv = s.p;
    p.colwise_scale_inv = sc.p;
    p.amax = static_cast<float*>(amax.p);
    p.global_scale_inv = static_cast<float*>(gsi.p);
    p.dbias = with_dbias ? dbias.p : nullptr;
    Dev ws(quantize_workspace_bytes(p));
    p.workspace = ws.p;
    Status stt = quantize_cuda(p, st);
    if (!stt.ok()) {
      std::printf("FAIL bench %s: %s\n", name, stt.message.c_str());
      ++g_failures;
      return;
    }
    const float t = time_ms([&] { quantize_cuda(p, st); }, st);
    const double b = double(n) * bytes_per_elem;
    const double bw = b / (t * 1e-3) / 1e9;
    std::printf("bench %-44s %8.1f us  %6.0f GB/s  %5.1f%% of D2D", name, t * 1e3, bw,
                100.0 * bw / bw_copy);
    if (extra_read > 0) {
      const double bw2 = (b + double(n) * extra_read) / (t * 1e-3) / 1e9;
      std::printf("  (%.0f GB/s, %.1f%% counting the amax read)", bw2, 100.0 * bw2 / bw_copy);
    }
    std::printf("\n");
  };
  // bytes per element: bf16 read (2) + rowwise (1) + colwise (1) [+ scales]
  run("delayed bf16->e4m3 row+col", ScalingMode::kDelayedTensor, DType::kE4M3, false, false, 4.0,
      0);
  run("current bf16->e4m3 row+col (amax pass + cast)", ScalingMode::kCurrentTensor, DType::kE4M3,
      false, false, 4.0, 2.0);
  run("mxfp8 bf16->e4m3 row+col", ScalingMode::kMxfp8_1d, DType::kE4M3, false, false,
      4.0 + 2.0 / 32, 0);
  run("delayed bf16->e4m3 row+col + dbias", ScalingMode::kDelayedTensor, DType::kE4M3, false, true,
      4.0, 0);
  // FP8 block scaling: amax(x) folded into the cast; scales 4 B per 128 elements per copy (1D).
  run("block1d bf16->e4m3 row+col", ScalingMode::kBlock1d, DType::kE4M3, false, false,
      4.0 + 8.0 / 128, 0);
  run("block2d bf16->e4m3 row+col", ScalingMode::kBlock2d, DType::kE4M3, false, false,
      4.0 + 8.0 / (128 * 128), 0);
  run("nvfp4_1d bf16 row+col (amax pass + cast)", ScalingMode::kNvfp4_1d, DType::kE2M1, false,
      false, 3.0 + 2.0 / 16, 2.0);
  run("nvfp4_1d bf16 row+col rht (rht-amax + cast)", ScalingMode::kNvfp4_1d, DType::kE2M1, true,
      false, 3.0 + 2.0 / 16, 2.0);
  run("nvfp4_2d bf16 row+col (amax pass + cast)", ScalingMode::kNvfp4_2d, DType::kE2M1, false,
      false, 3.0 + 2.0 / 16, 2.0);
  if (filter.empty()) {
    const float t = time_ms(
        [&] {
          cuda::amax_kernel<1><<<cuda::grid_for(n / 8 + 1, 256, 2048), 256, 0, st>>>(
              x.p, n, true, static_cast<float*>(amax.p));
        },
        st);
    const double bw = in_bytes / (t * 1e-3) / 1e9;
    std::printf("bench %-44s %8.1f us  %6.0f GB/s  %5.1f%% of D2D\n", "amax pass alone (bf16 read)",
                t * 1e3, bw, 100.0 * bw / bw_copy);
  }
  if (filter.empty()) {
    DequantizeParams p;
    p.data = q.p;
    p.q_dtype = DType::kE4M3;
    p.rows = R;
    p.cols = C;
    p.mode = ScalingMode::kDelayedTensor;
    p.scale_inv = s.p;
    p.out = y.p;
    p.out_dtype = DType::kBF16;
    const float t = time_ms([&] { dequantize_cuda(p, st); }, st);
    const double bw = 3.0 * double(n) / (t * 1e-3) / 1e9;
    std::printf("bench %-44s %8.1f us  %6.0f GB/s  %5.1f%% of D2D\n", "dequantize e4m3->bf16",
                t * 1e3, bw, 100.0 * bw / bw_copy);
  }
  CK(cudaGetLastError());
  CK(cudaStreamDestroy(st));
  return g_failures ? 1 : 0;
}

// ---- bench grouped: the grouped per-tensor cast (issue 27) ----
// Counts mismatching bytes of two device buffers.
__global__ void count_diff_kernel(const uint8_t* a, const uint8_t* b, int64_t n,
                                  unsigned long long* bad) {
  unsigned long long c = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(bad, c);
}

unsigned long long count_diff(const Dev& a, const Dev& b, size_t n, cudaStream_t st) {
  Dev bad(8, 0);
  count_diff_kernel<<<4096, 256, 0, st>>>(static_cast<const uint8_t*>(a.p),
                                          static_cast<const uint8_t*>(b.p), int64_t(n),
                                          static_cast<unsigned long long*>(bad.p));
  unsigned long long h = 0;
  CK(cudaMemcpyAsync(&h, bad.p, 8, cudaMemcpyDeviceToHost, st));
  CK(cudaStreamSynchronize(st));
  return h;
}

// One grouped case: bf16 (R, C) -> FP8 rowwise + colwise, delayed scaling with the fused
// per-group amax (what the MoE layer's _quantize runs). Times the whole grouped_quantize_cuda
// call, its two cast kernels alone (tile metadata built here on the host), the per-row kernel
// over every tile (the kernel as it was before issue 27: per-row scales, 2 blocks per SM), the
// non-grouped quantize of the same (R, C), current scaling (amax pass + cast) and a D2D copy;
// checks that the call, the cast kernels and the per-row kernel write the same bytes.
void bench_grouped_case(const char* name, int64_t R, int64_t C, const std::vector<int32_t>& sizes,
                        DType qdt, cudaStream_t st) {
  const int64_t n = R * C, G = int64_t(sizes.size()), TR = (R + cuda::kTileR - 1) / cuda::kTileR;
  Dev x{size_t(n) * 2}, y{size_t(n) * 2}, q{size_t(n)}, qc{size_t(n)}, q2{size_t(n)},
      qc2{size_t(n)}, dsz{size_t(G) * 4}, dscale{size_t(G) * 4}, amax{size_t(G) * 4},
      si{size_t(G) * 4}, sic{size_t(G) * 4}, rg{size_t(R) * 4}, ti{size_t(TR) * 8},
      rl{size_t(TR) * 4}, cnt{4}, all{size_t(TR) * 4}, cnt_all{4};
  fill_bf16_kernel<<<4096, 256, 0, st>>>(static_cast<uint16_t*>(x.p), n, 77u);
  dsz.up(sizes.data(), size_t(G) * 4);
  std::vector<float> scale(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) scale[size_t(g)] = std::ldexp(1.0f, int(g % 5) - 2);
  dscale.up(scale.data(), size_t(G) * 4);

  // Host copy of the tile metadata (grouped_quantize.cu builds it on the device).
  std::vector<int32_t> row_group(size_t(R), -1), list, every(static_cast<size_t>(TR));
  int64_t r = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < std::max(sizes[size_t(g)], 0) && r < R; ++k)
      row_group[size_t(r++)] = int32_t(g);
  std::vector<int2> info(static_cast<size_t>(TR));
  for (int64_t t = 0; t < TR; ++t) {
    const int32_t g0 = row_group[size_t(t * cuda::kTileR)],
                  g1 = row_group[size_t(std::min(t * cuda::kTileR + cuda::kTileR, R) - 1)];
    int bits = 0;
    if (g0 >= 0) std::memcpy(&bits, &scale[size_t(g0)], 4);
    info[size_t(t)] = make_int2(g0 != g1  ? cuda::kTileRowScales
                                : g0 >= 0 ? g0
                                          : cuda::kTileNoGroup,
                                g0 == g1 && g0 >= 0 ? bits : 0);
    if (g0 != g1) list.push_back(int32_t(t));
    every[size_t(t)] = int32_t(t);
  }
  const int32_t nl = int32_t(list.size()), nall = int32_t(TR);
  rg.up(row_group.data(), size_t(R) * 4);
  ti.up(info.data(), size_t(TR) * 8);
  if (nl) rl.up(list.data(), size_t(nl) * 4);
  cnt.up(&nl, 4);
  all.up(every.data(), size_t(TR) * 4);
  cnt_all.up(&nall, 4);
  CK(cudaStreamSynchronize(st));

  const double copy_ms = time_ms(
      [&] { CK(cudaMemcpyAsync(y.p, x.p, size_t(n) * 2, cudaMemcpyDeviceToDevice, st)); }, st);
  const double bw_copy = 4.0 * double(n) / (copy_ms * 1e-3) / 1e9;
  std::printf("bench grouped %s: %lldx%lld, %lld groups (%d of %lld tile rows per-row), -> %s\n",
              name, (long long)R, (long long)C, (long long)G, nl, (long long)TR, dname(qdt));
  std::printf("bench grouped   %-48s %8.1f us  %6.0f GB/s (read+write)\n", "D2D copy of x",
              copy_ms * 1e3, bw_copy);
  auto line = [&](const char* what, float ms, double extra_read) {
    const double bw = 4.0 * double(n) / (ms * 1e-3) / 1e9;
    std::printf("bench grouped   %-48s %8.1f us  %6.0f GB/s  %5.1f%% of D2D", what, ms * 1e3, bw,
                100.0 * bw / bw_copy);
    if (extra_read > 0)
      std::printf("  (%.1f%% counting the amax read)",
                  100.0 * (4.0 + extra_read) * double(n) / (ms * 1e-3) / 1e9 / bw_copy);
    std::printf("\n");
  };

  GroupedQuantizeParams p;
  p.x = x.p;
  p.x_dtype = DType::kBF16;
  p.rows = R;
  p.cols = C;
  p.group_sizes = static_cast<const int32_t*>(dsz.p);
  p.num_groups = G;
  p.mode = ScalingMode::kDelayedTensor;
  p.q_dtype = qdt;
  p.rowwise = p.colwise = true;
  p.scale = static_cast<const float*>(dscale.p);
  p.data = q.p;
  p.scale_inv = si.p;
  p.colwise_data = qc.p;
  p.colwise_scale_inv = sic.p;
  p.amax = static_cast<float*>(amax.p);
  Dev ws{grouped_quantize_workspace_bytes(p)};
  p.workspace = ws.p;
  if (Status s = grouped_quantize_cuda(p, st); !s.ok()) {
    std::printf("FAIL bench grouped %s: %s\n", name, s.message.c_str());
    ++g_failures;
    return;
  }
  line("grouped_quantize_cuda (delayed, fused amax)",
       time_ms([&] { grouped_quantize_cuda(p, st); }, st), 0);

  cuda::CastArgs a;
  a.x = x.p;
  a.R = R;
  a.C = C;
  a.rowwise = a.colwise = true;
  a.q_row = static_cast<uint8_t*>(q2.p);
  a.q_col = static_cast<uint8_t*>(qc2.p);
  a.delayed = static_cast<const float*>(dscale.p);
  a.amax_in = static_cast<const float*>(amax.p);
  a.amax_out = static_cast<float*>(amax.p);
  a.row_group = static_cast<const int32_t*>(rg.p);
  a.tile_info = static_cast<const int2*>(ti.p);
  a.rows_list = static_cast<const int32_t*>(rl.p);
  a.rows_count = static_cast<const int32_t*>(cnt.p);
  int64_t tiles = 0;
  cuda::set_tiles(a, &tiles);
  const bool e5 = qdt == DType::kE5M2;
  auto tiles_kernel =
      e5 ? cuda::cast_tile_kernel<1, cuda::kTensor, cuda::kFmtE5M2, cuda::kGroupTiles>
         : cuda::cast_tile_kernel<1, cuda::kTensor, cuda::kFmtE4M3, cuda::kGroupTiles>;
  auto rows_kernel =
      e5 ? cuda::cast_tile_kernel<1, cuda::kTensor, cuda::kFmtE5M2, cuda::kGroupRows>
         : cuda::cast_tile_kernel<1, cuda::kTensor, cuda::kFmtE4M3, cuda::kGroupRows>;
  const unsigned rows_grid = unsigned(std::min<int64_t>(G, TR) * a.tiles_c);
  auto casts = [&] {
    tiles_kernel<<<unsigned(tiles), cuda::kTileThreads, 0, st>>>(a, cuda::PlainLoad{});
    if (rows_grid) rows_kernel<<<rows_grid, cuda::kTileThreads, 0, st>>>(a, cuda::PlainLoad{});
  };
  casts();
  CK(cudaStreamSynchronize(st));
  const unsigned long long d1 =
      count_diff(q, q2, size_t(n), st) + count_diff(qc, qc2, size_t(n), st);
  line("cast kernels alone (one-group tiles + per-row)", time_ms(casts, st), 0);
  cuda::CastArgs b = a;
  b.rows_list = static_cast<const int32_t*>(all.p);
  b.rows_count = static_cast<const int32_t*>(cnt_all.p);
  auto old = [&] {
    rows_kernel<<<unsigned(tiles), cuda::kTileThreads, 0, st>>>(b, cuda::PlainLoad{});
  };
  CK(cudaMemsetAsync(q2.p, 0x5A, size_t(n), st));
  CK(cudaMemsetAsync(qc2.p, 0x5A, size_t(n), st));
  old();
  CK(cudaStreamSynchronize(st));
  const unsigned long long d2 =
      count_diff(q, q2, size_t(n), st) + count_diff(qc, qc2, size_t(n), st);
  line("per-row kernel on every tile (before issue 27)", time_ms(old, st), 0);

  QuantizeParams u;
  u.x = x.p;
  u.x_dtype = DType::kBF16;
  u.rows = R;
  u.cols = C;
  u.mode = ScalingMode::kDelayedTensor;
  u.q_dtype = qdt;
  u.rowwise = u.colwise = true;
  u.scale = static_cast<const float*>(dscale.p);
  u.data = q2.p;
  u.colwise_data = qc2.p;
  u.scale_inv = si.p;
  u.colwise_scale_inv = sic.p;
  u.amax = static_cast<float*>(amax.p);
  Dev uws{quantize_workspace_bytes(u)};
  u.workspace = uws.p;
  line("non-grouped quantize_cuda (delayed, fused amax)",
       time_ms([&] { quantize_cuda(u, st); }, st), 0);
  GroupedQuantizeParams c = p;
  c.mode = ScalingMode::kCurrentTensor;
  line("grouped_quantize_cuda (current: amax pass + cast)",
       time_ms([&] { grouped_quantize_cuda(c, st); }, st), 2.0);
  CK(cudaGetLastError());
  const bool ok = d1 == 0 && d2 == 0;
  std::printf(
      "%s bench grouped %s: call vs cast kernels %llu bytes differ, vs per-row kernel %llu\n",
      ok ? "PASS" : "FAIL", name, d1, d2);
  if (!ok) ++g_failures;
}

int run_bench_grouped() {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const std::vector<int32_t> ragged = ragged_sizes(98304, 64, 1, 27),
                             ragged16 = ragged_sizes(98304, 64, 16, 28), equal(64, 4096),
                             eight = ragged_sizes(32768, 8, 1, 29);
  bench_grouped_case("(a) tokens, 64 ragged groups", 98304, 4096, ragged, DType::kE4M3, st);
  bench_grouped_case("(a) tokens, 64 ragged groups, 16-row multiples", 98304, 4096, ragged16,
                     DType::kE4M3, st);
  bench_grouped_case("(b) weights wi, 64 experts of 4096 rows", 262144, 3072, equal, DType::kE4M3,
                     st);
  bench_grouped_case("(c) tokens, 8 ragged groups", 32768, 4096, eight, DType::kE4M3, st);
  bench_grouped_case("(a) gradients, 64 ragged groups, E5M2", 98304, 4096, ragged, DType::kE5M2,
                     st);
  CK(cudaStreamDestroy(st));
  return g_failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string mode = "check", filter;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "-v" || a == "--verbose")
      g_verbose = true;
    else if (mode == "bench")
      filter = a;
    else
      mode = a;
  }
  if (mode == "bench" && filter == "grouped") return run_bench_grouped();
  if (mode == "bench") return run_bench(filter);
  if (mode == "cvtcheck") return run_cvtcheck();
  if (mode == "check") return run_checks(quick);
  std::printf("usage: %s [--quick] [-v] [check | bench [name filter] | cvtcheck]\n", argv[0]);
  return 2;
}
