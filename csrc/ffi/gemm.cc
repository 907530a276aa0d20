// FFI handler of the GEMM family: out(M, N) = A(M, K) . B(N, K)^T * scales (+ bias).
// With n > 1 outputs (results 0..n-1; the workspace is always the last result), each is an
// (M, N/n) column block of that product, computed in place from B's rows and the bias's
// entries: the fused QKV projection hands q, k and v to attention without slicing copies.
// Written once (ffi_common.h); compiled into liblowbit_cpu and, with LOWBIT_WITH_CUDA, into
// liblowbit_cuda (cuBLASLt). The handler only decodes buffers and attributes.
#include "lowbit/gemm.h"

#include <cstdlib>
#include <string>

#include "lowbit/block_scaling.h"
#if LOWBIT_WITH_CUDA
#include "lowbit/block_gemm.h"
#endif

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// Checks an FP8 operand's decode scales: (1,) float32, or the block-scale array of its
// (rows, k) copy.
Status check_scales(const ffi::AnyBuffer& s, int block, int64_t rows, int64_t k, const char* name) {
  if (s.element_type() != ffi::DataType::F32)
    return Status::Invalid(std::string("gemm: ") + name + " must be float32");
  int64_t want = 1;
  if (block) {
    const ScalingMode m = gemm_block_mode(block);
    want = fp8_block_scale_rows(m, rows, k) * fp8_block_scale_cols(m, rows, k);
  }
  if (static_cast<int64_t>(s.element_count()) != want)
    return Status::Invalid(std::string("gemm: ") + name + " has " +
                           std::to_string(s.element_count()) + " elements, the operand needs " +
                           std::to_string(want));
  return Status::Ok();
}

