// Kernel-level interface of LayerNorm / RMSNorm, forward (optionally fused with FP8 tensor-scaled
// quantization of the output) and backward. Pointers are host pointers for the CPU kernels and
// device pointers for the CUDA kernels.
//
// Numerics (float32 throughout; CPU and GPU differ only in the last bits: the order of the row
// sums, and the GPU's fused multiply-adds where the CPU rounds the product and the sum apart):
//   layernorm: mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rsigma = 1 / sqrt(var + eps)
//              xhat = (x - mean) * rsigma   (GPU: fma(x, rsigma, -mean * rsigma))
//   rmsnorm:   rsigma = 1 / sqrt(sum(x^2) / C + eps),  xhat = x * rsigma   (mean is not output)
//   g = gamma (+ 1 when zero_centered_gamma), y = xhat * g (+ beta for layernorm)  (GPU: one fma)
//   y is rounded once to x's dtype. gamma/beta arrive as float32 (Python casts them).
// Fused quantization: the FP8 copies are exactly lowbit.quantize(y_in_x_dtype, mode, q_dtype):
// q = enc(float32(y_rounded) * scale), and `amax` is amax(y_rounded). Current scaling needs that
// amax before the cast, so the CUDA forward runs twice over x: a first pass computes y and its
// amax without storing the FP8 copies (it writes mean/rsigma and the optional y), the second
// recomputes y (bit-identically: same code, same order) and stores the copies. Delayed scaling
// is one pass. The colwise copy is the transpose of the rowwise one (tensor scaling).
// FP8 block scaling (kBlock1d / kBlock2d, Float8BlockScaling): the copies are exactly
// lowbit.quantize(y_rounded, mode, q_dtype, power_2_scale=, amax_epsilon=) (scales in the
// lowbit/block_scaling.h layouts; the colwise copy's 1x128 blocks run along the rows); no
// tensor amax is needed first, so the CUDA forward is a statistics pass and one block cast that
// recomputes y per element (norm.cu).
//
// Backward (dy in x's dtype, saved mean/rsigma):
//   dyg = dy * g,  c1 = sum(dyg * xhat) / C,  c2 = sum(dyg) / C  (layernorm; 0 for rmsnorm)
//   dx = rsigma * (dyg - (xhat * c1 + c2))                  rounded to x's dtype
//   dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy   (float32)
// The CUDA backward accumulates dgamma/dbeta per block in registers, writes one partial row per
// block to the workspace and reduces the partials in a fixed order: deterministic, no atomics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

enum class NormType : int32_t { kLayerNorm = abi::kNormLayernorm, kRmsNorm = abi::kNormRmsnorm };

struct NormFwdParams {
  const void* x = nullptr;  // (rows, cols), f32/bf16/f16
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  const float* gamma = nullptr;  // (cols,)
  const float* beta = nullptr;   // (cols,) or null (rmsnorm, or layernorm without bias)
  NormType type = NormType::kLayerNorm;
  bool zero_centered_gamma = false;
  float epsilon = 1e-6f;

  // kNoScaling: no FP8 output; kDelayedTensor / kCurrentTensor / kBlock1d / kBlock2d: FP8
  // copies requested below.
  ScalingMode mode = ScalingMode::kNoScaling;
  DType q_dtype = DType::kE4M3;
  const float* scale = nullptr;  // delayed: (1,)
  bool power_2_scale = false;    // FP8 block scaling: scales rounded down to powers of two
  float amax_epsilon = 0.0f;     // FP8 block scaling: amax floor of each block

  // Outputs; null = not wanted.
  void* y = nullptr;                   // (rows, cols) in x_dtype
  uint8_t* data = nullptr;             // (rows, cols) FP8
  uint8_t* colwise_data = nullptr;     // (cols, rows) FP8
  float* scale_inv = nullptr;          // (1,); block: fp8_block_scale layout of (rows, cols)
  float* colwise_scale_inv = nullptr;  // (1,); block: the layout of (cols, rows)
  float* amax = nullptr;               // (1,) amax of the rounded y; required with FP8
  float* mean = nullptr;               // (rows,) layernorm
  float* rsigma = nullptr;             // (rows,)
};

