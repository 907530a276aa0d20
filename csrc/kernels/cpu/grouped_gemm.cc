// CPU grouped GEMM (see lowbit/grouped_gemm.h): operands decoded to float32 (exact for BF16 and
// FP8), products summed in float32 in a fixed order, the per-group scale applied to the finished
// sum, one rounding to BF16. Threads split output rows; the result does not depend on their count.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_common.h"
#include "lowbit/formats.h"
#include "lowbit/grouped_gemm.h"

namespace lowbit {
namespace {

// Decoded element access for one operand type.
struct Decoder {
  DType t;
  float table[256];
  explicit Decoder(DType dt) : t(dt) {
    if (t == DType::kE4M3 || t == DType::kE5M2) {
      const SmallFloat f = t == DType::kE4M3 ? kE4M3 : kE5M2;
      for (int c = 0; c < 256; ++c) table[c] = decode(uint32_t(c), f);
    }
  }
  float operator()(const void* p, int64_t i) const {
    if (t == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    return table[static_cast<const uint8_t*>(p)[i]];
  }
};

// Runs fn(lo, hi) over [0, n) on up to hardware_concurrency threads (inline when small).
template <typename F>
void parallel_for(int64_t n, int64_t min_chunk, F fn) {
  int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  threads = std::min<int64_t>(threads, (n + min_chunk - 1) / std::max<int64_t>(min_chunk, 1));
  if (threads <= 1) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = t * chunk, hi = std::min(n, lo + chunk);
    if (lo < hi)
      pool.emplace_back([=] {
        FpuExactGuard guard;
        fn(lo, hi);
      });
  }
  for (auto& th : pool) th.join();
}

// Clamped [start, start + size) of every group over the grouped extent `rows`.
void group_ranges(const GroupedGemmParams& p, int64_t rows, std::vector<int64_t>* start,
                  std::vector<int64_t>* size) {
  start->resize(p.num_groups);
  size->resize(p.num_groups);
  int64_t off = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t s = std::min<int64_t>(std::max<int32_t>(p.group_sizes[g], 0), rows - off);
    (*start)[g] = off;
    (*size)[g] = s;
    off += s;
  }
}

float group_alpha(const GroupedGemmParams& p, int64_t g) {
  if (!grouped_is_fp8(p.a_dtype) || p.block_scaled) return 1.0f;
  return p.a_scale_inv[g] * p.b_scale_inv[g];
}

// Block scaling: the decode scales of A(i, c) and B(c, j) in group g (1 without block scales);
// operands are decoded as value * scale in float32 before the products (dequantize-then-multiply).
struct BlockScales {
  const GroupedGemmParams& p;
  BlockScaleOffsets o;
  BlockScales(const GroupedGemmParams& q, int64_t g, int64_t start, int64_t size)
      : p(q),
        o(grouped_block_scale_offsets(q.mode == GroupedGemmMode::kRaggedM, q.m, q.n, q.k,
                                      q.b_block_n, g, start, size)) {}
  float a(int64_t i, int64_t c) const {
    return p.block_scaled ? p.a_scale_inv[o.a_off + (c / 128) * o.a_ld + i] : 1.0f;
  }
  float b(int64_t c, int64_t j) const {
    return p.block_scaled ? p.b_scale_inv[o.b_off + (c / 128) * o.b_ld + j / p.b_block_n] : 1.0f;
  }
};

// Ragged M: out rows of group g = A rows . B_g (decoded once per group into (k, n) float32).
void ragged_m(const GroupedGemmParams& p) {
  std::vector<int64_t> start, size;
  group_ranges(p, p.m, &start, &size);
  const Decoder da(p.a_dtype), db(p.b_dtype);
  uint16_t* out = static_cast<uint16_t*>(p.out);
  std::vector<float> bg(static_cast<size_t>(p.k * p.n));
  for (int64_t g = 0; g < p.num_groups; ++g) {
    if (size[g] == 0) continue;
    const char* b =
        static_cast<const char*>(p.b) + g * p.b_group_stride * (p.b_dtype == DType::kBF16 ? 2 : 1);
    const BlockScales bs(p, g, start[g], size[g]);
    for (int64_t c = 0; c < p.k; ++c)
      for (int64_t j = 0; j < p.n; ++j)
        bg[c * p.n + j] = db(b, p.b_kmajor ? j * p.ldb + c : c * p.ldb + j) * bs.b(c, j);
    const float alpha = group_alpha(p, g);
    parallel_for(size[g], std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.k * p.n)),
                 [&](int64_t lo, int64_t hi) {
                   std::vector<float> acc(p.n), arow(p.k);
                   for (int64_t r = start[g] + lo; r < start[g] + hi; ++r) {
                     for (int64_t c = 0; c < p.k; ++c)
                       arow[c] = da(p.a, r * p.lda + c) * bs.a(r - start[g], c);
                     std::fill(acc.begin(), acc.end(), 0.0f);
                     for (int64_t c = 0; c < p.k; ++c) {
                       const float av = arow[c];
                       const float* brow = bg.data() + c * p.n;
                       for (int64_t j = 0; j < p.n; ++j) acc[j] += av * brow[j];
                     }
                     for (int64_t j = 0; j < p.n; ++j)
                       out[r * p.n + j] = float_to_bf16(acc[j] * alpha);
                   }
                 });
  }
  // Rows in no group are zero.
  const int64_t covered = start.back() + size.back();
  if (covered < p.m)
    std::memset(out + covered * p.n, 0, static_cast<size_t>((p.m - covered) * p.n) * 2);
}

