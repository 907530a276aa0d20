// FFI handlers of the activations: forward (optionally fused with FP8 tensor-scaled quantization)
// and backward (optionally fused with dbias and quantization of the gradient). Compiled for the
// CPU library and, with LOWBIT_WITH_CUDA, for the CUDA library.
#include "lowbit/activation.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

const float* scale_or_null(const ffi::AnyBuffer& b) {
  return b.element_count() ? static_cast<const float*>(b.untyped_data()) : nullptr;
}

// x is (rows, W) with W = gated ? 2H : H; returns H in *cols.
ffi::Error act_dims(const ffi::AnyBuffer& x, bool gated, int64_t* rows, int64_t* cols, DType* dt) {
  int64_t w = 0;
  if (!dims_2d(x, rows, &w)) return to_error(Status::Invalid("activation: x must be 2-D"));
  if (!to_dtype(x.element_type(), dt)) return to_error(Status::Invalid("activation: unsupported x dtype"));
  if (gated && w % 2) return to_error(Status::Invalid("activation: gated x needs an even last axis"));
  *cols = gated ? w / 2 : w;
  return ffi::Error::Success();
}

ffi::Error build_fwd(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer>& y,
                     ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::AnyBuffer>& si,
                     ffi::Result<ffi::AnyBuffer>& cw, ffi::Result<ffi::AnyBuffer>& csi,
                     ffi::Result<ffi::AnyBuffer>& amax, int32_t act, int32_t gated, int32_t mode,
                     int32_t q_dtype, ActFwdParams* p) {
  p->gated = gated != 0;
  if (auto e = act_dims(x, p->gated, &p->rows, &p->cols, &p->x_dtype); e.failure()) return e;
  p->x = x.untyped_data();
  p->act = static_cast<ActKind>(act);
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->scale = scale_or_null(scale);
  p->y = ptr_or_null<void>(y);
  p->data = ptr_or_null<uint8_t>(data);
  p->scale_inv = ptr_or_null<float>(si);
  p->colwise_data = ptr_or_null<uint8_t>(cw);
  p->colwise_scale_inv = ptr_or_null<float>(csi);
  p->amax = ptr_or_null<float>(amax);
  return to_error(validate(*p));
}

ffi::Error build_bwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer>& dx,
                     ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::AnyBuffer>& si,
                     ffi::Result<ffi::AnyBuffer>& cw, ffi::Result<ffi::AnyBuffer>& csi,
                     ffi::Result<ffi::AnyBuffer>& amax, ffi::Result<ffi::AnyBuffer>& dbias,
                     ffi::Result<ffi::AnyBuffer>& ws, int32_t act, int32_t gated, int32_t mode, int32_t q_dtype,
                     ActBwdParams* p) {
  p->gated = gated != 0;
  if (auto e = act_dims(x, p->gated, &p->rows, &p->cols, &p->x_dtype); e.failure()) return e;
  if (dy.element_type() != x.element_type() || dy.element_count() != size_t(p->rows * p->cols))
    return to_error(Status::Invalid("activation_bwd: dy must be (rows, H) in x's dtype"));
  p->dy = dy.untyped_data();
  p->x = x.untyped_data();
  p->act = static_cast<ActKind>(act);
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->scale = scale_or_null(scale);
  p->dx = ptr_or_null<void>(dx);
  p->data = ptr_or_null<uint8_t>(data);
  p->scale_inv = ptr_or_null<float>(si);
  p->colwise_data = ptr_or_null<uint8_t>(cw);
  p->colwise_scale_inv = ptr_or_null<float>(csi);
  p->amax = ptr_or_null<float>(amax);
  p->dbias = ptr_or_null<void>(dbias);
  p->workspace = ptr_or_null<void>(ws);
  return to_error(validate(*p));
}

#if LOWBIT_WITH_CUDA

ffi::Error ActFwdCuda(cudaStream_t st, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> si,
                      ffi::Result<ffi::AnyBuffer> cw, ffi::Result<ffi::AnyBuffer> csi,
                      ffi::Result<ffi::AnyBuffer> amax, int32_t act, int32_t gated, int32_t mode, int32_t q_dtype) {
  ActFwdParams p;
  auto err = build_fwd(x, scale, y, data, si, cw, csi, amax, act, gated, mode, q_dtype, &p);
  if (err.failure()) return err;
  return to_error(act_fwd_cuda(p, st));
}

