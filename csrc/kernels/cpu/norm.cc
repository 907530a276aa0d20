// CPU LayerNorm / RMSNorm: the reference backend of lowbit/norm.h. The fused FP8 output is
// produced by running the CPU quantize kernel on the rounded norm output, so it equals
// lowbit.quantize of that output by construction.
#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "lowbit/norm.h"
#include "lowbit/quantize.h"

namespace lowbit {

Status norm_fwd_cpu(const NormFwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, C = p.cols;
  const bool rms = p.type == NormType::kRmsNorm;
  const bool fp8 = is_tensor_scaling(p.mode) || is_fp8_block(p.mode);
  // The rounded output is needed whole before quantizing (current scaling needs its amax).
  std::vector<uint8_t> tmp;
  void* y = p.y;
  if (y == nullptr && fp8) {
    tmp.resize(size_t(R * C) * dtype_bytes(p.x_dtype));
    y = tmp.data();
  }
  std::vector<float> row(static_cast<size_t>(C));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) row[c] = load_value(p.x, p.x_dtype, r * C + c);
    float mean = 0.0f, rs;
    if (!rms) {
      float s = 0.0f;
      for (int64_t c = 0; c < C; ++c) s += row[c];
      mean = s / float(C);
      float v = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        const float d = row[c] - mean;
        v += d * d;
      }
      rs = 1.0f / std::sqrt(v / float(C) + p.epsilon);
      p.mean[r] = mean;
    } else {
      float v = 0.0f;
      for (int64_t c = 0; c < C; ++c) v += row[c] * row[c];
      rs = 1.0f / std::sqrt(v / float(C) + p.epsilon);
    }
    p.rsigma[r] = rs;
    if (y == nullptr) continue;
    for (int64_t c = 0; c < C; ++c) {
      const float g = p.zero_centered_gamma ? p.gamma[c] + 1.0f : p.gamma[c];
      float v = ((row[c] - mean) * rs) * g;
      if (p.beta) v = v + p.beta[c];
      store_value(y, p.x_dtype, r * C + c, v);
    }
  }
  if (!fp8) return Status::Ok();
  if (R == 0 && is_tensor_scaling(p.mode)) {  // amax 0, and the scale current scaling gives it
    *p.amax = 0.0f;
    const float inv = 1.0f / (p.mode == ScalingMode::kDelayedTensor ? *p.scale : 1.0f);
    if (p.scale_inv) *p.scale_inv = inv;
    if (p.colwise_scale_inv) *p.colwise_scale_inv = inv;
    return Status::Ok();
  }
  QuantizeParams q;
  q.x = y;
  q.x_dtype = p.x_dtype;
  q.rows = R;
  q.cols = C;
  q.mode = p.mode;
  q.q_dtype = p.q_dtype;
  q.rowwise = p.data != nullptr;
  q.colwise = p.colwise_data != nullptr;
  q.scale = p.scale;
  q.power_2_scale = p.power_2_scale;
  q.amax_epsilon = p.amax_epsilon;
  q.data = p.data;
  q.colwise_data = p.colwise_data;
  float si_row = 0.0f, si_col = 0.0f;
  q.scale_inv = p.scale_inv ? p.scale_inv : &si_row;
  q.colwise_scale_inv = p.colwise_scale_inv ? p.colwise_scale_inv : &si_col;
  q.amax = p.amax;
  if (is_fp8_block(p.mode)) {  // per-block scales: each copy's own array (null: not wanted)
    q.scale_inv = p.scale_inv;
    q.colwise_scale_inv = p.colwise_scale_inv;
    return quantize_cpu(q);
  }
  auto s = quantize_cpu(q);
  // quantize_cpu writes scale_inv only for the copies it made; keep both outputs defined.
  const float inv = *static_cast<float*>(q.rowwise ? q.scale_inv : q.colwise_scale_inv);
  if (p.scale_inv) *p.scale_inv = inv;
  if (p.colwise_scale_inv) *p.colwise_scale_inv = inv;
  return s;
}

Status norm_bwd_cpu(const NormBwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, C = p.cols;
  const bool rms = p.type == NormType::kRmsNorm;
  const size_t n = static_cast<size_t>(C);
  std::vector<float> dg(n, 0.0f), db(n, 0.0f), xhat(n), dyg(n), dy(n);
  for (int64_t r = 0; r < R; ++r) {
    const float mean = rms ? 0.0f : p.mean[r], rs = p.rsigma[r];
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float g = p.zero_centered_gamma ? p.gamma[c] + 1.0f : p.gamma[c];
      dy[c] = load_value(p.dy, p.x_dtype, r * C + c);
      xhat[c] = (load_value(p.x, p.x_dtype, r * C + c) - mean) * rs;
      dyg[c] = dy[c] * g;
      s1 += dyg[c] * xhat[c];
      s2 += dyg[c];
      dg[c] += dy[c] * xhat[c];
      db[c] += dy[c];
    }
    const float c1 = s1 / float(C), c2 = rms ? 0.0f : s2 / float(C);
    for (int64_t c = 0; c < C; ++c)
      store_value(p.dx, p.x_dtype, r * C + c, rs * (dyg[c] - (xhat[c] * c1 + c2)));
  }
  for (int64_t c = 0; c < C; ++c) {
    p.dgamma[c] = dg[c];
    if (p.dbeta) p.dbeta[c] = db[c];
  }
  return Status::Ok();
}

}  // namespace lowbit
