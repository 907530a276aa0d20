// Host tensors of the fused-kernel check programs: raw bytes in f32 / bf16 / f16 (FP8: 1 byte),
// element access with formats.h rounding, normal random fill, and a Status that must be ok.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "lowbit/error.h"
#include "lowbit/formats.h"
#include "lowbit/tensor.h"

inline void status_ok(const lowbit::Status& s, const std::string& what) {
  if (!s.ok()) report(false, what, "status: " + s.message);
}

inline size_t esize(lowbit::DType t) {
  using lowbit::DType;
  return t == DType::kF32 ? 4 : (t == DType::kE4M3 || t == DType::kE5M2 ? 1 : 2);
}

inline float get(const std::vector<uint8_t>& b, lowbit::DType t, size_t i) {
  if (t == lowbit::DType::kF32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return t == lowbit::DType::kBF16 ? lowbit::bf16_to_float(h) : lowbit::f16_to_float(h);
}

inline void put(std::vector<uint8_t>& b, lowbit::DType t, size_t i, float v) {
  if (t == lowbit::DType::kF32) {
    std::memcpy(b.data() + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = t == lowbit::DType::kBF16 ? lowbit::float_to_bf16(v) : lowbit::float_to_f16(v);
  std::memcpy(b.data() + 2 * i, &h, 2);
}

inline std::vector<uint8_t> random_tensor(std::mt19937& rng, lowbit::DType t, size_t n, float mean,
                                          float stddev) {
  std::normal_distribution<float> d(mean, stddev);
  std::vector<uint8_t> b(n * esize(t));
  for (size_t i = 0; i < n; ++i) put(b, t, i, d(rng));
  return b;
}