ffi::Error Gemm(LOWBIT_PLATFORM_CTX Buf a, Buf b, Buf a_scale_inv, Buf b_scale_inv, Buf bias,
                Ret out, ffi::RemainingRets more, int32_t flags) {
  if (more.size() < 1) return to_error(Status::Invalid("gemm: missing the workspace result"));
  auto ws = more.get<ffi::AnyBuffer>(more.size() - 1);
  if (!ws.has_value()) return ws.error();
  Ret workspace = *ws;
  GemmParams p;
  int64_t m, ka, n, kb, om, on;
  if (!dims_2d(a, &m, &ka) || !dims_2d(b, &n, &kb) || !dims_2d(*out, &om, &on))
    return to_error(Status::Invalid("gemm: a, b and out must be 2-D"));
  if (ka != kb) return to_error(Status::Invalid("gemm: a and b have different contraction sizes"));
  const int64_t parts = static_cast<int64_t>(more.size());  // outputs (the last result: workspace)
  if (om != m || on * parts != n)
    return to_error(Status::Invalid("gemm: each of the n outputs must be (M, N / n)"));
  if (!to_dtype(a.element_type(), &p.a_dtype) || !to_dtype(b.element_type(), &p.b_dtype) ||
      !to_dtype(out->element_type(), &p.out_dtype))
    return to_error(Status::Invalid("gemm: unsupported dtype"));
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.m = m;
  p.n = n;
  p.k = ka;
  // The `flags` attribute (lowbit/abi.h): each operand's FP8 block scaling is a 2-bit field.
  p.a_block = (flags >> abi::kGemmABlockShift) & abi::kGemmBlockMask;
  p.b_block = (flags >> abi::kGemmBBlockShift) & abi::kGemmBlockMask;
  if (is_fp8(p.a_dtype)) {
    if (auto st = check_scales(a_scale_inv, p.a_block, m, ka, "a_scale_inv"); !st.ok())
      return to_error(st);
    if (auto st = check_scales(b_scale_inv, p.b_block, n, ka, "b_scale_inv"); !st.ok())
      return to_error(st);
    p.a_scale_inv = static_cast<const float*>(a_scale_inv.untyped_data());
    p.b_scale_inv = static_cast<const float*>(b_scale_inv.untyped_data());
  }
  if (bias.element_count() != 0) {
    if (static_cast<int64_t>(bias.element_count()) != n ||
        !to_dtype(bias.element_type(), &p.bias_dtype))
      return to_error(Status::Invalid("gemm: bias must have shape (N,) and dtype BF16 or F32"));
    p.bias = bias.untyped_data();
  }
  p.out = out->untyped_data();
  p.fast_accum = flags & abi::kGemmFastAccum;
  p.workspace = ptr_or_null<void>(workspace);
  p.workspace_bytes = workspace->size_bytes();
  // Column blocks (one when not split): block i reads B's rows [i*w, (i+1)*w) and the bias's
  // entries there; per-tensor decode scales apply to every block. Block scaling splits with a
  // 128x128 B whose blocks are whole 128-row bands: block i reads its bands' rows of B's scales
  // (the A side, 1x128 or 128x128 over A's rows, is the same for every block).
  const int64_t w = on;
  const bool split_2d_b = p.b_block == abi::kGemmBlock_2d && w % 128 == 0;
  if (parts > 1 && (p.a_block || p.b_block) && !split_2d_b)
    return to_error(Status::Invalid(
        "gemm: split outputs need per-tensor or BF16 operands, or a 128x128-scaled b whose "
        "blocks are multiples of 128 rows"));
  const int64_t b_scale_band =
      p.b_block ? fp8_block_scale_cols(ScalingMode::kBlock2d, n, ka) * (w / 128) : 0;
  p.n = w;
  for (int64_t i = 0; i < parts; ++i) {
    GemmParams q = p;
    q.b = static_cast<const char*>(p.b) + i * w * ka * dtype_bytes(p.b_dtype);
    if (split_2d_b) q.b_scale_inv = p.b_scale_inv + i * b_scale_band;
    if (p.bias) q.bias = static_cast<const char*>(p.bias) + i * w * dtype_bytes(p.bias_dtype);
    if (i > 0) {
      auto r = more.get<ffi::AnyBuffer>(i - 1);
      if (!r.has_value()) return r.error();
      int64_t rm, rn;
      DType rt;
      if (!dims_2d(**r, &rm, &rn) || rm != m || rn != w || !to_dtype((*r)->element_type(), &rt) ||
          rt != p.out_dtype)
        return to_error(
            Status::Invalid("gemm: every split output must be (M, N / n) of one dtype"));
      q.out = (*r)->untyped_data();
    }
    if (auto err = to_error(validate(q)); err.failure()) return err;
    if (auto err = to_error(LOWBIT_RUN(gemm, q)); err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

#define LOWBIT_GEMM_BINDING                               \
  LOWBIT_BIND()                                           \
      .Arg<Buf>()      /* a (M, K) */                     \
      .Arg<Buf>()      /* b (N, K) */                     \
      .Arg<Buf>()      /* a_scale_inv (1,) f32 or (0,) */ \
      .Arg<Buf>()      /* b_scale_inv (1,) f32 or (0,) */ \
      .Arg<Buf>()      /* bias (N,) or (0,) */            \
      .Ret<Buf>()      /* out (M, N), or (M, N/n) */      \
      .RemainingRets() /* outputs 1..n-1, workspace */    \
      .Attr<int32_t>("flags")

#if LOWBIT_WITH_CUDA
// The handler never syncs, but lowbit_gemm_cuda is NOT marked command-buffer compatible: XLA
// records command buffers by stream capture on the first run, and cuBLASLt's first use of a
// handle/kernel inside a capture failed ("cublasLtMatmul failed: the function failed to launch"
// from cuda_command_buffer). Outside graphs the GEMM launches as its own thunk.
// lowbit_gemm_cmdbuf_cuda is the same handler with the trait, registered instead when
// LOWBIT_GEMM_COMMAND_BUFFER=1 (lowbit._native), for trying it out.
XLA_FFI_DEFINE_HANDLER_SYMBOL(lowbit_gemm_cuda, Gemm, LOWBIT_GEMM_BINDING);
LOWBIT_DEFINE_HANDLER(lowbit_gemm_cmdbuf_cuda, Gemm, LOWBIT_GEMM_BINDING);
#else
LOWBIT_HANDLER(lowbit_gemm, Gemm, LOWBIT_GEMM_BINDING);
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

// Whether a block-scaled GEMM of these dtypes (DType codes) and block modes takes its bias in
// the epilogue (Python then passes it instead of adding it after an F32 GEMM): the CPU kernel
// always does; on CUDA lowbit's CUTLASS kernels do where one exists, unless
// LOWBIT_BLOCK_GEMM=cublaslt forces cuBLASLt (which has no such epilogue).
LOWBIT_EXPORT int lowbit_gemm_block_bias(int a_dtype, int b_dtype, int a_block, int b_block,
                                         int out_dtype) {
#if LOWBIT_WITH_CUDA
  const char* e = std::getenv("LOWBIT_BLOCK_GEMM");
  if (e && std::string(e) == "cublaslt") return 0;
  GemmParams p;
  p.a_dtype = static_cast<DType>(a_dtype);
  p.b_dtype = static_cast<DType>(b_dtype);
  p.a_block = a_block;
  p.b_block = b_block;
  p.out_dtype = static_cast<DType>(out_dtype);
  return block_gemm_cutlass_variants(p) > 0 ? 1 : 0;
#else
  (void)a_dtype, (void)b_dtype, (void)a_block, (void)b_block, (void)out_dtype;
  return 1;
#endif
}
