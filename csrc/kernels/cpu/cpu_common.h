// Small helpers of the CPU kernels: typed element access and an exact floating-point mode.
#pragma once

#include <cstdint>

#include "lowbit/formats.h"
#include "lowbit/tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace lowbit {

// XLA runs CPU kernels on threads that flush denormals to zero; the specification honors them,
// so the kernels clear FTZ/DAZ while they run and restore the caller's mode afterwards.
class FpuExactGuard {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FpuExactGuard() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }
  ~FpuExactGuard() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

inline float load_value(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return 0.0f;
  }
}

inline void store_value(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    default: break;
  }
}

}  // namespace lowbit