// Ragged K: out[g] (m, n) = sum over the group's rows c of A(:, c) B(c, :), threads over i.
void ragged_k(const GroupedGemmParams& p) {
  std::vector<int64_t> start, size;
  group_ranges(p, p.k, &start, &size);
  const Decoder da(p.a_dtype), db(p.b_dtype);
  uint16_t* out = static_cast<uint16_t*>(p.out);
  for (int64_t g = 0; g < p.num_groups; ++g) {
    uint16_t* og = out + g * p.m * p.n;
    const int64_t c0 = start[g], c1 = start[g] + size[g];
    // B rows of the group, decoded once: (size, n).
    std::vector<float> bg(static_cast<size_t>(size[g] * p.n));
    const BlockScales bs(p, g, start[g], size[g]);
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t j = 0; j < p.n; ++j)
        bg[(c - c0) * p.n + j] =
            db(p.b, p.b_kmajor ? j * p.ldb + c : c * p.ldb + j) * bs.b(c - c0, j);
    const float alpha = group_alpha(p, g);
    parallel_for(p.m, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, size[g] * p.n + 1)),
                 [&](int64_t lo, int64_t hi) {
                   std::vector<float> acc(p.n);
                   for (int64_t i = lo; i < hi; ++i) {
                     std::fill(acc.begin(), acc.end(), 0.0f);
                     for (int64_t c = c0; c < c1; ++c) {
                       const float av =
                           da(p.a, p.a_kmajor ? i * p.lda + c : c * p.lda + i) * bs.a(i, c - c0);
                       const float* brow = bg.data() + (c - c0) * p.n;
                       for (int64_t j = 0; j < p.n; ++j) acc[j] += av * brow[j];
                     }
                     for (int64_t j = 0; j < p.n; ++j)
                       og[i * p.n + j] = float_to_bf16(acc[j] * alpha);
                   }
                 });
  }
}

}  // namespace

Status grouped_gemm_cpu(const GroupedGemmParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  FpuExactGuard guard;
  if (p.mode == GroupedGemmMode::kRaggedM) {
    ragged_m(p);
  } else {
    ragged_k(p);
  }
  return Status::Ok();
}

}  // namespace lowbit
