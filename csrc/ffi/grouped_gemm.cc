// FFI handler of the grouped GEMM (lowbit/grouped_gemm.h), written once (ffi_common.h) and
// compiled into liblowbit_cpu and, with LOWBIT_WITH_CUDA, into liblowbit_cuda. The Python side
// passes the GEMM view (mode, extents, strides) as attributes; the handler checks it against
// the buffers it got, then calls the kernel.
#include "lowbit/grouped_gemm.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// Decodes the `flags` attribute (bits in lowbit/abi.h). kGroupedBlockScaled: FP8 block scales
// (Float8BlockScaling); kGroupedBlockN128: B's blocks are 128x128.
void set_flags(GroupedGemmParams* p, int32_t flags) {
  p->a_kmajor = flags & abi::kGroupedAKmajor;
  p->b_kmajor = flags & abi::kGroupedBKmajor;
  p->fast_accum = flags & abi::kGroupedFastAccum;
  p->block_scaled = flags & abi::kGroupedBlockScaled;
  p->b_block_n = (flags & abi::kGroupedBlockN128) ? 128 : 1;
}

ffi::Error GroupedGemm(LOWBIT_PLATFORM_CTX Buf a, Buf b, ffi::Buffer<ffi::S32> group_sizes,
                       Buf a_scale_inv, Buf b_scale_inv, Ret out, Ret workspace, int32_t mode,
                       int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                       int64_t b_group_stride, int32_t flags) {
  GroupedGemmParams p;
  if (!to_dtype(a.element_type(), &p.a_dtype) || !to_dtype(b.element_type(), &p.b_dtype) ||
      !to_dtype(out->element_type(), &p.out_dtype))
    return to_error(Status::Invalid("grouped_gemm: unsupported dtype"));
  p.mode = static_cast<GroupedGemmMode>(mode);
  p.m = m;
  p.n = n;
  p.k = k;
  p.num_groups = static_cast<int64_t>(group_sizes.element_count());
  p.group_sizes = group_sizes.typed_data();
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  set_flags(&p, flags);
  p.lda = lda;
  p.ldb = ldb;
  p.b_group_stride = b_group_stride;
  const bool fp8 = grouped_is_fp8(p.a_dtype) || grouped_is_fp8(p.b_dtype);
  if (fp8 && p.block_scaled) {
    if (a_scale_inv.element_type() != ffi::DataType::F32 ||
        b_scale_inv.element_type() != ffi::DataType::F32)
      return to_error(Status::Invalid("grouped_gemm: FP8 block scales must be float32"));
    p.a_scale_inv = static_cast<const float*>(a_scale_inv.untyped_data());
    p.b_scale_inv = static_cast<const float*>(b_scale_inv.untyped_data());
    p.a_scale_elements = static_cast<int64_t>(a_scale_inv.element_count());
    p.b_scale_elements = static_cast<int64_t>(b_scale_inv.element_count());
  } else if (fp8) {
    if (a_scale_inv.element_type() != ffi::DataType::F32 ||
        b_scale_inv.element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(a_scale_inv.element_count()) != p.num_groups ||
        static_cast<int64_t>(b_scale_inv.element_count()) != p.num_groups)
      return to_error(Status::Invalid("grouped_gemm: FP8 scales must be float32 of shape (G,)"));
    p.a_scale_inv = static_cast<const float*>(a_scale_inv.untyped_data());
    p.b_scale_inv = static_cast<const float*>(b_scale_inv.untyped_data());
  }
  p.out = out->untyped_data();
  p.a_elements = static_cast<int64_t>(a.element_count());
  p.b_elements = static_cast<int64_t>(b.element_count());
  p.out_elements = static_cast<int64_t>(out->element_count());
  p.workspace = ptr_or_null<void>(workspace);
  p.workspace_bytes = workspace->size_bytes();
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(grouped_gemm, p));
}

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_grouped_gemm, GroupedGemm,
               LOWBIT_BIND()
                   .Arg<Buf>()                    // a
                   .Arg<Buf>()                    // b
                   .Arg<ffi::Buffer<ffi::S32>>()  // group sizes (G,)
                   .Arg<Buf>()                    // a scale_inv (G,) or block scales f32, or (0,)
                   .Arg<Buf>()                    // b scale_inv (G,) or block scales f32, or (0,)
                   .Ret<Buf>()                    // out
                   .Ret<Buf>()                    // workspace (bytes)
                   .Attr<int32_t>("mode")
                   .Attr<int64_t>("m")
                   .Attr<int64_t>("n")
                   .Attr<int64_t>("k")
                   .Attr<int64_t>("lda")
                   .Attr<int64_t>("ldb")
                   .Attr<int64_t>("b_group_stride")
                   .Attr<int32_t>("flags"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Workspace size, asked by Python at trace time (the workspace is an ordinary XLA result, so its
// address is stable across CUDA-graph replays). It depends on the CUTLASS configuration the
// dtypes and layouts select, the extents (ragged K's realigned copies), the number of groups
// and the device's SM count.
LOWBIT_EXPORT int64_t lowbit_grouped_gemm_workspace_bytes(int64_t mode, int64_t a_dtype,
                                                          int64_t b_dtype, int64_t flags, int64_t m,
                                                          int64_t n, int64_t k,
                                                          int64_t num_groups) {
  GroupedGemmParams p;
  p.mode = static_cast<GroupedGemmMode>(mode);
  p.a_dtype = static_cast<DType>(a_dtype);
  p.b_dtype = static_cast<DType>(b_dtype);
  set_flags(&p, flags);
  p.m = m;
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  return static_cast<int64_t>(grouped_gemm_workspace_bytes(p));
}
#endif
