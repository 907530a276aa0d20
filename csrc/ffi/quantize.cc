// FFI handlers of the quantization family: quantize (+dbias), dequantize, grouped quantize.
// Each handler is written once (ffi_common.h) and compiled into liblowbit_cpu and, with
// LOWBIT_WITH_CUDA, into liblowbit_cuda. Handlers only decode buffers and attributes; kernels do
// the math.
#include "lowbit/quantize.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// x1, x2: further parts of x along the columns ((0,) when x is whole): the quantized tensor is
// the concatenation [x | x1 | x2], each part (R, C) with the same dtype.
ffi::Error Quantize(LOWBIT_PLATFORM_CTX Buf x, Buf x1, Buf x2, Buf scale, Buf seed, Ret data,
                    Ret scale_inv, Ret cw_data, Ret cw_scale_inv, Ret amax, Ret global_scale_inv,
                    Ret dbias, Ret workspace, int32_t mode, int32_t q_dtype, int32_t flags,
                    int32_t rht_sign_mask, float amax_epsilon) {
  QuantizeParams p;
  if (!dims_2d(x, &p.rows, &p.cols)) return to_error(Status::Invalid("quantize: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p.x_dtype))
    return to_error(Status::Invalid("quantize: unsupported input dtype"));
  p.x = x.untyped_data();
  if (x1.element_count() != 0) {
    p.x_parts[0] = x.untyped_data();
    p.n_parts = 1;
    for (const Buf* part : {&x1, &x2}) {
      if (part->element_count() == 0) continue;
      int64_t r = 0, c = 0;
      if (!dims_2d(*part, &r, &c) || r != p.rows || c != p.cols ||
          part->element_type() != x.element_type())
        return to_error(Status::Invalid("quantize: the parts of x must share shape and dtype"));
      p.x_parts[p.n_parts++] = part->untyped_data();
    }
    p.part_cols = p.cols;
    p.cols *= p.n_parts;
  }
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.rowwise = flags & abi::kQuantizeRowwise;
  p.colwise = flags & abi::kQuantizeColwise;
  p.rht = flags & abi::kQuantizeRht;
  p.rht_sign_mask = static_cast<uint32_t>(rht_sign_mask & abi::kRhtSignMaskBits);
  p.power_2_scale = flags & abi::kQuantizePow2;
  p.amax_epsilon = amax_epsilon;
  p.scale = in_or_null<float>(scale);
  p.sr_seed = (flags & abi::kQuantizeStochastic) && seed.element_count() >= 2
                  ? static_cast<const uint32_t*>(seed.untyped_data())
                  : nullptr;
  p.data = ptr_or_null<void>(data);
  p.scale_inv = ptr_or_null<void>(scale_inv);
  p.colwise_data = ptr_or_null<void>(cw_data);
  p.colwise_scale_inv = ptr_or_null<void>(cw_scale_inv);
  p.amax = ptr_or_null<float>(amax);
  p.global_scale_inv = ptr_or_null<float>(global_scale_inv);
  p.dbias = (flags & abi::kQuantizeDbias) ? ptr_or_null<void>(dbias) : nullptr;
  p.workspace = ptr_or_null<void>(workspace);
  if (auto err = to_error(validate(p)); err.failure()) return err;
  LOWBIT_CHECK_WORKSPACE(workspace, quantize_workspace_bytes(p), "quantize");
  return to_error(LOWBIT_RUN(quantize, p));
}

ffi::Error Dequantize(LOWBIT_PLATFORM_CTX Buf data, Buf scale_inv, Buf global_scale_inv, Ret out,
                      int32_t mode, int32_t q_dtype, int32_t flags, int32_t rht_sign_mask) {
  DequantizeParams p;
  if (!dims_2d(*out, &p.rows, &p.cols))
    return to_error(Status::Invalid("dequantize: output must be 2-D"));
  if (!to_dtype(out->element_type(), &p.out_dtype))
    return to_error(Status::Invalid("dequantize: unsupported output dtype"));
  p.data = data.untyped_data();
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.scale_inv = scale_inv.untyped_data();
  p.global_scale_inv = in_or_null<float>(global_scale_inv);
  p.rht = flags & abi::kQuantizeRht;
  p.rht_sign_mask = static_cast<uint32_t>(rht_sign_mask & abi::kRhtSignMaskBits);
  p.out = out->untyped_data();
  p.data_elems = static_cast<int64_t>(data.element_count());
  p.scale_inv_elems = static_cast<int64_t>(scale_inv.element_count());
  p.global_scale_inv_elems = static_cast<int64_t>(global_scale_inv.element_count());
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(dequantize, p));
}

ffi::Error GroupedQuantize(LOWBIT_PLATFORM_CTX Buf x, ffi::Buffer<ffi::S32> group_sizes, Buf scale,
                           Ret data, Ret scale_inv, Ret cw_data, Ret cw_scale_inv, Ret amax,
                           Ret workspace, int32_t mode, int32_t q_dtype, int32_t flags,
                           float amax_epsilon) {
  GroupedQuantizeParams p;
  if (!dims_2d(x, &p.rows, &p.cols))
    return to_error(Status::Invalid("grouped_quantize: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p.x_dtype))
    return to_error(Status::Invalid("grouped_quantize: unsupported input dtype"));
  p.x = x.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.num_groups = static_cast<int64_t>(group_sizes.element_count());
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.rowwise = flags & abi::kQuantizeRowwise;
  p.colwise = flags & abi::kQuantizeColwise;
  p.power_2_scale = flags & abi::kQuantizePow2;
  p.amax_epsilon = amax_epsilon;
  p.scale = in_or_null<float>(scale);
  p.data = ptr_or_null<void>(data);
  p.scale_inv = ptr_or_null<void>(scale_inv);
  p.colwise_data = ptr_or_null<void>(cw_data);
  p.colwise_scale_inv = ptr_or_null<void>(cw_scale_inv);
  p.amax = ptr_or_null<float>(amax);
  p.workspace = ptr_or_null<void>(workspace);
  if (auto err = to_error(validate(p)); err.failure()) return err;
  LOWBIT_CHECK_WORKSPACE(workspace, grouped_quantize_workspace_bytes(p), "grouped_quantize");
  return to_error(LOWBIT_RUN(grouped_quantize, p));
}

}  // namespace

// The handler symbols must be visible although the library builds with -fvisibility=hidden.
#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_quantize, Quantize,
               LOWBIT_BIND()
                   .Arg<Buf>()  // x (R, C), or its first part
                   .Arg<Buf>()  // x's second part or (0,)
                   .Arg<Buf>()  // x's third part or (0,)
                   .Arg<Buf>()  // scale (1,) f32 or (0,)
                   .Arg<Buf>()  // sr seed (2,) u32 or (0,)
                   .Ret<Buf>()  // data
                   .Ret<Buf>()  // scale_inv
                   .Ret<Buf>()  // colwise data
                   .Ret<Buf>()  // colwise scale_inv
                   .Ret<Buf>()  // amax (1,)
                   .Ret<Buf>()  // global scale_inv (2,) or (0,)
                   .Ret<Buf>()  // dbias (C,) or (0,)
                   .Ret<Buf>()  // workspace (bytes)
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("flags")
                   .Attr<int32_t>("rht_sign_mask")
                   .Attr<float>("amax_epsilon"));

LOWBIT_HANDLER(lowbit_dequantize, Dequantize,
               LOWBIT_BIND()
                   .Arg<Buf>()  // data
                   .Arg<Buf>()  // scale_inv
                   .Arg<Buf>()  // global scale_inv (1,) or (0,)
                   .Ret<Buf>()  // out (R, C)
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("flags")
                   .Attr<int32_t>("rht_sign_mask"));

LOWBIT_HANDLER(lowbit_grouped_quantize, GroupedQuantize,
               LOWBIT_BIND()
                   .Arg<Buf>()                    // x (M, K)
                   .Arg<ffi::Buffer<ffi::S32>>()  // group sizes (G,)
                   .Arg<Buf>()                    // scale (G,) or (0,)
                   .Ret<Buf>()                    // data
                   .Ret<Buf>()                    // scale_inv
                   .Ret<Buf>()                    // colwise data
                   .Ret<Buf>()                    // colwise scale_inv
                   .Ret<Buf>()                    // amax (G,)
                   .Ret<Buf>()                    // workspace
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("flags")
                   .Attr<float>("amax_epsilon"));

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
  p.rowwise = flags & abi::kQuantizeRowwise;
  p.colwise = flags & abi::kQuantizeColwise;
  p.rht = flags & abi::kQuantizeRht;
  p.dbias = (flags & abi::kQuantizeDbias) ? reinterpret_cast<void*>(1) : nullptr;
  p.sr_seed = (flags & abi::kQuantizeStochastic) ? reinterpret_cast<const uint32_t*>(4) : nullptr;
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
  p.rowwise = flags & abi::kQuantizeRowwise;
  p.colwise = flags & abi::kQuantizeColwise;
  return static_cast<int64_t>(grouped_quantize_workspace_bytes(p));
}
#endif
