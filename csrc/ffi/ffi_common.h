// Helpers shared by the FFI handler files: dtype mapping, Status -> ffi::Error, and the macros
// that let each handler be written once for both platforms.
#pragma once

#include <cstdint>
#include <string>

#include "lowbit/abi.h"  // the codes and flag bits the handlers decode
#include "lowbit/error.h"
#include "lowbit/tensor.h"
#include "xla/ffi/api/ffi.h"

#if LOWBIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lowbit::ffi_util {

namespace ffi = xla::ffi;

// Short names for the handler parameter lists: an operand and a result of any element type.
using Buf = ffi::AnyBuffer;
using Ret = ffi::Result<ffi::AnyBuffer>;

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

// An optional operand: (0,) means absent.
template <typename T>
inline const T* in_or_null(const ffi::AnyBuffer& b) {
  return b.element_count() ? static_cast<const T*>(b.untyped_data()) : nullptr;
}

}  // namespace lowbit::ffi_util

// Handlers are written once for both platforms. Each family file is compiled once for the CPU
// library and once (LOWBIT_WITH_CUDA) for the CUDA library; these macros pick the platform:
//
//   ffi::Error Foo(LOWBIT_PLATFORM_CTX Buf x, Ret y, int32_t attr) {  // the implementation
//     FooParams p;  ...decode...
//     return to_error(LOWBIT_RUN(foo, p));      // foo_cuda(p, stream) or foo_cpu(p)
//   }
//   LOWBIT_HANDLER(lowbit_foo, Foo, LOWBIT_BIND().Arg<Buf>().Ret<Buf>().Attr<int32_t>("attr"));
//
// LOWBIT_PLATFORM_CTX opens the parameter list with the CUDA stream (nothing on CPU), matching
// the context LOWBIT_BIND() decodes. LOWBIT_HANDLER exports the symbol lowbit_<op>_cuda or
// lowbit_<op>_cpu; CUDA handlers carry the command-buffer trait (they never synchronise, so XLA
// may capture them in CUDA graphs). LOWBIT_DEFINE_HANDLER takes the full symbol name.
#define LOWBIT_EXPORT extern "C" __attribute__((visibility("default")))
#if LOWBIT_WITH_CUDA
#define LOWBIT_SYMBOL(n) n##_cuda
#define LOWBIT_PLATFORM_CTX cudaStream_t stream,
#define LOWBIT_RUN(kernel, params) kernel##_cuda(params, stream)
#define LOWBIT_BIND() ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
#define LOWBIT_DEFINE_HANDLER(sym, impl, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible})
#else
#define LOWBIT_SYMBOL(n) n##_cpu
#define LOWBIT_PLATFORM_CTX
#define LOWBIT_RUN(kernel, params) kernel##_cpu(params)
#define LOWBIT_BIND() ::xla::ffi::Ffi::Bind()
#define LOWBIT_DEFINE_HANDLER(sym, impl, binding) XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, impl, binding)
#endif
// CUDA handlers check their workspace result against what the kernel needs (`need`, evaluated on
// CUDA only); CPU kernels take no workspace.
#if LOWBIT_WITH_CUDA
#define LOWBIT_CHECK_WORKSPACE(ws, need, op)                                                       \
  do {                                                                                             \
    if ((ws)->size_bytes() < (need)) return to_error(Status::Invalid(op ": workspace too small")); \
  } while (0)
#else
#define LOWBIT_CHECK_WORKSPACE(ws, need, op) (void)0
#endif
#define LOWBIT_HANDLER(op, impl, binding) LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(op), impl, binding)
