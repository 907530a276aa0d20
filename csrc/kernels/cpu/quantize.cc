// CPU quantization kernels: the reference backend of docs/numerics.md. Straightforward loops;
// each copy is built as a float32 matrix first (the colwise one transposed), then encoded.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "lowbit/block_scaling.h"
#include "lowbit/quantize.h"

namespace lowbit {
namespace {

const SmallFloat& fp8_format(DType q) { return q == DType::kE5M2 ? kE5M2 : kE4M3; }
float fp8_max(DType q) { return q == DType::kE5M2 ? kE5M2Max : kE4M3Max; }

float amax_of(const float* v, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_ignore_nan(v[i]));
  return m;
}

// Encodes one copy `v` (rows, cols), row-major float32, into `data`/`scale_inv`.
// `global_scale_inv` (NVFP4) receives this copy's tensor decode scale.
void encode_copy(const std::vector<float>& v, int64_t rows, int64_t cols, const QuantizeParams& p,
                 float tensor_scale, void* data, void* scale_inv, float* global_scale_inv,
                 const uint32_t* seed, uint32_t seed_xor) {
  const int64_t n = rows * cols;
  switch (p.mode) {
    case ScalingMode::kNoScaling: {
      for (int64_t i = 0; i < n; ++i) store_value(data, p.x_dtype, i, v[i]);
      return;
    }
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor: {
      const SmallFloat& f = fp8_format(p.q_dtype);
      auto* q = static_cast<uint8_t*>(data);
      for (int64_t i = 0; i < n; ++i) q[i] = uint8_t(encode_rne(v[i] * tensor_scale, f));
      static_cast<float*>(scale_inv)[0] = 1.0f / tensor_scale;
      return;
    }
    case ScalingMode::kMxfp8_1d: {
      const SmallFloat& f = fp8_format(p.q_dtype);
      const float fmax = fp8_max(p.q_dtype);
      auto* q = static_cast<uint8_t*>(data);
      auto* s = static_cast<uint8_t*>(scale_inv);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < cols / 32; ++b) {
          const float* blk = &v[r * cols + b * 32];
          const uint8_t e = mx_scale_e8m0(amax_of(blk, 32), fmax);
          s[r * (cols / 32) + b] = e;
          for (int j = 0; j < 32; ++j)
            q[r * cols + b * 32 + j] = uint8_t(encode_rne(apply_e8m0_encode(blk[j], e), f));
        }
      return;
    }
    case ScalingMode::kBlock1d:
    case ScalingMode::kBlock2d: {
      // One float32 scale per 1x128 block (1D) or 128x128 tile (2D), in the cuBLASLt layout of
      // fp8_block_scale_index; partial blocks at the ends; padding entries 1.0.
      const SmallFloat& f = fp8_format(p.q_dtype);
      const float fmax = fp8_max(p.q_dtype);
      const bool two_d = p.mode == ScalingMode::kBlock2d;
      auto* q = static_cast<uint8_t*>(data);
      auto* s = static_cast<float*>(scale_inv);
      const int64_t sr = fp8_block_scale_rows(p.mode, rows, cols);
      const int64_t sc = fp8_block_scale_cols(p.mode, rows, cols);
      for (int64_t i = 0; i < sr * sc; ++i) s[i] = 1.0f;
      const int64_t tile_rows = two_d ? 128 : 1;
      for (int64_t r0 = 0; r0 < rows; r0 += tile_rows)
        for (int64_t c0 = 0; c0 < cols; c0 += 128) {
          const int64_t r1 = std::min(rows, r0 + tile_rows), c1 = std::min(cols, c0 + 128);
          float a = 0.0f;
          for (int64_t r = r0; r < r1; ++r) a = std::max(a, amax_of(&v[r * cols + c0], c1 - c0));
          const float scale = fp8_block_scale(a, fmax, p.amax_epsilon, p.power_2_scale);
          s[fp8_block_scale_index(p.mode, rows, cols, r0, c0)] = 1.0f / scale;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c)
              q[r * cols + c] = uint8_t(encode_rne(v[r * cols + c] * scale, f));
        }
      return;
    }
    case ScalingMode::kNvfp4_1d:
    case ScalingMode::kNvfp4_2d: {
      const float S = nvfp4_tensor_scale(amax_of(v.data(), n));
      *global_scale_inv = 1.0f / S;
      const bool two_d = p.mode == ScalingMode::kNvfp4_2d;
      const int64_t nb = cols / 16;
      auto* s = static_cast<uint8_t*>(scale_inv);
      // Block scale codes, one per (row, block); 2-D tiles share theirs over 16 rows.
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          float a = 0.0f;
          if (two_d) {
            if (r % 16 != 0) {
              s[r * nb + b] = s[(r - r % 16) * nb + b];
              continue;
            }
            for (int64_t rr = r; rr < r + 16; ++rr)
              a = std::max(a, amax_of(&v[rr * cols + b * 16], 16));
          } else {
            a = amax_of(&v[r * cols + b * 16], 16);
          }
          s[r * nb + b] = uint8_t(nvfp4_block_scale_code(a, S));
        }
      auto* q = static_cast<uint8_t*>(data);
      std::memset(q, 0, size_t(n / 2));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = r * cols + c;
          const uint32_t sb = s[r * nb + c / 16];
          const float w = nvfp4_scaled_value(v[i], nvfp4_encode_factor(sb, S), sb, S);
          const uint32_t code =
              seed ? encode_e2m1_stochastic(w, sr_bits(uint64_t(i), seed[0] ^ seed_xor, seed[1]))
                   : encode_rne(w, kE2M1);
          q[i / 2] |= uint8_t(code << ((i & 1) * 4));
        }
      return;
    }
  }
}

}  // namespace

