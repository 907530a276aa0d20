// Kernel-level interface of the fused softmax over the last axis of x (B, H, Sq, Sk).
//
// Numerics (float32): v_j = x_j * scale_factor; entries masked out (mask != 0, or j > i for the
// causal type, i the query index) are excluded; m = max of the remaining v_j; e_j = exp(v_j - m);
// y_j = e_j / sum(e), 0 for excluded entries; a row with nothing left (or whose maximum is -inf)
// is all zeros. Entries with v_j = -inf are excluded too (an additive mask). m is a
// NaN-propagating max: a NaN among the kept v_j (NaN data, or scale_factor = NaN) makes every
// kept y_j NaN, as jax.nn.softmax; m = +inf (inf - inf) likewise. Excluded entries are never read
// into m, so a masked-out NaN is harmless.
// y is rounded once to x's dtype. The CPU uses expf and a division; the GPU the MUFU
// 2^x and one reciprocal per row, so the two agree to a few float32 ulps.
// Backward from the saved output: dx_j = scale_factor * (y_j * (dy_j - sum_k dy_k y_k)); excluded
// entries have y = 0, hence dx = 0, so the backward needs no mask. A NaN row of y gives a NaN
// row of dx.
#pragma once

#include <cstdint>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

// Values are part of the Python <-> C++ contract (src/lowbit/ops/softmax.py).
enum class SoftmaxType : int32_t {
  kScaled = abi::kSoftmaxScaled,
  kMasked = abi::kSoftmaxScaledMasked,
  kCausal = abi::kSoftmaxScaledUpperTriangMasked,
};

struct SoftmaxFwdParams {
  const void* x = nullptr;
  DType dtype = DType::kBF16;
  int64_t dims[4] = {1, 1, 1, 1};  // B, H, Sq, Sk of x (row-major)
  float scale = 1.0f;
  SoftmaxType type = SoftmaxType::kScaled;
  // kMasked: uint8 mask (nonzero = masked out) indexed by mask_strides (elements, 0 where the
  // mask is broadcast along that axis).
  const uint8_t* mask = nullptr;
  int64_t mask_strides[4] = {0, 0, 0, 0};
  void* y = nullptr;
};

struct SoftmaxBwdParams {
  const void* dy = nullptr;
  const void* y = nullptr;
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  float scale = 1.0f;
  void* dx = nullptr;
};

// Re-checks shared by both backends (Python validates first, naming the argument).
inline bool softmax_dtype_ok(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

inline Status validate(const SoftmaxFwdParams& p) {
  if (!softmax_dtype_ok(p.dtype))
    return Status::Invalid("softmax: x must be float32, bfloat16 or float16");
  for (int i = 0; i < 4; ++i)
    if (p.dims[i] < 0) return Status::Invalid("softmax: negative shape");
  if (p.type == SoftmaxType::kMasked && !p.mask)
    return Status::Invalid("softmax: masked softmax needs a mask");
  if (p.type == SoftmaxType::kCausal && p.dims[2] != p.dims[3])
    return Status::Invalid("softmax: causal softmax needs Sq == Sk");
  if (int32_t(p.type) < 0 || int32_t(p.type) > 2)
    return Status::Invalid("softmax: unknown softmax type");
  return Status::Ok();
}

inline Status validate(const SoftmaxBwdParams& p) {
  if (!softmax_dtype_ok(p.dtype))
    return Status::Invalid("softmax_bwd: dtype must be float32, bfloat16 or float16");
  if (p.rows < 0 || p.cols < 0) return Status::Invalid("softmax_bwd: negative shape");
  return Status::Ok();
}

Status softmax_fwd_cpu(const SoftmaxFwdParams& p);
Status softmax_bwd_cpu(const SoftmaxBwdParams& p);

Status softmax_fwd_cuda(const SoftmaxFwdParams& p, void* stream);
Status softmax_bwd_cuda(const SoftmaxBwdParams& p, void* stream);

}  // namespace lowbit