ffi::Error ActBwdCuda(cudaStream_t st, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> data,
                      ffi::Result<ffi::AnyBuffer> si, ffi::Result<ffi::AnyBuffer> cw,
                      ffi::Result<ffi::AnyBuffer> csi, ffi::Result<ffi::AnyBuffer> amax,
                      ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> ws, int32_t act,
                      int32_t gated, int32_t mode, int32_t q_dtype) {
  ActBwdParams p;
  auto err = build_bwd(dy, x, scale, dx, data, si, cw, csi, amax, dbias, ws, act, gated, mode, q_dtype, &p);
  if (err.failure()) return err;
  if (ws->size_bytes() < act_bwd_workspace_bytes(p.rows, p.cols, p.gated, p.dbias != nullptr))
    return to_error(Status::Invalid("activation_bwd: workspace too small"));
  return to_error(act_bwd_cuda(p, st));
}

#define LOWBIT_NAME(n) n##Cuda

#else  // CPU

ffi::Error ActFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> si, ffi::Result<ffi::AnyBuffer> cw,
                     ffi::Result<ffi::AnyBuffer> csi, ffi::Result<ffi::AnyBuffer> amax, int32_t act, int32_t gated,
                     int32_t mode, int32_t q_dtype) {
  ActFwdParams p;
  auto err = build_fwd(x, scale, y, data, si, cw, csi, amax, act, gated, mode, q_dtype, &p);
  if (err.failure()) return err;
  return to_error(act_fwd_cpu(p));
}

ffi::Error ActBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> dx,
                     ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> si, ffi::Result<ffi::AnyBuffer> cw,
                     ffi::Result<ffi::AnyBuffer> csi, ffi::Result<ffi::AnyBuffer> amax,
                     ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> ws, int32_t act, int32_t gated,
                     int32_t mode, int32_t q_dtype) {
  ActBwdParams p;
  auto err = build_bwd(dy, x, scale, dx, data, si, cw, csi, amax, dbias, ws, act, gated, mode, q_dtype, &p);
  if (err.failure()) return err;
  return to_error(act_bwd_cpu(p));
}

#define LOWBIT_NAME(n) n##Cpu

#endif

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_act_fwd), LOWBIT_NAME(ActFwd),
                      LOWBIT_BIND()
                          .Arg<ffi::AnyBuffer>()  // x (R, H) or (R, 2H)
                          .Arg<ffi::AnyBuffer>()  // scale (1,) f32 or (0,)
                          .Ret<ffi::AnyBuffer>()  // y (R, H) or (0,)
                          .Ret<ffi::AnyBuffer>()  // rowwise FP8 (R, H) or (0,)
                          .Ret<ffi::AnyBuffer>()  // scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise FP8 (H, R) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // amax (1,) or (0,)
                          .Attr<int32_t>("act")
                          .Attr<int32_t>("gated")
                          .Attr<int32_t>("mode")
                          .Attr<int32_t>("q_dtype"));

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_act_bwd), LOWBIT_NAME(ActBwd),
                      LOWBIT_BIND()
                          .Arg<ffi::AnyBuffer>()  // dy (R, H)
                          .Arg<ffi::AnyBuffer>()  // x (R, W)
                          .Arg<ffi::AnyBuffer>()  // scale (1,) f32 or (0,)
                          .Ret<ffi::AnyBuffer>()  // dx (R, W) or (0,)
                          .Ret<ffi::AnyBuffer>()  // rowwise FP8 (R, W) or (0,)
                          .Ret<ffi::AnyBuffer>()  // scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise FP8 (W, R) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // amax (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // dbias (W,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // workspace (bytes)
                          .Attr<int32_t>("act")
                          .Attr<int32_t>("gated")
                          .Attr<int32_t>("mode")
                          .Attr<int32_t>("q_dtype"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Scratch of the backward (per-tile dbias partials), asked by Python at trace time.
LOWBIT_EXPORT int64_t lowbit_act_bwd_workspace_bytes(int64_t rows, int64_t cols, int64_t gated, int64_t dbias) {
  return static_cast<int64_t>(act_bwd_workspace_bytes(rows, cols, gated != 0, dbias != 0));
}
#endif
