// CPU GEMM: out(M, N) = (A(M, K) . B(N, K)^T) * a_scale_inv * b_scale_inv (+ bias).
//
// Operands are decoded to float32 (exactly: FP8 and BF16 values are all float32 values) and the
// dot products accumulate in float32, in a fixed order for a given K, so the result does not
// depend on the thread count. The decode scales multiply the finished sum, as on the GPU.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_common.h"
#include "lowbit/block_scaling.h"
#include "lowbit/formats.h"
#include "lowbit/gemm.h"

namespace lowbit {
namespace {

constexpr int kLanes = 8;    // independent partial sums per dot product (lets the loop vectorize)
constexpr int kRowTile = 4;  // A rows that share each B row load

// Decodes rows [r0, r1) of a (rows, k) operand into dst (row-major float32).
void decode_rows(const void* src, DType t, int64_t k, int64_t r0, int64_t r1, float* dst) {
  const int64_t count = (r1 - r0) * k;
  const int64_t base = r0 * k;
  if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + base;
    for (int64_t i = 0; i < count; ++i) dst[i] = bf16_to_float(s[i]);
    return;
  }
  // FP8: one table of all 256 codes.
  const SmallFloat f = t == DType::kE4M3 ? kE4M3 : kE5M2;
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = decode(uint32_t(c), f);
  const uint8_t* s = static_cast<const uint8_t*>(src) + base;
  for (int64_t i = 0; i < count; ++i) dst[i] = table[s[i]];
}

// acc[r] = sum_k a[r][k] * b[k] for kRowTile rows at once; fixed summation order.
inline void dot_tile(const float* a, int rows, int64_t k, const float* b, float* out) {
  float acc[kRowTile][kLanes] = {};
  const int64_t kv = k - k % kLanes;
  for (int64_t i = 0; i < kv; i += kLanes) {
    for (int r = 0; r < kRowTile; ++r) {
      if (r >= rows) break;
      const float* ar = a + r * k + i;
      for (int j = 0; j < kLanes; ++j) acc[r][j] += ar[j] * b[i + j];
    }
  }
  for (int r = 0; r < rows; ++r) {
    float tail = 0.0f;
    for (int64_t i = kv; i < k; ++i) tail += a[r * k + i] * b[i];
    float s = 0.0f;
    for (int j = 0; j < kLanes; ++j) s += acc[r][j];
    out[r] = s + tail;
  }
}

void run_rows(const GemmParams& p, const float* b, float scale, int64_t r0, int64_t r1) {
  FpuExactGuard guard;
  std::vector<float> a(static_cast<size_t>(kRowTile * p.k));
  float dots[kRowTile];
  for (int64_t m = r0; m < r1; m += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, r1 - m));
    decode_rows(p.a, p.a_dtype, p.k, m, m + rows, a.data());
    for (int64_t n = 0; n < p.n; ++n) {
      dot_tile(a.data(), rows, p.k, b + n * p.k, dots);
      const float bias_n = p.bias ? load_value(p.bias, p.bias_dtype, n) : 0.0f;
      for (int r = 0; r < rows; ++r)
        store_value(p.out, p.out_dtype, (m + r) * p.n + n, dots[r] * scale + bias_n);
    }
  }
}

// FP8 block scaling: per K block, the float32 dot product of the codes' values (kLanes partial
// sums, as dot_tile), times sa * sb (one product), added to a float32 accumulator in block order.
void run_rows_block(const GemmParams& p, const float* b, int64_t r0, int64_t r1) {
  FpuExactGuard guard;
  const ScalingMode ma = gemm_block_mode(p.a_block), mb = gemm_block_mode(p.b_block);
  std::vector<float> a(static_cast<size_t>(p.k));
  for (int64_t m = r0; m < r1; ++m) {
    decode_rows(p.a, p.a_dtype, p.k, m, m + 1, a.data());
    for (int64_t n = 0; n < p.n; ++n) {
      const float* bn = b + n * p.k;
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < p.k; k0 += 128) {
        const int64_t len = std::min<int64_t>(128, p.k - k0);
        float lanes[kLanes] = {};
        const int64_t lv = len - len % kLanes;
        for (int64_t i = 0; i < lv; i += kLanes)
          for (int j = 0; j < kLanes; ++j) lanes[j] += a[k0 + i + j] * bn[k0 + i + j];
        float part = 0.0f;
        for (int j = 0; j < kLanes; ++j) part += lanes[j];
        for (int64_t i = lv; i < len; ++i) part += a[k0 + i] * bn[k0 + i];
        const float sa = p.a_scale_inv[fp8_block_scale_index(ma, p.m, p.k, m, k0)];
        const float sb = p.b_scale_inv[fp8_block_scale_index(mb, p.n, p.k, n, k0)];
        acc += part * (sa * sb);
      }
      const float bias_n = p.bias ? load_value(p.bias, p.bias_dtype, n) : 0.0f;
      store_value(p.out, p.out_dtype, m * p.n + n, acc + bias_n);
    }
  }
}

}  // namespace

Status gemm_cpu(const GemmParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  if (p.m == 0 || p.n == 0) return Status::Ok();
  FpuExactGuard guard;
  std::vector<float> b(static_cast<size_t>(p.n * p.k));
  decode_rows(p.b, p.b_dtype, p.k, 0, p.n, b.data());
  const bool block = p.a_block != 0;
  const float scale = is_fp8(p.a_dtype) && !block ? p.a_scale_inv[0] * p.b_scale_inv[0] : 1.0f;

  // Threads over row blocks only when the work pays for starting them.
  const double flops = double(p.m) * double(p.n) * double(std::max<int64_t>(p.k, 1));
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (block) {
    threads = flops < 4e6 ? 1 : static_cast<int>(std::min<int64_t>(threads, p.m));
    const int64_t per = (p.m + threads - 1) / threads;
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) {
      const int64_t r0 = std::min(p.m, t * per), r1 = std::min(p.m, (t + 1) * per);
      if (r0 < r1) pool.emplace_back(run_rows_block, std::cref(p), b.data(), r0, r1);
    }
    run_rows_block(p, b.data(), 0, std::min(p.m, per));
    for (auto& th : pool) th.join();
    return Status::Ok();
  }
  threads = flops < 4e6 ? 1 : std::min<int64_t>(threads, (p.m + kRowTile - 1) / kRowTile);
  if (threads <= 1) {
    run_rows(p, b.data(), scale, 0, p.m);
    return Status::Ok();
  }
  // Blocks are multiples of kRowTile rows.
  const int64_t tiles = (p.m + kRowTile - 1) / kRowTile;
  const int64_t per = (tiles + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    const int64_t r0 = std::min(p.m, t * per * kRowTile),
                  r1 = std::min(p.m, (t + 1) * per * kRowTile);
    if (r0 < r1) pool.emplace_back(run_rows, std::cref(p), b.data(), scale, r0, r1);
  }
  run_rows(p, b.data(), scale, 0, std::min(p.m, per * kRowTile));
  for (auto& th : pool) th.join();
  return Status::Ok();
}

}  // namespace lowbit
