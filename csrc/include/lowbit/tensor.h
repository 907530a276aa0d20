// Plain descriptions of the tensors kernels see: no XLA types below the FFI layer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lowbit {

// Element types kernels read or write. Values are part of the Python <-> C++ contract
// (src/lowbit/quantize/scaling_modes.py mirrors them).
enum class DType : int32_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kE4M3 = 3,
  kE5M2 = 4,
  kE2M1 = 5,  // stored packed, two codes per byte
  kE8M0 = 6,
};

// Scaling modes; values mirror lowbit.ScalingMode.
enum class ScalingMode : int32_t {
  kNoScaling = 0,
  kDelayedTensor = 1,
  kCurrentTensor = 2,
  kMxfp8_1d = 3,
  kNvfp4_1d = 4,
  kNvfp4_2d = 5,
  kBlock1d = 6,  // FP8, float32 scale per 1x128 block (DeepSeek-style Float8BlockScaling)
  kBlock2d = 7,  // FP8, float32 scale per 128x128 block
};

inline bool is_tensor_scaling(ScalingMode m) {
  return m == ScalingMode::kDelayedTensor || m == ScalingMode::kCurrentTensor;
}
inline bool is_nvfp4(ScalingMode m) {
  return m == ScalingMode::kNvfp4_1d || m == ScalingMode::kNvfp4_2d;
}
inline bool is_fp8_block(ScalingMode m) {
  return m == ScalingMode::kBlock1d || m == ScalingMode::kBlock2d;
}
// Elements per block along the copy's last axis (1 for tensor scaling).
inline int block_size(ScalingMode m) {
  if (is_fp8_block(m)) return 128;
  return m == ScalingMode::kMxfp8_1d ? 32 : (is_nvfp4(m) ? 16 : 1);
}

// FP8 block scaling (kBlock1d / kBlock2d): the float32 scale_inv layout cuBLASLt's
// VEC128_32F / BLK128x128_32F scale modes read (docs/numerics.md), for a copy of (rows, cols)
// quantized along cols. 1D: (ceil(cols/128), round_up(rows, 4)), row-major, entry [j][r] is
// block (r, j): the rows dimension contiguous. 2D: (ceil(rows/128), round_up(ceil(cols/128), 4)),
// entry [i][j] is tile (i, j). Padding entries are written as 1.0.
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up4(int64_t a) { return (a + 3) / 4 * 4; }
inline int64_t fp8_block_scale_rows(ScalingMode m, int64_t rows, int64_t cols) {
  return m == ScalingMode::kBlock1d ? ceil_div(cols, 128) : ceil_div(rows, 128);
}
inline int64_t fp8_block_scale_cols(ScalingMode m, int64_t rows, int64_t cols) {
  return m == ScalingMode::kBlock1d ? round_up4(rows) : round_up4(ceil_div(cols, 128));
}
// Index of the scale of element (r, c).
inline int64_t fp8_block_scale_index(ScalingMode m, int64_t rows, int64_t cols, int64_t r,
                                     int64_t c) {
  const int64_t ld = fp8_block_scale_cols(m, rows, cols);
  return m == ScalingMode::kBlock1d ? (c / 128) * ld + r : (r / 128) * ld + c / 128;
}

}  // namespace lowbit
