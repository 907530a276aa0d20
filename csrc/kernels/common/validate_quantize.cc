// Checks shared by the CPU and CUDA quantization kernels. Python validates first with messages
// that name the argument; these re-checks keep a bad call from reaching a kernel.
#include <algorithm>
#include <string>

#include "lowbit/block_scaling.h"
#include "lowbit/quantize.h"

namespace lowbit {
namespace {

bool is_input_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

Status check_q_dtype(ScalingMode mode, DType q, DType x) {
  if (mode == ScalingMode::kNoScaling) {
    if (q != x) return Status::Invalid("NO_SCALING keeps the input dtype");
    return Status::Ok();
  }
  if (is_nvfp4(mode)) {
    if (q != DType::kE2M1) return Status::Invalid("NVFP4 scaling needs q_dtype float4_e2m1fn");
    return Status::Ok();
  }
  if (q != DType::kE4M3 && q != DType::kE5M2)
    return Status::Invalid("FP8 scaling needs q_dtype float8_e4m3fn or float8_e5m2");
  return Status::Ok();
}

Status check_multiple(int64_t n, int64_t m, const char* what) {
  if (n % m != 0)
    return Status::Invalid(std::string(what) + " (" + std::to_string(n) +
                           ") must be a multiple of " + std::to_string(m));
  return Status::Ok();
}

// The kernels read rows*cols codes and one scale per block (per tensor: one); a smaller buffer
// would be read past its end.
Status check_buffer_sizes(const DequantizeParams& p) {
  const int64_t codes = p.q_dtype == DType::kE2M1 ? p.rows * p.cols / 2 : p.rows * p.cols;
  if (p.data_elems >= 0 && p.data_elems != codes)
    return Status::Invalid("dequantize: data has " + std::to_string(p.data_elems) +
                           " elements, the (" + std::to_string(p.rows) + ", " +
                           std::to_string(p.cols) + ") output needs " + std::to_string(codes));
  const int64_t scales = is_tensor_scaling(p.mode) ? 1
                         : is_fp8_block(p.mode)
                             ? fp8_block_scale_rows(p.mode, p.rows, p.cols) *
                                   fp8_block_scale_cols(p.mode, p.rows, p.cols)
                             : p.rows * (p.cols / std::max(1, block_size(p.mode)));
  if (p.scale_inv_elems >= 0 && p.scale_inv_elems < scales)
    return Status::Invalid("dequantize: scale_inv has " + std::to_string(p.scale_inv_elems) +
                           " elements, the mode needs " + std::to_string(scales));
  if (is_nvfp4(p.mode) && p.global_scale_inv_elems >= 0 && p.global_scale_inv_elems < 1)
    return Status::Invalid("dequantize: global_scale_inv is empty");
  return Status::Ok();
}

}  // namespace

Status validate(const QuantizeParams& p) {
  if (!is_input_dtype(p.x_dtype)) return Status::Invalid("x must be float32, bfloat16 or float16");
  if (p.rows < 0 || p.cols < 0) return Status::Invalid("negative shape");
  if (auto s = check_q_dtype(p.mode, p.q_dtype, p.x_dtype); !s.ok()) return s;
  if (!p.rowwise && !p.colwise) return Status::Invalid("no layout requested");
  // FP8 block scaling takes any shape (the last block of a row or tile may be partial).
  const int b = is_fp8_block(p.mode) ? 1 : block_size(p.mode);
  if (p.rowwise) {
    if (auto s = check_multiple(p.cols, b, "columns"); !s.ok()) return s;
  }
  if (p.colwise) {
    if (auto s = check_multiple(p.rows, b, "rows"); !s.ok()) return s;
  }
  if (p.mode == ScalingMode::kNvfp4_2d) {
    if (auto s = check_multiple(p.rows, 16, "rows"); !s.ok()) return s;
    if (auto s = check_multiple(p.cols, 16, "columns"); !s.ok()) return s;
    if (p.rht) return Status::Invalid("the Hadamard transform is not offered with 2-D blocks");
  }
  if (p.rht && !is_nvfp4(p.mode)) return Status::Invalid("the Hadamard transform is NVFP4-only");
  if (!is_fp8_block(p.mode) && (p.power_2_scale || p.amax_epsilon != 0.0f))
    return Status::Invalid("power-of-two scales and amax_epsilon are FP8 block scaling only");
  if (!(p.amax_epsilon >= 0.0f) || p.amax_epsilon > 3.40282347e38f)
    return Status::Invalid("amax_epsilon must be finite and >= 0");
  if (p.sr_seed && !is_nvfp4(p.mode)) return Status::Invalid("stochastic rounding is NVFP4-only");
  if (p.mode == ScalingMode::kDelayedTensor && !p.scale)
    return Status::Invalid("delayed scaling needs a scale");
  if (!p.amax) return Status::Invalid("amax output missing");
  if (p.n_parts) {
    if (p.mode != ScalingMode::kDelayedTensor && p.mode != ScalingMode::kCurrentTensor &&
        p.mode != ScalingMode::kBlock1d && p.mode != ScalingMode::kBlock2d)
      return Status::Invalid("quantize: inputs in parts need tensor or FP8 block scaling");
    if (p.n_parts < 2 || p.n_parts > kMaxQuantizeParts || p.part_cols * p.n_parts != p.cols)
      return Status::Invalid("quantize: parts must be 2 or 3 inputs of equal shape");
    for (int i = 0; i < p.n_parts; ++i)
      if (!p.x_parts[i]) return Status::Invalid("quantize: an input part is missing");
  }
  if (is_nvfp4(p.mode) && !p.global_scale_inv) return Status::Invalid("global_scale_inv missing");
  const int64_t n = p.rows * p.cols;
  if (n > 0) {
    if (p.rowwise && (!p.data || (p.mode != ScalingMode::kNoScaling && !p.scale_inv)))
      return Status::Invalid("rowwise outputs missing");
    if (p.colwise &&
        (!p.colwise_data || (p.mode != ScalingMode::kNoScaling && !p.colwise_scale_inv)))
      return Status::Invalid("colwise outputs missing");
  }
  return Status::Ok();
}

Status validate(const DequantizeParams& p) {
  if (!is_input_dtype(p.out_dtype))
    return Status::Invalid("output must be float32, bfloat16 or float16");
  if (p.mode == ScalingMode::kNoScaling) return Status::Invalid("nothing to dequantize");
  if (auto s = check_q_dtype(p.mode, p.q_dtype, p.out_dtype); !s.ok()) return s;
  if (!is_fp8_block(p.mode)) {
    if (auto s = check_multiple(p.cols, block_size(p.mode), "columns"); !s.ok()) return s;
  }
  if (is_nvfp4(p.mode) && !p.global_scale_inv) return Status::Invalid("global_scale_inv missing");
  return check_buffer_sizes(p);
}

Status validate(const GroupedQuantizeParams& p) {
  if (!is_input_dtype(p.x_dtype)) return Status::Invalid("x must be float32, bfloat16 or float16");
  if (p.num_groups < 1) return Status::Invalid("at least one group is needed");
  if (!(is_tensor_scaling(p.mode) || p.mode == ScalingMode::kMxfp8_1d ||
        p.mode == ScalingMode::kBlock1d))
    return Status::Invalid(
        "grouped quantize supports delayed, current, MXFP8 and BLOCK_1D scaling");
  if (p.mode == ScalingMode::kBlock1d && !(p.amax_epsilon >= 0.0f && p.amax_epsilon < 3.4e38f))
    return Status::Invalid("amax_epsilon must be finite and >= 0");
  if (auto s = check_q_dtype(p.mode, p.q_dtype, p.x_dtype); !s.ok()) return s;
  if (!p.rowwise && !p.colwise) return Status::Invalid("no layout requested");
  if (p.mode == ScalingMode::kMxfp8_1d) {
    if (p.colwise) return Status::Invalid("grouped MXFP8 quantization is rowwise only");
    if (auto s = check_multiple(p.cols, 32, "columns"); !s.ok()) return s;
  }
  if (p.mode == ScalingMode::kDelayedTensor && !p.scale)
    return Status::Invalid("delayed scaling needs a scale per group");
  if (!p.amax) return Status::Invalid("amax output missing");
  return Status::Ok();
}

}  // namespace lowbit
