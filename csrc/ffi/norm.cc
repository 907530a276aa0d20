// FFI handlers of LayerNorm / RMSNorm (forward, optionally fused with FP8 tensor-scaled
// quantization; backward). Written once (ffi_common.h); compiled for the CPU library and, with
// LOWBIT_WITH_CUDA, for the CUDA library. Handlers only decode buffers and attributes.
#include "lowbit/norm.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

ffi::Error NormFwd(LOWBIT_PLATFORM_CTX Buf x, Buf gamma, Buf beta, Buf scale, Ret y, Ret data,
                   Ret scale_inv, Ret cw_data, Ret cw_scale_inv, Ret amax, Ret mean, Ret rsigma,
                   int32_t norm_type, int32_t zero_centered, float epsilon, int32_t mode,
                   int32_t q_dtype, int32_t power_2_scale, float amax_epsilon) {
  NormFwdParams p;
  if (!dims_2d(x, &p.rows, &p.cols)) return to_error(Status::Invalid("norm: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p.x_dtype))
    return to_error(Status::Invalid("norm: unsupported x dtype"));
  if (gamma.element_type() != ffi::DataType::F32 || gamma.element_count() != size_t(p.cols))
    return to_error(Status::Invalid("norm: gamma must be float32 (cols,)"));
  if (beta.element_count() &&
      (beta.element_type() != ffi::DataType::F32 || beta.element_count() != size_t(p.cols)))
    return to_error(Status::Invalid("norm: beta must be float32 (cols,)"));
  if (rsigma->element_count() != size_t(p.rows))
    return to_error(Status::Invalid("norm: rsigma must be (rows,)"));
  p.x = x.untyped_data();
  p.gamma = static_cast<const float*>(gamma.untyped_data());
  p.beta = in_or_null<float>(beta);
  p.scale = in_or_null<float>(scale);
  p.type = static_cast<NormType>(norm_type);
  p.zero_centered_gamma = zero_centered != 0;
  p.epsilon = epsilon;
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.power_2_scale = power_2_scale != 0;
  p.amax_epsilon = amax_epsilon;
  p.y = ptr_or_null<void>(y);
  p.data = ptr_or_null<uint8_t>(data);
  p.scale_inv = ptr_or_null<float>(scale_inv);
  p.colwise_data = ptr_or_null<uint8_t>(cw_data);
  p.colwise_scale_inv = ptr_or_null<float>(cw_scale_inv);
  p.amax = ptr_or_null<float>(amax);
  // Empty row sets still need a non-null statistics pointer for validation.
  static float dummy = 0.0f;
  p.mean = p.type == NormType::kLayerNorm ? (p.rows ? ptr_or_null<float>(mean) : &dummy) : nullptr;
  p.rsigma = p.rows ? ptr_or_null<float>(rsigma) : &dummy;
  if (p.type == NormType::kLayerNorm && mean->element_count() != size_t(p.rows))
    return to_error(Status::Invalid("norm: mean must be (rows,) for layernorm"));
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(norm_fwd, p));
}

ffi::Error NormBwd(LOWBIT_PLATFORM_CTX Buf dy, Buf x, Buf mean, Buf rsigma, Buf gamma, Ret dx,
                   Ret dgamma, Ret dbeta, Ret workspace, int32_t norm_type, int32_t zero_centered) {
  NormBwdParams p;
  if (!dims_2d(x, &p.rows, &p.cols)) return to_error(Status::Invalid("norm_bwd: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p.x_dtype) || dy.element_type() != x.element_type() ||
      dx->element_type() != x.element_type())
    return to_error(Status::Invalid("norm_bwd: dy, x and dx must share a float dtype"));
  if (dy.element_count() != x.element_count() || gamma.element_count() != size_t(p.cols) ||
      rsigma.element_count() != size_t(p.rows) || dgamma->element_count() != size_t(p.cols))
    return to_error(Status::Invalid("norm_bwd: inconsistent shapes"));
  p.type = static_cast<NormType>(norm_type);
  if (p.type == NormType::kLayerNorm && mean.element_count() != size_t(p.rows))
    return to_error(Status::Invalid("norm_bwd: mean must be (rows,) for layernorm"));
  static float dummy = 0.0f;
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.mean = p.type == NormType::kLayerNorm
               ? (p.rows ? static_cast<const float*>(mean.untyped_data()) : &dummy)
               : nullptr;
  p.rsigma = p.rows ? static_cast<const float*>(rsigma.untyped_data()) : &dummy;
  p.gamma = static_cast<const float*>(gamma.untyped_data());
  p.zero_centered_gamma = zero_centered != 0;
  p.dx = ptr_or_null<void>(dx);
  p.dgamma = ptr_or_null<float>(dgamma);
  p.dbeta = ptr_or_null<float>(dbeta);
  p.workspace = ptr_or_null<void>(workspace);
  if (auto err = to_error(validate(p)); err.failure()) return err;
  LOWBIT_CHECK_WORKSPACE(workspace, norm_bwd_workspace_bytes(p.rows, p.cols), "norm_bwd");
  return to_error(LOWBIT_RUN(norm_bwd, p));
}

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_norm_fwd, NormFwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // x (R, C)
                   .Arg<Buf>()  // gamma (C,) f32
                   .Arg<Buf>()  // beta (C,) f32 or (0,)
                   .Arg<Buf>()  // scale (1,) f32 or (0,)
                   .Ret<Buf>()  // y (R, C) or (0,)
                   .Ret<Buf>()  // rowwise FP8 (R, C) or (0,)
                   .Ret<Buf>()  // scale_inv (1,), block scales, or (0,)
                   .Ret<Buf>()  // colwise FP8 (C, R) or (0,)
                   .Ret<Buf>()  // colwise scale_inv (1,), block scales, or (0,)
                   .Ret<Buf>()  // amax (1,) or (0,)
                   .Ret<Buf>()  // mean (R,) or (0,)
                   .Ret<Buf>()  // rsigma (R,)
                   .Attr<int32_t>("norm_type")
                   .Attr<int32_t>("zero_centered_gamma")
                   .Attr<float>("epsilon")
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("power_2_scale")
                   .Attr<float>("amax_epsilon"));

LOWBIT_HANDLER(lowbit_norm_bwd, NormBwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // dy (R, C)
                   .Arg<Buf>()  // x (R, C)
                   .Arg<Buf>()  // mean (R,) or (0,)
                   .Arg<Buf>()  // rsigma (R,)
                   .Arg<Buf>()  // gamma (C,) f32
                   .Ret<Buf>()  // dx (R, C)
                   .Ret<Buf>()  // dgamma (C,) f32
                   .Ret<Buf>()  // dbeta (C,) f32 or (0,)
                   .Ret<Buf>()  // workspace (bytes)
                   .Attr<int32_t>("norm_type")
                   .Attr<int32_t>("zero_centered_gamma"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Scratch of the backward (per-block dgamma/dbeta partials), asked by Python at trace time.
LOWBIT_EXPORT int64_t lowbit_norm_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  return static_cast<int64_t>(norm_bwd_workspace_bytes(rows, cols));
}
#endif
