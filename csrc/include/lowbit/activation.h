// Kernel-level interface of the activations, forward (optionally fused with FP8 tensor-scaled
// quantization of the output) and backward (optionally fused with dbias and FP8 quantization of
// the input gradient).
//
// Shapes: the output has H columns. A plain activation reads x (rows, H); a gated one reads
// x (rows, 2H) whose columns [0, H) are the activation part a and [H, 2H) the linear part b:
// y = act(a) * b. Numerics (float32; CPU: expf/erff and IEEE division; CUDA: the MUFU 2^x and
// 1/x approximations, so CPU and GPU agree to a few float32 ulps, not bitwise):
//   sigmoid(z) = 1 / (1 + exp(-z))
//   gelu (tanh):  x * sigmoid(2u), u = 0.7978845608 (x + 0.044715 x^3)  (= 0.5 x (1 + tanh u),
//                 written so that it does not cancel in the tails)
//   gelu_exact:   0.5 x (1 + erf(x / sqrt 2))
//   silu:         x * sigmoid(x);      quick_gelu: x * sigmoid(1.702 x)
//   relu:         x < 0 ? 0 : x;       squared_relu: relu(x)^2;   linear: x
// y (or dx) is rounded once to x's dtype; fused FP8 copies are exactly
// lowbit.quantize(y_in_x_dtype) (and the fused dbias is lowbit.quantize_dbias's: column sums of
// the rounded dx accumulated in float32, rounded once). Current scaling runs a first pass that
// only computes the amax, then the fused pass (see norm.h).
// FP8 block scaling (kBlock1d / kBlock2d): the copies are exactly lowbit.quantize(_dbias) of
// the rounded result with power_2_scale / amax_epsilon, in the lowbit/block_scaling.h layouts;
// the CUDA kernels run one block cast that computes the values per element (activation.cu).
// Backward: plain dx = dy * act'(x); gated da = (dy * b) * act'(a), db = dy * act(a), dx = [da,
// db].
#pragma once

#include <cstddef>
#include <cstdint>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

// Values are part of the Python <-> C++ contract (src/lowbit/ops/activation.py).
enum class ActKind : int32_t {
  kLinear = abi::kActLinear,
  kGeluTanh = abi::kActGeluTanh,
  kGeluExact = abi::kActGeluExact,
  kRelu = abi::kActRelu,
  kSilu = abi::kActSilu,
  kQuickGelu = abi::kActQuickGelu,
  kSquaredRelu = abi::kActSquaredRelu,
};

struct ActFwdParams {
  const void* x = nullptr;  // (rows, gated ? 2H : H)
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;  // cols = H, the output width
  ActKind act = ActKind::kGeluTanh;
  bool gated = false;

  ScalingMode mode = ScalingMode::kNoScaling;  // or a tensor / FP8 block scaling mode
  DType q_dtype = DType::kE4M3;
  const float* scale = nullptr;  // delayed: (1,)
  bool power_2_scale = false;    // FP8 block scaling (as QuantizeParams)
  float amax_epsilon = 0.0f;

  void* y = nullptr;                   // (rows, H) in x_dtype
  uint8_t* data = nullptr;             // (rows, H) FP8
  uint8_t* colwise_data = nullptr;     // (H, rows) FP8
  float* scale_inv = nullptr;          // (1,); block: fp8_block_scale layout of (rows, H)
  float* colwise_scale_inv = nullptr;  // (1,); block: the layout of (H, rows)
  float* amax = nullptr;               // (1,), required with FP8
};

struct ActBwdParams {
  const void* dy = nullptr;  // (rows, H)
  const void* x = nullptr;   // (rows, gated ? 2H : H)
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;  // cols = H
  ActKind act = ActKind::kGeluTanh;
  bool gated = false;

  ScalingMode mode = ScalingMode::kNoScaling;
  DType q_dtype = DType::kE5M2;
  const float* scale = nullptr;
  bool power_2_scale = false;  // FP8 block scaling (as QuantizeParams)
  float amax_epsilon = 0.0f;

  // Outputs over dx of width W = gated ? 2H : H; null = not wanted.
  void* dx = nullptr;               // (rows, W) in x_dtype
  uint8_t* data = nullptr;          // (rows, W) FP8
  uint8_t* colwise_data = nullptr;  // (W, rows) FP8
  float* scale_inv = nullptr;
  float* colwise_scale_inv = nullptr;
  float* amax = nullptr;      // amax of the rounded dx; required with FP8
  void* dbias = nullptr;      // (W,) in x_dtype
  void* workspace = nullptr;  // CUDA: act_bwd_workspace_bytes()
};

// Re-checks shared by both backends (Python validates first, naming the argument).
inline Status act_check_common(DType x, int64_t rows, int64_t cols, ActKind act, ScalingMode mode,
                               DType q, bool fp8, const float* amax, const float* scale, bool pow2,
                               float eps) {
  if (x != DType::kF32 && x != DType::kBF16 && x != DType::kF16)
    return Status::Invalid("activation: x must be float32, bfloat16 or float16");
  if (rows < 0 || cols < 0) return Status::Invalid("activation: negative shape");
  if (int32_t(act) < 0 || int32_t(act) > int32_t(ActKind::kSquaredRelu))
    return Status::Invalid("activation: unknown activation");
  if (!is_fp8_block(mode) && (pow2 || eps != 0.0f))
    return Status::Invalid("activation: power_2_scale and amax_epsilon are FP8 block scaling only");
  if (!(eps >= 0.0f) || eps > 3.40282347e38f)
    return Status::Invalid("activation: amax_epsilon must be finite and >= 0");
  if (mode == ScalingMode::kNoScaling) {
    if (fp8)
      return Status::Invalid("activation: FP8 outputs need a tensor or FP8 block scaling mode");
    return Status::Ok();
  }
  if (!is_tensor_scaling(mode) && !is_fp8_block(mode))
    return Status::Invalid(
        "activation: fused quantization supports tensor and FP8 block scaling only");
  if (q != DType::kE4M3 && q != DType::kE5M2)
    return Status::Invalid("activation: q_dtype must be float8_e4m3fn or float8_e5m2");
  if (!amax) return Status::Invalid("activation: FP8 output needs the amax output");
  if (mode == ScalingMode::kDelayedTensor && !scale)
    return Status::Invalid("activation: delayed scaling needs scale");
  return Status::Ok();
}

inline Status validate(const ActFwdParams& p) {
  return act_check_common(p.x_dtype, p.rows, p.cols, p.act, p.mode, p.q_dtype,
                          p.data || p.colwise_data, p.amax, p.scale, p.power_2_scale,
                          p.amax_epsilon);
}

inline Status validate(const ActBwdParams& p) {
  return act_check_common(p.x_dtype, p.rows, p.cols, p.act, p.mode, p.q_dtype,
                          p.data || p.colwise_data, p.amax, p.scale, p.power_2_scale,
                          p.amax_epsilon);
}

Status act_fwd_cpu(const ActFwdParams& p);
Status act_bwd_cpu(const ActBwdParams& p);

size_t act_bwd_workspace_bytes(int64_t rows, int64_t cols, bool gated, bool dbias);
Status act_fwd_cuda(const ActFwdParams& p, void* stream);
Status act_bwd_cuda(const ActBwdParams& p, void* stream);

}  // namespace lowbit
