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

// Bytes per element of an unpacked dtype. E2M1 is stored two codes per byte: 0 here, its
// callers size it themselves.
inline size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kE2M1: return 0;
    default: return 1;
  }
}

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

}  // namespace lowbit