Status quantize_cpu(const QuantizeParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, C = p.cols, n = R * C;
  std::vector<float> v(static_cast<size_t>(n));
  if (p.n_parts) {  // the parts' concatenation along the columns
    const int64_t P = p.part_cols;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        v[r * C + c] = load_value(p.x_parts[c / P], p.x_dtype, r * P + c % P);
  } else {
    for (int64_t i = 0; i < n; ++i) v[i] = load_value(p.x, p.x_dtype, i);
  }

  const float amax = amax_of(v.data(), n);
  *p.amax = amax;

  float tensor_scale = 1.0f;
  if (p.mode == ScalingMode::kDelayedTensor) tensor_scale = *p.scale;
  if (p.mode == ScalingMode::kCurrentTensor)
    tensor_scale = scale_from_amax(amax, fp8_max(p.q_dtype));

  if (p.dbias) {
    std::vector<float> sums(size_t(C), 0.0f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) sums[c] += v[r * C + c];
    for (int64_t c = 0; c < C; ++c) store_value(p.dbias, p.x_dtype, c, sums[c]);
  }

  const uint32_t* seed = p.sr_seed;
  if (p.rowwise)
    encode_copy(v, R, C, p, tensor_scale, p.data, p.scale_inv,
                p.global_scale_inv ? &p.global_scale_inv[0] : nullptr, seed, 0u);
  if (p.colwise) {
    std::vector<float> t(static_cast<size_t>(n));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) t[c * R + r] = v[r * C + c];
    if (p.rht)
      for (int64_t i = 0; i < n; i += 16) hadamard16_forward(&t[i], p.rht_sign_mask);
    encode_copy(t, C, R, p, tensor_scale, p.colwise_data, p.colwise_scale_inv,
                p.global_scale_inv ? &p.global_scale_inv[1] : nullptr, seed, kColwiseSeedXor);
  }
  // NVFP4 keeps both tensor scales even when only one copy was asked for (unused entries =
  // rowwise).
  if (is_nvfp4(p.mode) && !p.colwise) p.global_scale_inv[1] = p.global_scale_inv[0];
  if (is_nvfp4(p.mode) && !p.rowwise) {
    // The rowwise tensor scale is that of x itself.
    p.global_scale_inv[0] = 1.0f / nvfp4_tensor_scale(amax);
  }
  return Status::Ok();
}

