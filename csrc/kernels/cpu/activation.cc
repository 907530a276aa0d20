// CPU activations: the reference backend of lowbit/activation.h. Fused FP8 outputs (and dbias)
// come from the CPU quantize kernel run on the rounded result, so they equal
// lowbit.quantize / quantize_dbias of it by construction.
#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "lowbit/activation.h"
#include "lowbit/quantize.h"

namespace lowbit {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kQuickGelu = 1.702f;

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Value and derivative; the tanh-form gelu is x * sigmoid(2u) = 0.5 x (1 + tanh u), which does
// not cancel in the tails. Same formulas as the CUDA kernels (lowbit/activation.h).
void act_vg(ActKind k, float x, float* v, float* g) {
  switch (k) {
    case ActKind::kLinear: *v = x, *g = 1.0f; return;
    case ActKind::kGeluTanh: {
      const float t = x * x;
      const float s = sigmoid(x * (t * (2.0f * kSqrt2OverPi * kGeluCubic) + 2.0f * kSqrt2OverPi));
      const float dz = t * (6.0f * kSqrt2OverPi * kGeluCubic) + 2.0f * kSqrt2OverPi;
      *v = x * s;
      *g = ((x * s) * (1.0f - s)) * dz + s;
      return;
    }
    case ActKind::kGeluExact: {
      const float p = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
      *v = x * p;
      *g = (x * kInvSqrt2Pi) * std::exp((-0.5f * x) * x) + p;
      return;
    }
    case ActKind::kRelu: *v = x < 0.0f ? 0.0f : x, *g = x > 0.0f ? 1.0f : 0.0f; return;
    case ActKind::kSilu:
    case ActKind::kQuickGelu: {
      const float kk = k == ActKind::kSilu ? 1.0f : kQuickGelu;
      const float s = sigmoid(kk * x);
      *v = x * s;
      *g = ((kk * x) * s) * (1.0f - s) + s;
      return;
    }
    case ActKind::kSquaredRelu: {
      const float r = x < 0.0f ? 0.0f : x;
      *v = r * r, *g = 2.0f * r;
      return;
    }
  }
  *v = x, *g = 1.0f;
}

float act_value(ActKind k, float x) {
  float v, g;
  act_vg(k, x, &v, &g);
  return v;
}

float act_grad(ActKind k, float x) {
  float v, g;
  act_vg(k, x, &v, &g);
  return g;
}

// Quantizes the rounded result `v` (rows, cols) into the FP8 outputs of the fused op.
Status quantize_result(const void* v, DType dt, int64_t rows, int64_t cols, ScalingMode mode,
                       DType q_dtype, const float* scale, bool pow2, float eps, uint8_t* data,
                       uint8_t* cw, float* si, float* csi, float* amax, void* dbias) {
  const bool block = is_fp8_block(mode);
  if (rows * cols == 0 && !block) {
    *amax = 0.0f;
    const float inv = 1.0f / (mode == ScalingMode::kDelayedTensor ? *scale : 1.0f);
    if (si) *si = inv;
    if (csi) *csi = inv;
    for (int64_t c = 0; dbias && c < cols; ++c) store_value(dbias, dt, c, 0.0f);
    return Status::Ok();
  }
  QuantizeParams q;
  q.x = v;
  q.x_dtype = dt;
  q.rows = rows;
  q.cols = cols;
  q.mode = mode;
  q.q_dtype = q_dtype;
  q.rowwise = data != nullptr;
  q.colwise = cw != nullptr;
  q.scale = scale;
  q.power_2_scale = pow2;
  q.amax_epsilon = eps;
  q.data = data;
  q.colwise_data = cw;
  float tmp_row = 0.0f, tmp_col = 0.0f;
  q.scale_inv = si ? si : &tmp_row;
  q.colwise_scale_inv = csi ? csi : &tmp_col;
  q.amax = amax;
  q.dbias = dbias;
  if (block) {  // per-block scales: each copy's own array (null: not wanted)
    q.scale_inv = si;
    q.colwise_scale_inv = csi;
    return quantize_cpu(q);
  }
  auto s = quantize_cpu(q);
  const float inv =
      q.rowwise ? *static_cast<float*>(q.scale_inv) : *static_cast<float*>(q.colwise_scale_inv);
  if (si) *si = inv;
  if (csi) *csi = inv;
  return s;
}

}  // namespace

Status act_fwd_cpu(const ActFwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, H = p.cols, W = p.gated ? 2 * H : H;
  const bool fp8 = is_tensor_scaling(p.mode) || is_fp8_block(p.mode);
  std::vector<uint8_t> tmp;
  void* y = p.y;
  if (y == nullptr) {
    tmp.resize(size_t(R * H) * dtype_bytes(p.x_dtype));
    y = tmp.data();
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < H; ++c) {
      float v = act_value(p.act, load_value(p.x, p.x_dtype, r * W + c));
      if (p.gated) v = v * load_value(p.x, p.x_dtype, r * W + H + c);
      store_value(y, p.x_dtype, r * H + c, v);
    }
  if (!fp8) return Status::Ok();
  return quantize_result(y, p.x_dtype, R, H, p.mode, p.q_dtype, p.scale, p.power_2_scale,
                         p.amax_epsilon, p.data, p.colwise_data, p.scale_inv, p.colwise_scale_inv,
                         p.amax, nullptr);
}

Status act_bwd_cpu(const ActBwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, H = p.cols, W = p.gated ? 2 * H : H;
  const bool fp8 = is_tensor_scaling(p.mode) || is_fp8_block(p.mode);
  std::vector<uint8_t> tmp;
  void* dx = p.dx;
  if (dx == nullptr) {
    tmp.resize(size_t(R * W) * dtype_bytes(p.x_dtype));
    dx = tmp.data();
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < H; ++c) {
      const float dy = load_value(p.dy, p.x_dtype, r * H + c);
      const float a = load_value(p.x, p.x_dtype, r * W + c);
      if (p.gated) {
        const float b = load_value(p.x, p.x_dtype, r * W + H + c);
        store_value(dx, p.x_dtype, r * W + c, (dy * b) * act_grad(p.act, a));
        store_value(dx, p.x_dtype, r * W + H + c, dy * act_value(p.act, a));
      } else {
        store_value(dx, p.x_dtype, r * W + c, dy * act_grad(p.act, a));
      }
    }
  if (fp8)
    return quantize_result(dx, p.x_dtype, R, W, p.mode, p.q_dtype, p.scale, p.power_2_scale,
                           p.amax_epsilon, p.data, p.colwise_data, p.scale_inv, p.colwise_scale_inv,
                           p.amax, p.dbias);
  if (p.dbias) {  // column sums of the rounded dx, float32, rounded once (as quantize_dbias)
    std::vector<float> sums(size_t(W), 0.0f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < W; ++c) sums[c] += load_value(dx, p.x_dtype, r * W + c);
    for (int64_t c = 0; c < W; ++c) store_value(p.dbias, p.x_dtype, c, sums[c]);
  }
  return Status::Ok();
}

}  // namespace lowbit
