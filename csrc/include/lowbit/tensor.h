// Plain descriptions of the tensors kernels see: no XLA types below the FFI layer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lowbit/abi.h"

namespace lowbit {

// Element types kernels read or write. Values are part of the Python <-> C++ contract
// (lowbit/abi.h; src/lowbit/quantization/scaling_modes.py maps JAX dtypes to them).
enum class DType : int32_t {
  kF32 = abi::kDtypeF32,
  kBF16 = abi::kDtypeBf16,
  kF16 = abi::kDtypeF16,
  kE4M3 = abi::kDtypeE4m3,
  kE5M2 = abi::kDtypeE5m2,
  kE2M1 = abi::kDtypeE2m1,  // stored packed, two codes per byte
  kE8M0 = abi::kDtypeE8m0,
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

// Scaling modes (lowbit/abi.h; lowbit.ScalingMode has the same values).
enum class ScalingMode : int32_t {
  kNoScaling = abi::kModeNoScaling,
  kDelayedTensor = abi::kModeDelayedTensorScaling,
  kCurrentTensor = abi::kModeCurrentTensorScaling,
  kMxfp8_1d = abi::kModeMxfp8_1dScaling,
  kNvfp4_1d = abi::kModeNvfp4_1dScaling,
  kNvfp4_2d = abi::kModeNvfp4_2dScaling,
  kBlock1d = abi::kModeBlock_1dScaling,  // FP8, float32 scale per 1x128 block (DeepSeek-style)
  kBlock2d = abi::kModeBlock_2dScaling,  // FP8, float32 scale per 128x128 block
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
