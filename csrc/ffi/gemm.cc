// FFI handler of the GEMM family: out(M, N) = A(M, K) . B(N, K)^T * scales (+ bias).
// Compiled into liblowbit_cpu (CPU handler) and, with LOWBIT_WITH_CUDA, into liblowbit_cuda
// (cuBLASLt handler). The handler only decodes buffers and attributes.
#include "lowbit/gemm.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// Bits of the `flags` attribute (src/lowbit/ops/gemm.py mirrors them).
constexpr int32_t kFastAccum = 1;

ffi::Error build_gemm(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                      ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& workspace,
                      int32_t flags, GemmParams* p) {
  int64_t m, ka, n, kb, om, on;
  if (!dims_2d(a, &m, &ka) || !dims_2d(b, &n, &kb) || !dims_2d(*out, &om, &on))
    return to_error(Status::Invalid("gemm: a, b and out must be 2-D"));
  if (ka != kb) return to_error(Status::Invalid("gemm: a and b have different contraction sizes"));
  if (om != m || on != n) return to_error(Status::Invalid("gemm: output shape must be (M, N)"));
  if (!to_dtype(a.element_type(), &p->a_dtype) || !to_dtype(b.element_type(), &p->b_dtype) ||
      !to_dtype(out->element_type(), &p->out_dtype))
    return to_error(Status::Invalid("gemm: unsupported dtype"));
  p->a = a.untyped_data();
  p->b = b.untyped_data();
  p->m = m;
  p->n = n;
  p->k = ka;
  if (is_fp8(p->a_dtype)) {
    if (a_scale_inv.element_count() != 1 || b_scale_inv.element_count() != 1 ||
        a_scale_inv.element_type() != ffi::DataType::F32 ||
        b_scale_inv.element_type() != ffi::DataType::F32)
      return to_error(Status::Invalid("gemm: FP8 scale_inv must be float32 of shape (1,)"));
    p->a_scale_inv = static_cast<const float*>(a_scale_inv.untyped_data());
    p->b_scale_inv = static_cast<const float*>(b_scale_inv.untyped_data());
  }
  if (bias.element_count() != 0) {
    if (static_cast<int64_t>(bias.element_count()) != n ||
        !to_dtype(bias.element_type(), &p->bias_dtype))
      return to_error(Status::Invalid("gemm: bias must have shape (N,) and dtype BF16 or F32"));
    p->bias = bias.untyped_data();
  }
  p->out = out->untyped_data();
  p->fast_accum = flags & kFastAccum;
  p->workspace = ptr_or_null<void>(workspace);
  p->workspace_bytes = workspace->size_bytes();
  return to_error(validate(*p));
}

#if LOWBIT_WITH_CUDA

ffi::Error GemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer asi,
                    ffi::AnyBuffer bsi, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> ws, int32_t flags) {
  GemmParams p;
  auto err = build_gemm(a, b, asi, bsi, bias, out, ws, flags, &p);
  if (err.failure()) return err;
  return to_error(gemm_cuda(p, stream));
}

#define LOWBIT_NAME(n) n##Cuda

// The handler never syncs, but lowbit_gemm_cuda is NOT marked command-buffer compatible: XLA
// records command buffers by stream capture on the first run, and cuBLASLt's first use of a
// handle/kernel inside a capture failed (H100, session 1: "cublasLtMatmul failed: the function
// failed to launch" from cuda_command_buffer). Outside graphs the GEMM launches as its own thunk.
// lowbit_gemm_cmdbuf_cuda is the same handler with the trait, registered instead when
// LOWBIT_GEMM_COMMAND_BUFFER=1 (lowbit._native), for trying it out.
#define LOWBIT_GEMM_DEFINE_HANDLER(sym, impl, binding) XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, impl, binding)

#else  // CPU

ffi::Error GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer asi, ffi::AnyBuffer bsi,
                   ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> ws, int32_t flags) {
  GemmParams p;
  auto err = build_gemm(a, b, asi, bsi, bias, out, ws, flags, &p);
  if (err.failure()) return err;
  return to_error(gemm_cpu(p));
}

#define LOWBIT_NAME(n) n##Cpu
#define LOWBIT_GEMM_DEFINE_HANDLER(sym, impl, binding) LOWBIT_DEFINE_HANDLER(sym, impl, binding)

#endif

}  // namespace

#pragma GCC visibility push(default)

#define LOWBIT_GEMM_BINDING                                                    \
  LOWBIT_BIND()                                                                \
      .Arg<ffi::AnyBuffer>()  /* a (M, K) */                                   \
      .Arg<ffi::AnyBuffer>()  /* b (N, K) */                                   \
      .Arg<ffi::AnyBuffer>()  /* a_scale_inv (1,) f32 or (0,) */               \
      .Arg<ffi::AnyBuffer>()  /* b_scale_inv (1,) f32 or (0,) */               \
      .Arg<ffi::AnyBuffer>()  /* bias (N,) or (0,) */                          \
      .Ret<ffi::AnyBuffer>()  /* out (M, N) */                                 \
      .Ret<ffi::AnyBuffer>()  /* workspace (bytes; (0,) on CPU) */             \
      .Attr<int32_t>("flags")

LOWBIT_GEMM_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_gemm), LOWBIT_NAME(Gemm), LOWBIT_GEMM_BINDING);
#if LOWBIT_WITH_CUDA
LOWBIT_DEFINE_HANDLER(lowbit_gemm_cmdbuf_cuda, GemmCuda, LOWBIT_GEMM_BINDING);
#endif

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// The current device's cuBLASLt handle, created before any graph capture (0 on success).
LOWBIT_EXPORT int lowbit_gemm_init_cuda() { return lowbit::gemm_cuda_init().ok() ? 0 : 1; }
#endif

// Workspace the CUDA handler wants (Python asks once at trace time).
LOWBIT_EXPORT int64_t lowbit_gemm_workspace_bytes() {
#if LOWBIT_WITH_CUDA
  return static_cast<int64_t>(kGemmWorkspaceBytes);
#else
  return 0;
#endif
}