struct NormBwdParams {
  const void* dy = nullptr;  // (rows, cols) in x_dtype
  const void* x = nullptr;   // (rows, cols)
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  const float* mean = nullptr;    // (rows,) layernorm
  const float* rsigma = nullptr;  // (rows,)
  const float* gamma = nullptr;   // (cols,)
  NormType type = NormType::kLayerNorm;
  bool zero_centered_gamma = false;

  void* dx = nullptr;         // (rows, cols) in x_dtype
  float* dgamma = nullptr;    // (cols,)
  float* dbeta = nullptr;     // (cols,) or null
  void* workspace = nullptr;  // CUDA: norm_bwd_workspace_bytes()
};

// Re-checks shared by both backends (Python validates first, naming the argument). Inline so
// that both libraries and the standalone checks get them without another source file.
inline bool norm_io_dtype(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

inline Status validate(const NormFwdParams& p) {
  if (!norm_io_dtype(p.x_dtype))
    return Status::Invalid("norm: x must be float32, bfloat16 or float16");
  if (p.rows < 0 || p.cols <= 0) return Status::Invalid("norm: x must have a non-empty last axis");
  if (p.type != NormType::kLayerNorm && p.type != NormType::kRmsNorm)
    return Status::Invalid("norm: unknown norm type");
  if (!p.gamma || !p.rsigma) return Status::Invalid("norm: gamma and rsigma are required");
  if (p.type == NormType::kLayerNorm && !p.mean)
    return Status::Invalid("norm: layernorm needs mean");
  if (!(p.epsilon >= 0.0f)) return Status::Invalid("norm: epsilon must be >= 0");
  const bool fp8 = p.data || p.colwise_data;
  if (!is_fp8_block(p.mode) && (p.power_2_scale || p.amax_epsilon != 0.0f))
    return Status::Invalid("norm: power_2_scale and amax_epsilon are FP8 block scaling only");
  if (!(p.amax_epsilon >= 0.0f) || p.amax_epsilon > 3.40282347e38f)
    return Status::Invalid("norm: amax_epsilon must be finite and >= 0");
  if (p.mode == ScalingMode::kNoScaling) {
    if (fp8) return Status::Invalid("norm: FP8 outputs need a tensor or FP8 block scaling mode");
  } else if (is_tensor_scaling(p.mode) || is_fp8_block(p.mode)) {
    if (p.q_dtype != DType::kE4M3 && p.q_dtype != DType::kE5M2)
      return Status::Invalid("norm: q_dtype must be float8_e4m3fn or float8_e5m2");
    if (!p.amax) return Status::Invalid("norm: FP8 output needs the amax output");
    if (p.mode == ScalingMode::kDelayedTensor && !p.scale)
      return Status::Invalid("norm: delayed scaling needs scale");
  } else {
    return Status::Invalid("norm: fused quantization supports tensor and FP8 block scaling only");
  }
  return Status::Ok();
}

inline Status validate(const NormBwdParams& p) {
  if (!norm_io_dtype(p.x_dtype))
    return Status::Invalid("norm_bwd: dtype must be float32, bfloat16 or float16");
  if (p.rows < 0 || p.cols <= 0)
    return Status::Invalid("norm_bwd: x must have a non-empty last axis");
  if (!p.gamma || !p.rsigma || !p.dgamma)
    return Status::Invalid("norm_bwd: gamma, rsigma, dgamma required");
  if (p.type == NormType::kLayerNorm && !p.mean)
    return Status::Invalid("norm_bwd: layernorm needs mean");
  if (p.rows > 0 && (!p.dx || !p.dy || !p.x))
    return Status::Invalid("norm_bwd: dy, x, dx required");
  return Status::Ok();
}

Status norm_fwd_cpu(const NormFwdParams& p);
Status norm_bwd_cpu(const NormBwdParams& p);

size_t norm_bwd_workspace_bytes(int64_t rows, int64_t cols);
Status norm_fwd_cuda(const NormFwdParams& p, void* stream);
Status norm_bwd_cuda(const NormBwdParams& p, void* stream);

}  // namespace lowbit
