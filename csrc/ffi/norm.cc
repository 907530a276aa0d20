// FFI handlers of LayerNorm / RMSNorm (forward, optionally fused with FP8 tensor-scaled
// quantization; backward). Compiled for the CPU library and, with LOWBIT_WITH_CUDA, for the CUDA
// library. Handlers only decode buffers and attributes; kernels do the math.
#include "lowbit/norm.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

template <typename T>
const T* in_or_null(const ffi::AnyBuffer& b) {
  return b.element_count() ? static_cast<const T*>(b.untyped_data()) : nullptr;
}

ffi::Error build_fwd(ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta, ffi::AnyBuffer scale,
                     ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& data,
                     ffi::Result<ffi::AnyBuffer>& scale_inv, ffi::Result<ffi::AnyBuffer>& cw_data,
                     ffi::Result<ffi::AnyBuffer>& cw_scale_inv, ffi::Result<ffi::AnyBuffer>& amax,
                     ffi::Result<ffi::AnyBuffer>& mean, ffi::Result<ffi::AnyBuffer>& rsigma, int32_t norm_type,
                     int32_t zero_centered, float epsilon, int32_t mode, int32_t q_dtype, NormFwdParams* p) {
  if (!dims_2d(x, &p->rows, &p->cols)) return to_error(Status::Invalid("norm: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p->x_dtype)) return to_error(Status::Invalid("norm: unsupported x dtype"));
  if (gamma.element_type() != ffi::DataType::F32 || gamma.element_count() != size_t(p->cols))
    return to_error(Status::Invalid("norm: gamma must be float32 (cols,)"));
  if (beta.element_count() && (beta.element_type() != ffi::DataType::F32 || beta.element_count() != size_t(p->cols)))
    return to_error(Status::Invalid("norm: beta must be float32 (cols,)"));
  if (rsigma->element_count() != size_t(p->rows)) return to_error(Status::Invalid("norm: rsigma must be (rows,)"));
  p->x = x.untyped_data();
  p->gamma = static_cast<const float*>(gamma.untyped_data());
  p->beta = in_or_null<float>(beta);
  p->scale = in_or_null<float>(scale);
  p->type = static_cast<NormType>(norm_type);
  p->zero_centered_gamma = zero_centered != 0;
  p->epsilon = epsilon;
  p->mode = static_cast<ScalingMode>(mode);
  p->q_dtype = static_cast<DType>(q_dtype);
  p->y = ptr_or_null<void>(y);
  p->data = ptr_or_null<uint8_t>(data);
  p->scale_inv = ptr_or_null<float>(scale_inv);
  p->colwise_data = ptr_or_null<uint8_t>(cw_data);
  p->colwise_scale_inv = ptr_or_null<float>(cw_scale_inv);
  p->amax = ptr_or_null<float>(amax);
  // Empty row sets still need a non-null statistics pointer for validation.
  static float dummy = 0.0f;
  p->mean = p->type == NormType::kLayerNorm ? (p->rows ? ptr_or_null<float>(mean) : &dummy) : nullptr;
  p->rsigma = p->rows ? ptr_or_null<float>(rsigma) : &dummy;
  if (p->type == NormType::kLayerNorm && mean->element_count() != size_t(p->rows))
    return to_error(Status::Invalid("norm: mean must be (rows,) for layernorm"));
  return to_error(validate(*p));
}

ffi::Error build_bwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                     ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer>& dx, ffi::Result<ffi::AnyBuffer>& dgamma,
                     ffi::Result<ffi::AnyBuffer>& dbeta, ffi::Result<ffi::AnyBuffer>& ws, int32_t norm_type,
                     int32_t zero_centered, NormBwdParams* p) {
  if (!dims_2d(x, &p->rows, &p->cols)) return to_error(Status::Invalid("norm_bwd: x must be 2-D"));
  if (!to_dtype(x.element_type(), &p->x_dtype) || dy.element_type() != x.element_type() ||
      dx->element_type() != x.element_type())
    return to_error(Status::Invalid("norm_bwd: dy, x and dx must share a float dtype"));
  if (dy.element_count() != x.element_count() || gamma.element_count() != size_t(p->cols) ||
      rsigma.element_count() != size_t(p->rows) || dgamma->element_count() != size_t(p->cols))
    return to_error(Status::Invalid("norm_bwd: inconsistent shapes"));
  p->type = static_cast<NormType>(norm_type);
  if (p->type == NormType::kLayerNorm && mean.element_count() != size_t(p->rows))
    return to_error(Status::Invalid("norm_bwd: mean must be (rows,) for layernorm"));
  static float dummy = 0.0f;
  p->dy = dy.untyped_data();
  p->x = x.untyped_data();
  p->mean = p->type == NormType::kLayerNorm ? (p->rows ? static_cast<const float*>(mean.untyped_data()) : &dummy)
                                            : nullptr;
  p->rsigma = p->rows ? static_cast<const float*>(rsigma.untyped_data()) : &dummy;
  p->gamma = static_cast<const float*>(gamma.untyped_data());
  p->zero_centered_gamma = zero_centered != 0;
  p->dx = ptr_or_null<void>(dx);
  p->dgamma = ptr_or_null<float>(dgamma);
  p->dbeta = ptr_or_null<float>(dbeta);
  p->workspace = ptr_or_null<void>(ws);
  return to_error(validate(*p));
}

#if LOWBIT_WITH_CUDA

ffi::Error NormFwdCuda(cudaStream_t st, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                       ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> data,
                       ffi::Result<ffi::AnyBuffer> si, ffi::Result<ffi::AnyBuffer> cw,
                       ffi::Result<ffi::AnyBuffer> csi, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rsigma, int32_t norm_type,
                       int32_t zero_centered, float epsilon, int32_t mode, int32_t q_dtype) {
  NormFwdParams p;
  auto err = build_fwd(x, gamma, beta, scale, y, data, si, cw, csi, amax, mean, rsigma, norm_type, zero_centered,
                       epsilon, mode, q_dtype, &p);
  if (err.failure()) return err;
  return to_error(norm_fwd_cuda(p, st));
}

ffi::Error NormBwdCuda(cudaStream_t st, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                       ffi::AnyBuffer rsigma, ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                       ffi::Result<ffi::AnyBuffer> ws, int32_t norm_type, int32_t zero_centered) {
  NormBwdParams p;
  auto err = build_bwd(dy, x, mean, rsigma, gamma, dx, dgamma, dbeta, ws, norm_type, zero_centered, &p);
  if (err.failure()) return err;
  if (ws->size_bytes() < norm_bwd_workspace_bytes(p.rows, p.cols))
    return to_error(Status::Invalid("norm_bwd: workspace too small"));
  return to_error(norm_bwd_cuda(p, st));
}

#define LOWBIT_NAME(n) n##Cuda

#else  // CPU

ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> data,
                      ffi::Result<ffi::AnyBuffer> si, ffi::Result<ffi::AnyBuffer> cw,
                      ffi::Result<ffi::AnyBuffer> csi, ffi::Result<ffi::AnyBuffer> amax,
                      ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rsigma, int32_t norm_type,
                      int32_t zero_centered, float epsilon, int32_t mode, int32_t q_dtype) {
  NormFwdParams p;
  auto err = build_fwd(x, gamma, beta, scale, y, data, si, cw, csi, amax, mean, rsigma, norm_type, zero_centered,
                       epsilon, mode, q_dtype, &p);
  if (err.failure()) return err;
  return to_error(norm_fwd_cpu(p));
}