Status dequantize_cpu(const DequantizeParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t R = p.rows, C = p.cols;
  std::vector<float> out(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = r * C + c;
      float y;
      switch (p.mode) {
        case ScalingMode::kDelayedTensor:
        case ScalingMode::kCurrentTensor:
          y = decode(static_cast<const uint8_t*>(p.data)[i], fp8_format(p.q_dtype)) *
              static_cast<const float*>(p.scale_inv)[0];
          break;
        case ScalingMode::kMxfp8_1d:
          y = decode(static_cast<const uint8_t*>(p.data)[i], fp8_format(p.q_dtype)) *
              decode_e8m0(static_cast<const uint8_t*>(p.scale_inv)[r * (C / 32) + c / 32]);
          break;
        case ScalingMode::kBlock1d:
        case ScalingMode::kBlock2d:
          y = decode(static_cast<const uint8_t*>(p.data)[i], fp8_format(p.q_dtype)) *
              static_cast<const float*>(p.scale_inv)[fp8_block_scale_index(p.mode, R, C, r, c)];
          break;
        default: {  // NVFP4
          const uint8_t byte = static_cast<const uint8_t*>(p.data)[i / 2];
          const uint32_t code = (byte >> ((i & 1) * 4)) & 0xFu;
          const uint8_t sb = static_cast<const uint8_t*>(p.scale_inv)[r * (C / 16) + c / 16];
          y = (decode(code, kE2M1) * decode(sb, kE4M3)) * p.global_scale_inv[0];
        }
      }
      out[i] = y;
    }
  if (p.rht)
    for (int64_t i = 0; i < R * C; i += 16) hadamard16_inverse(&out[i], p.rht_sign_mask);
  for (int64_t i = 0; i < R * C; ++i) store_value(p.out, p.out_dtype, i, out[i]);
  return Status::Ok();
}

namespace {

// Grouped BLOCK_1D (lowbit/block_scaling.h's grouped layouts): rowwise 1x128 blocks along K in
// the per-group M-major scale layout; colwise 1x128 blocks along the rows of each group. Rows in
// no group: zero data and scale_inv 1.0 in both copies.
void grouped_quantize_block1d(const GroupedQuantizeParams& p) {
  const int64_t M = p.rows, K = p.cols, G = p.num_groups, nkb = ceil_div(K, 128);
  const SmallFloat& f = fp8_format(p.q_dtype);
  const float fmax = fp8_max(p.q_dtype);
  auto* q = static_cast<uint8_t*>(p.data);
  auto* s = static_cast<float*>(p.scale_inv);
  auto* qc = static_cast<uint8_t*>(p.colwise_data);
  auto* sc = static_cast<float*>(p.colwise_scale_inv);
  if (p.colwise) {
    std::memset(qc, 0, size_t(M * K));
    for (int64_t i = 0; i < grouped_block_colwise_rows(M, G) * K; ++i) sc[i] = 1.0f;
  }
  auto encode_block = [&](float* v, int64_t n, float* scale_inv_out) {
    float a = amax_of(v, n);
    const float scale = fp8_block_scale(a, fmax, p.amax_epsilon, p.power_2_scale);
    *scale_inv_out = 1.0f / scale;
    for (int64_t j = 0; j < n; ++j) v[j] = float(uint8_t(encode_rne(v[j] * scale, f)));
  };
  if (p.rowwise) {
    // Rows in no group: zero data, scale_inv 1.0 (written below for the groups' rows).
    std::memset(q, 0, size_t(M * K));
    for (int64_t i = 0; i < M * nkb; ++i) s[i] = 1.0f;
  }
  int64_t start = 0;
  std::vector<float> blk(128);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t sz = std::max<int64_t>(0, p.group_sizes[g]);
    const int64_t begin = std::min(start, M), size = std::min(start + sz, M) - begin;
    start = std::min(start + sz, M);
    float amax = 0.0f;
    for (int64_t i = begin * K; i < (begin + size) * K; ++i)
      amax = std::max(amax, abs_ignore_nan(load_value(p.x, p.x_dtype, i)));
    p.amax[g] = amax;
    if (p.rowwise)
      for (int64_t i = 0; i < size; ++i)
        for (int64_t kb = 0; kb < nkb; ++kb) {
          const int64_t r = begin + i, c0 = kb * 128, n = std::min<int64_t>(128, K - c0);
          for (int64_t j = 0; j < n; ++j) blk[j] = load_value(p.x, p.x_dtype, r * K + c0 + j);
          encode_block(blk.data(), n, &s[begin * nkb + kb * size + i]);
          for (int64_t j = 0; j < n; ++j) q[r * K + c0 + j] = uint8_t(blk[j]);
        }
    if (p.colwise)
      for (int64_t jb = 0; jb * 128 < size; ++jb) {
        const int64_t r0 = begin + jb * 128, n = std::min<int64_t>(128, size - jb * 128);
        const int64_t row = grouped_block_colwise_first(begin, g) + jb;
        for (int64_t c = 0; c < K; ++c) {
          for (int64_t j = 0; j < n; ++j) blk[j] = load_value(p.x, p.x_dtype, (r0 + j) * K + c);
          encode_block(blk.data(), n, &sc[row * K + c]);
          for (int64_t j = 0; j < n; ++j) qc[c * M + r0 + j] = uint8_t(blk[j]);
        }
      }
  }
}

}  // namespace

