// CPU fused softmax: the reference backend of lowbit/softmax.h.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "lowbit/softmax.h"

namespace lowbit {

Status softmax_fwd_cpu(const SoftmaxFwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t B = p.dims[0], H = p.dims[1], Sq = p.dims[2], Sk = p.dims[3];
  std::vector<float> v(static_cast<size_t>(Sk));
  std::vector<char> keep(static_cast<size_t>(Sk));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t row = (b * H + h) * Sq + i;
        const uint8_t* m =
            p.type == SoftmaxType::kMasked
                ? p.mask + b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2]
                : nullptr;
        float mx = neg_inf;
        for (int64_t j = 0; j < Sk; ++j) {
          bool k = true;
          if (m) k = m[j * p.mask_strides[3]] == 0;
          if (p.type == SoftmaxType::kCausal) k = j <= i;
          v[j] = load_value(p.x, p.dtype, row * Sk + j) * p.scale;
          k = k && v[j] != neg_inf;  // -inf acts as a mask: exactly 0, also in a NaN row
          keep[j] = k;
          // NaN-propagating max (std::fmax would drop NaN): a kept NaN makes mx NaN, so every
          // kept entry becomes exp(NaN) = NaN (NaN in, NaN out, as jax.nn.softmax). Masked-out
          // NaNs are never read into mx, so they stay harmless (0), as with jax's where=.
          if (k && (std::isnan(v[j]) || v[j] > mx)) mx = v[j];
        }
        // mx == -inf: nothing kept, or every kept entry is -inf (an additive -inf mask): the row
        // is all zeros, like a fully masked row (jax.nn.softmax would give 0/0 = NaN there).
        if (mx == -neg_inf) mx = std::numeric_limits<float>::quiet_NaN();  // inf - inf: NaN row
        float sum = 0.0f;
        if (mx != neg_inf)
          for (int64_t j = 0; j < Sk; ++j) {
            v[j] = keep[j] ? std::exp(v[j] - mx) : 0.0f;
            sum += v[j];
          }
        for (int64_t j = 0; j < Sk; ++j)
          store_value(p.y, p.dtype, row * Sk + j, (mx != neg_inf && keep[j]) ? v[j] / sum : 0.0f);
      }
  return Status::Ok();
}

Status softmax_bwd_cpu(const SoftmaxBwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, C = p.cols;
  for (int64_t r = 0; r < R; ++r) {
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c)
      dot += load_value(p.dy, p.dtype, r * C + c) * load_value(p.y, p.dtype, r * C + c);
    for (int64_t c = 0; c < C; ++c) {
      const float y = load_value(p.y, p.dtype, r * C + c),
                  dy = load_value(p.dy, p.dtype, r * C + c);
      store_value(p.dx, p.dtype, r * C + c, p.scale * (y * (dy - dot)));
    }
  }
  return Status::Ok();
}

}  // namespace lowbit
