// Helpers shared by the FFI handler files: dtype mapping and Status -> ffi::Error.
#pragma once

#include <cstdint>
#include <string>

#include "lowbit/error.h"
#include "lowbit/tensor.h"
#include "xla/ffi/api/ffi.h"

#if LOWBIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lowbit::ffi_util {

namespace ffi = xla::ffi;

inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::F8E4M3FN: *out = DType::kE4M3; return true;
    case ffi::DataType::F8E5M2: *out = DType::kE5M2; return true;
    case ffi::DataType::U8: *out = DType::kE2M1; return true;  // packed FP4
    case ffi::DataType::F8E8M0FNU: *out = DType::kE8M0; return true;
    default: return false;
  }
}

inline ffi::Error to_error(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: " + s.message);
}

// (rows, cols) of a buffer the Python side has already flattened to 2-D.
inline bool dims_2d(const ffi::AnyBuffer& b, int64_t* rows, int64_t* cols) {
  auto d = b.dimensions();
  if (d.size() != 2) return false;
  *rows = d[0];
  *cols = d[1];
  return true;
}

template <typename T>
inline T* ptr_or_null(ffi::Result<ffi::AnyBuffer>& r) {
  return r->element_count() == 0 ? nullptr : static_cast<T*>(r->untyped_data());
}

}  // namespace lowbit::ffi_util

// Handler definitions shared by the op-family files. Each family file is compiled once for the
// CPU library and once (LOWBIT_WITH_CUDA) for the CUDA library; these macros pick the platform:
// symbol lowbit_<op>_cpu / lowbit_<op>_cuda, the stream context, and the command-buffer trait
// (CUDA handlers never synchronise, so XLA may capture them in CUDA graphs).
#define LOWBIT_EXPORT extern "C" __attribute__((visibility("default")))
#if LOWBIT_WITH_CUDA
#define LOWBIT_SYMBOL(n) n##_cuda
#define LOWBIT_BIND() ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
#define LOWBIT_DEFINE_HANDLER(sym, impl, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible})
#else
#define LOWBIT_SYMBOL(n) n##_cpu
#define LOWBIT_BIND() ::xla::ffi::Ffi::Bind()
#define LOWBIT_DEFINE_HANDLER(sym, impl, binding) XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, impl, binding)
#endif