Status grouped_quantize_cpu(const GroupedQuantizeParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  if (p.mode == ScalingMode::kBlock1d) {
    grouped_quantize_block1d(p);
    return Status::Ok();
  }
  const int64_t M = p.rows, K = p.cols, G = p.num_groups;
  const SmallFloat& f = fp8_format(p.q_dtype);
  const float fmax = fp8_max(p.q_dtype);
  if (p.rowwise) std::memset(p.data, 0, size_t(M * K));
  if (p.colwise) std::memset(p.colwise_data, 0, size_t(M * K));
  int64_t start = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t size = std::max<int64_t>(0, p.group_sizes[g]);
    const int64_t begin = std::min(start, M), end = std::min(start + size, M);
    start += size;
    float amax = 0.0f;
    for (int64_t i = begin * K; i < end * K; ++i)
      amax = std::max(amax, abs_ignore_nan(load_value(p.x, p.x_dtype, i)));
    p.amax[g] = amax;
    if (p.mode == ScalingMode::kMxfp8_1d) {
      auto* q = static_cast<uint8_t*>(p.data);
      auto* s = static_cast<uint8_t*>(p.scale_inv);
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < K / 32; ++b) {
          float blk[32];
          for (int j = 0; j < 32; ++j) blk[j] = load_value(p.x, p.x_dtype, r * K + b * 32 + j);
          const uint8_t e = mx_scale_e8m0(amax_of(blk, 32), fmax);
          s[r * (K / 32) + b] = e;
          for (int j = 0; j < 32; ++j)
            q[r * K + b * 32 + j] = uint8_t(encode_rne(apply_e8m0_encode(blk[j], e), f));
        }
      continue;
    }
    const float scale =
        p.mode == ScalingMode::kDelayedTensor ? p.scale[g] : scale_from_amax(amax, fmax);
    if (p.rowwise) static_cast<float*>(p.scale_inv)[g] = 1.0f / scale;
    if (p.colwise) static_cast<float*>(p.colwise_scale_inv)[g] = 1.0f / scale;
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < K; ++c) {
        const uint8_t code = uint8_t(encode_rne(load_value(p.x, p.x_dtype, r * K + c) * scale, f));
        if (p.rowwise) static_cast<uint8_t*>(p.data)[r * K + c] = code;
        if (p.colwise) static_cast<uint8_t*>(p.colwise_data)[c * M + r] = code;
      }
  }
  if (p.mode == ScalingMode::kMxfp8_1d && p.rowwise) {
    // Rows in no group: scale 2^0 so their (zero) data decodes to zero.
    const int64_t covered = std::min(start, M);
    std::memset(static_cast<uint8_t*>(p.scale_inv) + covered * (K / 32), 127,
                size_t((M - covered) * (K / 32)));
  }
  return Status::Ok();
}

}  // namespace lowbit
