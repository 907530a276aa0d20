// FFI handlers of the quantization family: quantize (+dbias), dequantize, grouped quantize.
// Compiled into liblowbit_cpu (CPU handlers) and, with LOWBIT_WITH_CUDA, into liblowbit_cuda
// (CUDA handlers). Handlers only decode buffers and attributes; kernels do the math.
#include "lowbit/quantize.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// Flag bits of the `flags` attribute (src/lowbit/ops/_ffi_flags.py mirrors them).
constexpr int32_t kRowwise = 1, kColwise = 2, kDbias = 4, kStochastic = 8, kRht = 16;

ffi::Error build_quantize(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer seed,
                          ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::AnyBuffer>& scale_inv,
                          ffi::Result<ffi::AnyBuffer>& cw_data,
                          ffi::Result<ffi::AnyBuffer>& cw_scale_inv,
                          ffi::Result<ffi::AnyBuffer>& amax,
                          ffi::Result<ffi::AnyBuffer>& global_scale_inv,
                          ffi::Result<ffi::AnyBuffer>& dbias, ffi::Result<ffi::AnyBuffer>& workspace,
                          int32_t mode, int32_t q_dtype, int32_t flags, int32_t rht_sign_mask,
                          QuantizeParams* p) {
  if (!dims_2d(x, &p->rows, &p->cols)) return to_error(Status::Invalid("quantize: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p->x_dtype))
    return to_error(Status::Invalid("quantize: unsupported input dtype"));
  p->x = x.untyped_data();
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->rowwise = flags & kRowwise;
  p->colwise = flags & kColwise;
  p->rht = flags & kRht;
  p->rht_sign_mask = static_cast<uint32_t>(rht_sign_mask) & 0xFFFFu;
  p->scale = scale.element_count() ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  p->sr_seed = (flags & kStochastic) && seed.element_count() >= 2
                   ? static_cast<const uint32_t*>(seed.untyped_data())
                   : nullptr;
  p->data = ptr_or_null<void>(data);
  p->scale_inv = ptr_or_null<void>(scale_inv);
  p->colwise_data = ptr_or_null<void>(cw_data);
  p->colwise_scale_inv = ptr_or_null<void>(cw_scale_inv);
  p->amax = ptr_or_null<float>(amax);
  p->global_scale_inv = ptr_or_null<float>(global_scale_inv);
  p->dbias = (flags & kDbias) ? ptr_or_null<void>(dbias) : nullptr;
  p->workspace = ptr_or_null<void>(workspace);
  return to_error(validate(*p));
}

ffi::Error build_dequantize(ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                            ffi::AnyBuffer global_scale_inv, ffi::Result<ffi::AnyBuffer>& out,
                            int32_t mode, int32_t q_dtype, int32_t flags, int32_t rht_sign_mask,
                            DequantizeParams* p) {
  if (!dims_2d(*out, &p->rows, &p->cols))
    return to_error(Status::Invalid("dequantize: output must be 2-D"));
  if (!to_dtype(out->element_type(), &p->out_dtype))
    return to_error(Status::Invalid("dequantize: unsupported output dtype"));
  p->data = data.untyped_data();
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->scale_inv = scale_inv.untyped_data();
  p->global_scale_inv = global_scale_inv.element_count()
                            ? static_cast<const float*>(global_scale_inv.untyped_data())
                            : nullptr;
  p->rht = flags & kRht;
  p->rht_sign_mask = static_cast<uint32_t>(rht_sign_mask) & 0xFFFFu;
  p->out = out->untyped_data();
  return to_error(validate(*p));
}

ffi::Error build_grouped(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer scale,
                         ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::AnyBuffer>& scale_inv,
                         ffi::Result<ffi::AnyBuffer>& cw_data,
                         ffi::Result<ffi::AnyBuffer>& cw_scale_inv,
                         ffi::Result<ffi::AnyBuffer>& amax, ffi::Result<ffi::AnyBuffer>& workspace,
                         int32_t mode, int32_t q_dtype, int32_t flags, GroupedQuantizeParams* p) {
  if (!dims_2d(x, &p->rows, &p->cols))
    return to_error(Status::Invalid("grouped_quantize: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p->x_dtype))
    return to_error(Status::Invalid("grouped_quantize: unsupported input dtype"));
  p->x = x.untyped_data();
  p->group_sizes = group_sizes.typed_data();
  p->num_groups = static_cast<int64_t>(group_sizes.element_count());
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->rowwise = flags & kRowwise;
  p->colwise = flags & kColwise;
  p->scale = scale.element_count() ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  p->data = ptr_or_null<void>(data);
  p->scale_inv = ptr_or_null<void>(scale_inv);
  p->colwise_data = ptr_or_null<void>(cw_data);
  p->colwise_scale_inv = ptr_or_null<void>(cw_scale_inv);
  p->amax = ptr_or_null<float>(amax);
  p->workspace = ptr_or_null<void>(workspace);
  return to_error(validate(*p));
}

#if LOWBIT_WITH_CUDA

ffi::Error QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> data,
                        ffi::Result<ffi::AnyBuffer> scale_inv, ffi::Result<ffi::AnyBuffer> cw_data,
                        ffi::Result<ffi::AnyBuffer> cw_scale_inv, ffi::Result<ffi::AnyBuffer> amax,
                        ffi::Result<ffi::AnyBuffer> gsi, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> ws, int32_t mode, int32_t q_dtype,
                        int32_t flags, int32_t rht_sign_mask) {
  QuantizeParams p;
  auto err = build_quantize(x, scale, seed, data, scale_inv, cw_data, cw_scale_inv, amax, gsi,
                            dbias, ws, mode, q_dtype, flags, rht_sign_mask, &p);
  if (err.failure()) return err;
  if (ws->size_bytes() < quantize_workspace_bytes(p))
    return to_error(Status::Invalid("quantize: workspace too small"));
  return to_error(quantize_cuda(p, stream));
}

ffi::Error DequantizeCuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                          ffi::AnyBuffer gsi, ffi::Result<ffi::AnyBuffer> out, int32_t mode,
                          int32_t q_dtype, int32_t flags, int32_t rht_sign_mask) {
  DequantizeParams p;
  auto err = build_dequantize(data, scale_inv, gsi, out, mode, q_dtype, flags, rht_sign_mask, &p);
  if (err.failure()) return err;
  return to_error(dequantize_cuda(p, stream));
}

ffi::Error GroupedQuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer scale,
                               ffi::Result<ffi::AnyBuffer> data,
                               ffi::Result<ffi::AnyBuffer> scale_inv,
                               ffi::Result<ffi::AnyBuffer> cw_data,
                               ffi::Result<ffi::AnyBuffer> cw_scale_inv,
                               ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> ws,
                               int32_t mode, int32_t q_dtype, int32_t flags) {
  GroupedQuantizeParams p;
  auto err = build_grouped(x, group_sizes, scale, data, scale_inv, cw_data, cw_scale_inv, amax, ws,
                           mode, q_dtype, flags, &p);
  if (err.failure()) return err;
  if (ws->size_bytes() < grouped_quantize_workspace_bytes(p))
    return to_error(Status::Invalid("grouped_quantize: workspace too small"));
  return to_error(grouped_quantize_cuda(p, stream));
}

#define LOWBIT_NAME(n) n##Cuda

#else  // CPU

ffi::Error QuantizeCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer seed,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scale_inv,
                       ffi::Result<ffi::AnyBuffer> cw_data,
                       ffi::Result<ffi::AnyBuffer> cw_scale_inv, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> gsi, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> ws, int32_t mode, int32_t q_dtype,
                       int32_t flags, int32_t rht_sign_mask) {
  QuantizeParams p;
  auto err = build_quantize(x, scale, seed, data, scale_inv, cw_data, cw_scale_inv, amax, gsi,
                            dbias, ws, mode, q_dtype, flags, rht_sign_mask, &p);
  if (err.failure()) return err;
  return to_error(quantize_cpu(p));
}

