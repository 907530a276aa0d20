// FFI handlers of the activations: forward (optionally fused with FP8 tensor-scaled quantization)
// and backward (optionally fused with dbias and quantization of the gradient). Written once
// (ffi_common.h); compiled for the CPU library and, with LOWBIT_WITH_CUDA, for the CUDA library.
#include "lowbit/activation.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// x is (rows, W) with W = gated ? 2H : H; returns H in *cols.
ffi::Error act_dims(const Buf& x, bool gated, int64_t* rows, int64_t* cols, DType* dt) {
  int64_t w = 0;
  if (!dims_2d(x, rows, &w)) return to_error(Status::Invalid("activation: x must be 2-D"));
  if (!to_dtype(x.element_type(), dt))
    return to_error(Status::Invalid("activation: unsupported x dtype"));
  if (gated && w % 2)
    return to_error(Status::Invalid("activation: gated x needs an even last axis"));
  *cols = gated ? w / 2 : w;
  return ffi::Error::Success();
}

ffi::Error ActFwd(LOWBIT_PLATFORM_CTX Buf x, Buf scale, Ret y, Ret data, Ret scale_inv, Ret cw_data,
                  Ret cw_scale_inv, Ret amax, int32_t act, int32_t gated, int32_t mode,
                  int32_t q_dtype, int32_t power_2_scale, float amax_epsilon) {
  ActFwdParams p;
  p.gated = gated != 0;
  if (auto e = act_dims(x, p.gated, &p.rows, &p.cols, &p.x_dtype); e.failure()) return e;
  p.x = x.untyped_data();
  p.act = static_cast<ActKind>(act);
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.power_2_scale = power_2_scale != 0;
  p.amax_epsilon = amax_epsilon;
  p.scale = in_or_null<float>(scale);
  p.y = ptr_or_null<void>(y);
  p.data = ptr_or_null<uint8_t>(data);
  p.scale_inv = ptr_or_null<float>(scale_inv);
  p.colwise_data = ptr_or_null<uint8_t>(cw_data);
  p.colwise_scale_inv = ptr_or_null<float>(cw_scale_inv);
  p.amax = ptr_or_null<float>(amax);
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(act_fwd, p));
}

ffi::Error ActBwd(LOWBIT_PLATFORM_CTX Buf dy, Buf x, Buf scale, Ret dx, Ret data, Ret scale_inv,
                  Ret cw_data, Ret cw_scale_inv, Ret amax, Ret dbias, Ret workspace, int32_t act,
                  int32_t gated, int32_t mode, int32_t q_dtype, int32_t power_2_scale,
                  float amax_epsilon) {
  ActBwdParams p;
  p.gated = gated != 0;
  if (auto e = act_dims(x, p.gated, &p.rows, &p.cols, &p.x_dtype); e.failure()) return e;
  if (dy.element_type() != x.element_type() || dy.element_count() != size_t(p.rows * p.cols))
    return to_error(Status::Invalid("activation_bwd: dy must be (rows, H) in x's dtype"));
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.act = static_cast<ActKind>(act);
  p.mode = static_cast<ScalingMode>(mode);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.power_2_scale = power_2_scale != 0;
  p.amax_epsilon = amax_epsilon;
  p.scale = in_or_null<float>(scale);
  p.dx = ptr_or_null<void>(dx);
  p.data = ptr_or_null<uint8_t>(data);
  p.scale_inv = ptr_or_null<float>(scale_inv);
  p.colwise_data = ptr_or_null<uint8_t>(cw_data);
  p.colwise_scale_inv = ptr_or_null<float>(cw_scale_inv);
  p.amax = ptr_or_null<float>(amax);
  p.dbias = ptr_or_null<void>(dbias);
  p.workspace = ptr_or_null<void>(workspace);
  if (auto err = to_error(validate(p)); err.failure()) return err;
  LOWBIT_CHECK_WORKSPACE(workspace,
                         act_bwd_workspace_bytes(p.rows, p.cols, p.gated, p.dbias != nullptr),
                         "activation_bwd");
  return to_error(LOWBIT_RUN(act_bwd, p));
}

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_act_fwd, ActFwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // x (R, H) or (R, 2H)
                   .Arg<Buf>()  // scale (1,) f32 or (0,)
                   .Ret<Buf>()  // y (R, H) or (0,)
                   .Ret<Buf>()  // rowwise FP8 (R, H) or (0,)
                   .Ret<Buf>()  // scale_inv (1,), block scales, or (0,)
                   .Ret<Buf>()  // colwise FP8 (H, R) or (0,)
                   .Ret<Buf>()  // colwise scale_inv (1,) or (0,)
                   .Ret<Buf>()  // amax (1,) or (0,)
                   .Attr<int32_t>("act")
                   .Attr<int32_t>("gated")
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("power_2_scale")
                   .Attr<float>("amax_epsilon"));

LOWBIT_HANDLER(lowbit_act_bwd, ActBwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // dy (R, H)
                   .Arg<Buf>()  // x (R, W)
                   .Arg<Buf>()  // scale (1,) f32 or (0,)
                   .Ret<Buf>()  // dx (R, W) or (0,)
                   .Ret<Buf>()  // rowwise FP8 (R, W) or (0,)
                   .Ret<Buf>()  // scale_inv (1,), block scales, or (0,)
                   .Ret<Buf>()  // colwise FP8 (W, R) or (0,)
                   .Ret<Buf>()  // colwise scale_inv (1,) or (0,)
                   .Ret<Buf>()  // amax (1,) or (0,)
                   .Ret<Buf>()  // dbias (W,) or (0,)
                   .Ret<Buf>()  // workspace (bytes)
                   .Attr<int32_t>("act")
                   .Attr<int32_t>("gated")
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q_dtype")
                   .Attr<int32_t>("power_2_scale")
                   .Attr<float>("amax_epsilon"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Scratch of the backward (per-tile dbias partials), asked by Python at trace time.
LOWBIT_EXPORT int64_t lowbit_act_bwd_workspace_bytes(int64_t rows, int64_t cols, int64_t gated,
                                                     int64_t dbias) {
  return static_cast<int64_t>(act_bwd_workspace_bytes(rows, cols, gated != 0, dbias != 0));
}
#endif
