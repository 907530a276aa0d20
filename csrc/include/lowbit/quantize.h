// Kernel-level interface of the quantization family (quantize, dbias+quantize, grouped quantize,
// dequantize). The numerics are specified in docs/numerics.md. Pointers are host pointers for the
// CPU kernels and device pointers for the CUDA kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

// Default sign mask of the 16-point random Hadamard transform (lowbit/abi.h).
constexpr uint32_t kDefaultRhtSignMask = static_cast<uint32_t>(abi::kDefaultRhtSignMask);

// Most parts of QuantizeParams::x_parts (lowbit/abi.h).
constexpr int kMaxQuantizeParts = abi::kMaxQuantizeParts;

struct QuantizeParams {
  // Input: row-major (rows, cols), float32/bfloat16/float16.
  const void* x = nullptr;
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  // x given in parts (tensor or FP8 block scaling): x is the concatenation along the columns of
  // x_parts[0..n_parts), each (rows, part_cols) row-major; cols = n_parts * part_cols. Saves the
  // concatenation of gradients that arrive split (dq, dk, dv of a fused QKV projection).
  const void* x_parts[kMaxQuantizeParts] = {};
  int n_parts = 0;
  int64_t part_cols = 0;

  ScalingMode mode = ScalingMode::kCurrentTensor;
  DType q_dtype = DType::kE4M3;  // E4M3/E5M2, or E2M1 for NVFP4; input dtype for kNoScaling
  bool rowwise = true;
  bool colwise = false;

  const float* scale = nullptr;  // delayed scaling: (1,) encode scale
  const uint32_t* sr_seed =
      nullptr;       // NVFP4 stochastic rounding: (2,) seed, null = round to nearest
  bool rht = false;  // NVFP4: Hadamard-transform the colwise copy
  uint32_t rht_sign_mask = kDefaultRhtSignMask;
  // FP8 block scaling: scales rounded down to powers of two; amax floor of each block.
  bool power_2_scale = false;
  float amax_epsilon = 0.0f;

  // Outputs; a copy's pointers are ignored when that copy is not requested.
  void* data = nullptr;  // (rows, cols) [packed (rows, cols/2) for E2M1]
  void* scale_inv =
      nullptr;  // tensor: (1,) f32; MXFP8: (rows, cols/32) e8m0; NVFP4: (rows, cols/16) e4m3
  void* colwise_data = nullptr;       // (cols, rows) [packed (cols, rows/2)]
  void* colwise_scale_inv = nullptr;  // as scale_inv, for the (cols, rows) copy
  float* amax = nullptr;              // (1,) amax of x, always written
  float* global_scale_inv = nullptr;  // NVFP4: (2,) = [rowwise, colwise] tensor decode scales
  void* dbias = nullptr;              // optional (cols,) column sums in x_dtype

  // CUDA only: scratch from the FFI allocator, at least quantize_workspace_bytes().
  void* workspace = nullptr;
};

struct DequantizeParams {
  const void* data = nullptr;  // (rows, cols) [packed for E2M1]
  DType q_dtype = DType::kE4M3;
  int64_t rows = 0, cols = 0;
  ScalingMode mode = ScalingMode::kCurrentTensor;
  const void* scale_inv = nullptr;
  const float* global_scale_inv = nullptr;  // NVFP4: (1,) for this copy
  bool rht = false;                         // undo the Hadamard transform
  uint32_t rht_sign_mask = kDefaultRhtSignMask;
  void* out = nullptr;  // (rows, cols) in out_dtype
  DType out_dtype = DType::kBF16;
  // Element counts of the operand buffers, from the FFI handler (-1: not known, e.g. a direct
  // kernel call): validate() refuses buffers smaller than (rows, cols) and the mode need.
  int64_t data_elems = -1, scale_inv_elems = -1, global_scale_inv_elems = -1;
};

struct GroupedQuantizeParams {
  const void* x = nullptr;  // (rows, cols)
  DType x_dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  const int32_t* group_sizes = nullptr;  // (num_groups,), on the device for CUDA
  int64_t num_groups = 0;
  // Delayed, current, MXFP8 (rowwise only) or FP8 block 1x128 (kBlock1d: the grouped layouts
  // of lowbit/block_scaling.h; the colwise blocks run along the rows inside each group).
  ScalingMode mode = ScalingMode::kCurrentTensor;
  DType q_dtype = DType::kE4M3;
  bool rowwise = true;
  bool colwise = false;
  const float* scale = nullptr;  // delayed: (num_groups,)
  bool power_2_scale = false;    // kBlock1d: scales rounded down to powers of two
  float amax_epsilon = 0.0f;     // kBlock1d: amax floor of each block
  void* data = nullptr;          // (rows, cols)
  // tensor: (num_groups,) f32; MXFP8: (rows, cols/32); kBlock1d: (rows * ceil(cols/128),) f32
  void* scale_inv = nullptr;
  void* colwise_data = nullptr;  // (cols, rows)
  // tensor: (num_groups,) f32; kBlock1d: (rows / 128 + num_groups, cols) f32
  void* colwise_scale_inv = nullptr;
  float* amax = nullptr;      // (num_groups,)
  void* workspace = nullptr;  // CUDA scratch
};

// Validation shared by both backends (shape multiples, supported combinations).
Status validate(const QuantizeParams& p);
Status validate(const DequantizeParams& p);
Status validate(const GroupedQuantizeParams& p);

// CPU reference/backend (csrc/kernels/cpu).
Status quantize_cpu(const QuantizeParams& p);
Status dequantize_cpu(const DequantizeParams& p);
Status grouped_quantize_cpu(const GroupedQuantizeParams& p);

// CUDA backend (csrc/kernels/cuda). `stream` is a cudaStream_t.
size_t quantize_workspace_bytes(const QuantizeParams& p);
size_t grouped_quantize_workspace_bytes(const GroupedQuantizeParams& p);
Status quantize_cuda(const QuantizeParams& p, void* stream);
Status dequantize_cuda(const DequantizeParams& p, void* stream);
Status grouped_quantize_cuda(const GroupedQuantizeParams& p, void* stream);

}  // namespace lowbit