ffi::Error DequantizeCpu(ffi::AnyBuffer data, ffi::AnyBuffer scale_inv, ffi::AnyBuffer gsi,
                         ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t q_dtype,
                         int32_t flags, int32_t rht_sign_mask) {
  DequantizeParams p;
  auto err = build_dequantize(data, scale_inv, gsi, out, mode, q_dtype, flags, rht_sign_mask, &p);
  if (err.failure()) return err;
  return to_error(dequantize_cpu(p));
}

ffi::Error GroupedQuantizeCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> data,
                              ffi::Result<ffi::AnyBuffer> scale_inv,
                              ffi::Result<ffi::AnyBuffer> cw_data,
                              ffi::Result<ffi::AnyBuffer> cw_scale_inv,
                              ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> ws,
                              int32_t mode, int32_t q_dtype, int32_t flags) {
  GroupedQuantizeParams p;
  auto err = build_grouped(x, group_sizes, scale, data, scale_inv, cw_data, cw_scale_inv, amax, ws,
                           mode, q_dtype, flags, &p);
  if (err.failure()) return err;
  return to_error(grouped_quantize_cpu(p));
}

#define LOWBIT_NAME(n) n##Cpu

#endif

}  // namespace

// The handler symbols must be visible although the library builds with -fvisibility=hidden.
#pragma GCC visibility push(default)

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_quantize), LOWBIT_NAME(Quantize),
                              LOWBIT_BIND()
                                  .Arg<ffi::AnyBuffer>()   // x (R, C)
                                  .Arg<ffi::AnyBuffer>()   // scale (1,) f32 or (0,)
                                  .Arg<ffi::AnyBuffer>()   // sr seed (2,) u32 or (0,)
                                  .Ret<ffi::AnyBuffer>()   // data
                                  .Ret<ffi::AnyBuffer>()   // scale_inv
                                  .Ret<ffi::AnyBuffer>()   // colwise data
                                  .Ret<ffi::AnyBuffer>()   // colwise scale_inv
                                  .Ret<ffi::AnyBuffer>()   // amax (1,)
                                  .Ret<ffi::AnyBuffer>()   // global scale_inv (2,) or (0,)
                                  .Ret<ffi::AnyBuffer>()   // dbias (C,) or (0,)
                                  .Ret<ffi::AnyBuffer>()   // workspace (bytes)
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("q_dtype")
                                  .Attr<int32_t>("flags")
                                  .Attr<int32_t>("rht_sign_mask"));

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_dequantize), LOWBIT_NAME(Dequantize),
                              LOWBIT_BIND()
                                  .Arg<ffi::AnyBuffer>()   // data
                                  .Arg<ffi::AnyBuffer>()   // scale_inv
                                  .Arg<ffi::AnyBuffer>()   // global scale_inv (1,) or (0,)
                                  .Ret<ffi::AnyBuffer>()   // out (R, C)
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("q_dtype")
                                  .Attr<int32_t>("flags")
                                  .Attr<int32_t>("rht_sign_mask"));

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_grouped_quantize), LOWBIT_NAME(GroupedQuantize),
                              LOWBIT_BIND()
                                  .Arg<ffi::AnyBuffer>()          // x (M, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group sizes (G,)
                                  .Arg<ffi::AnyBuffer>()          // scale (G,) or (0,)
                                  .Ret<ffi::AnyBuffer>()          // data
                                  .Ret<ffi::AnyBuffer>()          // scale_inv
                                  .Ret<ffi::AnyBuffer>()          // colwise data
                                  .Ret<ffi::AnyBuffer>()          // colwise scale_inv
                                  .Ret<ffi::AnyBuffer>()          // amax (G,)
                                  .Ret<ffi::AnyBuffer>()          // workspace
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("q_dtype")
                                  .Attr<int32_t>("flags"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Workspace sizes, asked by Python at trace time so the workspace can be an ordinary XLA result
// (stable across CUDA-graph replays, unlike per-call scratch).
LOWBIT_EXPORT int64_t lowbit_quantize_workspace_bytes(int64_t mode, int64_t q_dtype, int64_t flags,
                                                      int64_t x_dtype, int64_t rows, int64_t cols) {
  QuantizeParams p;
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.x_dtype = static_cast<DType>(x_dtype);
  p.rows = rows;
  p.cols = cols;
  p.rowwise = flags & kRowwise;
  p.colwise = flags & kColwise;
  p.rht = flags & kRht;
  p.dbias = (flags & kDbias) ? reinterpret_cast<void*>(1) : nullptr;
  p.sr_seed = (flags & kStochastic) ? reinterpret_cast<const uint32_t*>(4) : nullptr;
  return static_cast<int64_t>(quantize_workspace_bytes(p));
}

LOWBIT_EXPORT int64_t lowbit_grouped_quantize_workspace_bytes(int64_t mode, int64_t q_dtype,
                                                              int64_t flags, int64_t x_dtype,
                                                              int64_t rows, int64_t cols,
                                                              int64_t num_groups) {
  GroupedQuantizeParams p;
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.x_dtype = static_cast<DType>(x_dtype);
  p.rows = rows;
  p.cols = cols;
  p.num_groups = num_groups;
  p.rowwise = flags & kRowwise;
  p.colwise = flags & kColwise;
  return static_cast<int64_t>(grouped_quantize_workspace_bytes(p));
}
#endif
