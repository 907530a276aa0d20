// FFI handlers of the fused softmax (scaled, scaled + masked, scaled + causal) and its backward.
// Written once (ffi_common.h); compiled for the CPU library and, with LOWBIT_WITH_CUDA, for the
// CUDA library.
#include "lowbit/softmax.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

// x is 4-D (B, H, Sq, Sk); the mask is 4-D with each axis 1 (broadcast) or x's size, or (0,).
ffi::Error SoftmaxFwd(LOWBIT_PLATFORM_CTX Buf x, Buf mask, Ret y, int32_t type, float scale) {
  SoftmaxFwdParams p;
  auto d = x.dimensions();
  if (d.size() != 4) return to_error(Status::Invalid("softmax: x must be 4-D"));
  if (!to_dtype(x.element_type(), &p.dtype))
    return to_error(Status::Invalid("softmax: unsupported dtype"));
  for (int i = 0; i < 4; ++i) p.dims[i] = d[i];
  p.type = static_cast<SoftmaxType>(type);
  p.scale = scale;
  p.x = x.untyped_data();
  p.y = y->untyped_data();
  if (p.type == SoftmaxType::kMasked) {
    auto m = mask.dimensions();
    if (m.size() != 4) return to_error(Status::Invalid("softmax: mask must be 4-D"));
    int64_t stride = 1;
    for (int i = 3; i >= 0; --i) {
      if (m[i] != 1 && m[i] != d[i])
        return to_error(Status::Invalid("softmax: mask does not broadcast to x"));
      p.mask_strides[i] = m[i] == 1 ? 0 : stride;
      stride *= m[i];
    }
    static const uint8_t kNone = 0;
    p.mask = mask.element_count() ? static_cast<const uint8_t*>(mask.untyped_data()) : &kNone;
  }
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(softmax_fwd, p));
}

ffi::Error SoftmaxBwd(LOWBIT_PLATFORM_CTX Buf dy, Buf y, Ret dx, float scale) {
  SoftmaxBwdParams p;
  if (!dims_2d(y, &p.rows, &p.cols)) return to_error(Status::Invalid("softmax_bwd: y must be 2-D"));
  if (!to_dtype(y.element_type(), &p.dtype) || dy.element_type() != y.element_type() ||
      dy.element_count() != y.element_count())
    return to_error(Status::Invalid("softmax_bwd: dy and y must match"));
  p.dy = dy.untyped_data();
  p.y = y.untyped_data();
  p.dx = dx->untyped_data();
  p.scale = scale;
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(softmax_bwd, p));
}

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_softmax_fwd, SoftmaxFwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // x (B, H, Sq, Sk)
                   .Arg<Buf>()  // mask uint8, 4-D broadcastable, or (0,)
                   .Ret<Buf>()  // y, like x
                   .Attr<int32_t>("softmax_type")
                   .Attr<float>("scale_factor"));

LOWBIT_HANDLER(lowbit_softmax_bwd, SoftmaxBwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // dy (rows, Sk)
                   .Arg<Buf>()  // y (rows, Sk)
                   .Ret<Buf>()  // dx (rows, Sk)
                   .Attr<float>("scale_factor"));

#pragma GCC visibility pop