ffi::Error NormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                      ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                      ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> ws, int32_t norm_type,
                      int32_t zero_centered) {
  NormBwdParams p;
  auto err = build_bwd(dy, x, mean, rsigma, gamma, dx, dgamma, dbeta, ws, norm_type, zero_centered, &p);
  if (err.failure()) return err;
  return to_error(norm_bwd_cpu(p));
}

#define LOWBIT_NAME(n) n##Cpu

#endif

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_norm_fwd), LOWBIT_NAME(NormFwd),
                      LOWBIT_BIND()
                          .Arg<ffi::AnyBuffer>()  // x (R, C)
                          .Arg<ffi::AnyBuffer>()  // gamma (C,) f32
                          .Arg<ffi::AnyBuffer>()  // beta (C,) f32 or (0,)
                          .Arg<ffi::AnyBuffer>()  // scale (1,) f32 or (0,)
                          .Ret<ffi::AnyBuffer>()  // y (R, C) or (0,)
                          .Ret<ffi::AnyBuffer>()  // rowwise FP8 (R, C) or (0,)
                          .Ret<ffi::AnyBuffer>()  // scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise FP8 (C, R) or (0,)
                          .Ret<ffi::AnyBuffer>()  // colwise scale_inv (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // amax (1,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // mean (R,) or (0,)
                          .Ret<ffi::AnyBuffer>()  // rsigma (R,)
                          .Attr<int32_t>("norm_type")
                          .Attr<int32_t>("zero_centered_gamma")
                          .Attr<float>("epsilon")
                          .Attr<int32_t>("mode")
                          .Attr<int32_t>("q_dtype"));

LOWBIT_DEFINE_HANDLER(LOWBIT_SYMBOL(lowbit_norm_bwd), LOWBIT_NAME(NormBwd),
                      LOWBIT_BIND()
                          .Arg<ffi::AnyBuffer>()  // dy (R, C)
                          .Arg<ffi::AnyBuffer>()  // x (R, C)
                          .Arg<ffi::AnyBuffer>()  // mean (R,) or (0,)
                          .Arg<ffi::AnyBuffer>()  // rsigma (R,)
                          .Arg<ffi::AnyBuffer>()  // gamma (C,) f32
                          .Ret<ffi::AnyBuffer>()  // dx (R, C)
                          .Ret<ffi::AnyBuffer>()  // dgamma (C,) f32
                          .Ret<ffi::AnyBuffer>()  // dbeta (C,) f32 or (0,)
                          .Ret<ffi::AnyBuffer>()  // workspace (bytes)
                          .Attr<int32_t>("norm_type")
                          .Attr<int32_t>("zero_centered_gamma"));

#pragma GCC visibility pop

#if LOWBIT_WITH_CUDA
// Scratch of the backward (per-block dgamma/dbeta partials), asked by Python at trace time.
LOWBIT_EXPORT int64_t lowbit_norm_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  return static_cast<int64_t>(norm_bwd_workspace_bytes(rows, cols));
}
#endif
