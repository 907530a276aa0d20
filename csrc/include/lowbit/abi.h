// The Python <-> C++ contract: every code that crosses the FFI boundary as an attribute or a
// flag bit. src/lowbit/abi.py holds the same values under the same names (kFooBar there is
// FOO_BAR), and tests/test_abi.py reads this file and checks both ways, so keep to one
// `constexpr int32_t kName = value;` per line. The enums of the other headers take their values
// from here.
#pragma once

#include <cstdint>

namespace lowbit::abi {

// Element types (DType, tensor.h): the `q_dtype` attribute and the workspace queries.
constexpr int32_t kDtypeF32 = 0;
constexpr int32_t kDtypeBf16 = 1;
constexpr int32_t kDtypeF16 = 2;
constexpr int32_t kDtypeE4m3 = 3;
constexpr int32_t kDtypeE5m2 = 4;
constexpr int32_t kDtypeE2m1 = 5;
constexpr int32_t kDtypeE8m0 = 6;

// Scaling modes (ScalingMode, tensor.h; lowbit.ScalingMode): the `mode` attribute.
constexpr int32_t kModeNoScaling = 0;
constexpr int32_t kModeDelayedTensorScaling = 1;
constexpr int32_t kModeCurrentTensorScaling = 2;
constexpr int32_t kModeMxfp8_1dScaling = 3;
constexpr int32_t kModeNvfp4_1dScaling = 4;
constexpr int32_t kModeNvfp4_2dScaling = 5;
constexpr int32_t kModeBlock_1dScaling = 6;
constexpr int32_t kModeBlock_2dScaling = 7;

// Quantize family (ffi/quantize.cc): bits of the `flags` attribute of quantize, dequantize and
// grouped_quantize (rowwise/colwise are also the layout bits of the fused norm and activation
// outputs).
constexpr int32_t kQuantizeRowwise = 1;
constexpr int32_t kQuantizeColwise = 2;
constexpr int32_t kQuantizeDbias = 4;
constexpr int32_t kQuantizeStochastic = 8;
constexpr int32_t kQuantizeRht = 16;
constexpr int32_t kQuantizePow2 = 32;
// The `rht_sign_mask` attribute: the 16 signs of the 16-point Hadamard transform, and its default.
constexpr int32_t kRhtSignMaskBits = 0xFFFF;
constexpr int32_t kDefaultRhtSignMask = 0xA759;
// Most column parts quantize reads in place (operands x, x1, x2).
constexpr int32_t kMaxQuantizeParts = 3;

// GEMM (ffi/gemm.cc): bits of the `flags` attribute. Each operand's FP8 block scaling is a
// 2-bit field (kGemmBlockNone / 1D / 2D) at its shift.
constexpr int32_t kGemmFastAccum = 1;
constexpr int32_t kGemmABlockShift = 1;
constexpr int32_t kGemmBBlockShift = 3;
constexpr int32_t kGemmBlockMask = 3;
constexpr int32_t kGemmBlockNone = 0;
constexpr int32_t kGemmBlock_1d = 1;  // 1x128 blocks (BLOCK_1D_SCALING)
constexpr int32_t kGemmBlock_2d = 2;  // 128x128 tiles (BLOCK_2D_SCALING)

// Grouped GEMM (ffi/grouped_gemm.cc): the `mode` attribute (GroupedGemmMode, grouped_gemm.h)
// and the bits of the `flags` attribute.
constexpr int32_t kGroupedRaggedM = 0;
constexpr int32_t kGroupedRaggedK = 1;
constexpr int32_t kGroupedAKmajor = 1;
constexpr int32_t kGroupedBKmajor = 2;
constexpr int32_t kGroupedFastAccum = 4;
constexpr int32_t kGroupedBlockScaled = 8;
constexpr int32_t kGroupedBlockN128 = 16;

// Norm (ffi/norm.cc): the `norm_type` attribute (NormType, norm.h).
constexpr int32_t kNormLayernorm = 0;
constexpr int32_t kNormRmsnorm = 1;

// Activation (ffi/activation.cc): the `act` attribute (ActKind, activation.h).
constexpr int32_t kActLinear = 0;
constexpr int32_t kActGeluTanh = 1;
constexpr int32_t kActGeluExact = 2;
constexpr int32_t kActRelu = 3;
constexpr int32_t kActSilu = 4;
constexpr int32_t kActQuickGelu = 5;
constexpr int32_t kActSquaredRelu = 6;

// Softmax (ffi/softmax.cc): the `softmax_type` attribute (SoftmaxType, softmax.h).
constexpr int32_t kSoftmaxScaled = 0;
constexpr int32_t kSoftmaxScaledMasked = 1;
constexpr int32_t kSoftmaxScaledUpperTriangMasked = 2;

// Attention (ffi/attention.cc, cuDNN): bits of the `flags` attribute, and the FP8 scale and
// amax arrays' geometry (rows kAttnScaleStride floats apart: each pointer 16-byte aligned).
constexpr int32_t kAttnCausal = 1;
constexpr int32_t kAttnPadding = 2;
constexpr int32_t kAttnRagged = 4;
constexpr int32_t kAttnDropout = 8;
constexpr int32_t kAttnSink = 16;
constexpr int32_t kAttnFp8 = 32;
constexpr int32_t kAttnDeterministic = 64;
constexpr int32_t kAttnScaleStride = 4;
constexpr int32_t kAttnFp8FwdScales = 6;
constexpr int32_t kAttnFp8BwdScales = 12;
constexpr int32_t kAttnFp8FwdAmaxes = 2;
constexpr int32_t kAttnFp8BwdAmaxes = 4;

// MoE (ffi/moe.cc): the router's `score` attribute (MoeScore, moe.h) and the permute's `flags`
// bits (rowwise / colwise FP8 copies).
constexpr int32_t kMoeScoreSoftmax = 0;
constexpr int32_t kMoeScoreSigmoid = 1;
constexpr int32_t kMoeScoreSqrtsoftplus = 2;
constexpr int32_t kMoePermuteRowwise = 1;
constexpr int32_t kMoePermuteColwise = 2;

}  // namespace lowbit::abi
