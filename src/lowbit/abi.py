"""The Python <-> C++ contract: every code that crosses the FFI boundary as an attribute or a
flag bit, the same values as csrc/include/lowbit/abi.h under the same names (its ``kFooBar`` is
``FOO_BAR`` here); tests/test_abi.py reads the header and checks both ways. The FFI layer
(lowbit.ops._ffi) and lowbit.quantization.scaling_modes take their codes from here."""

# Element types (DType): the `q_dtype` attribute and the workspace queries.
DTYPE_F32 = 0
DTYPE_BF16 = 1
DTYPE_F16 = 2
DTYPE_E4M3 = 3
DTYPE_E5M2 = 4
DTYPE_E2M1 = 5
DTYPE_E8M0 = 6

# Scaling modes (lowbit.ScalingMode): the `mode` attribute.
MODE_NO_SCALING = 0
MODE_DELAYED_TENSOR_SCALING = 1
MODE_CURRENT_TENSOR_SCALING = 2
MODE_MXFP8_1D_SCALING = 3
MODE_NVFP4_1D_SCALING = 4
MODE_NVFP4_2D_SCALING = 5
MODE_BLOCK_1D_SCALING = 6
MODE_BLOCK_2D_SCALING = 7

# Quantize family: bits of the `flags` attribute (rowwise/colwise are also the layout bits of
# the fused norm and activation outputs).
QUANTIZE_ROWWISE = 1
QUANTIZE_COLWISE = 2
QUANTIZE_DBIAS = 4
QUANTIZE_STOCHASTIC = 8
QUANTIZE_RHT = 16
QUANTIZE_POW2 = 32
# The `rht_sign_mask` attribute: the 16 signs of the 16-point Hadamard transform, and its default.
RHT_SIGN_MASK_BITS = 0xFFFF
DEFAULT_RHT_SIGN_MASK = 0xA759
# Most column parts quantize reads in place.
MAX_QUANTIZE_PARTS = 3

# GEMM: bits of the `flags` attribute; each operand's FP8 block scaling is a 2-bit field.
GEMM_FAST_ACCUM = 1
GEMM_A_BLOCK_SHIFT = 1
GEMM_B_BLOCK_SHIFT = 3
GEMM_BLOCK_MASK = 3
GEMM_BLOCK_NONE = 0
GEMM_BLOCK_1D = 1  # 1x128 blocks (BLOCK_1D_SCALING)
GEMM_BLOCK_2D = 2  # 128x128 tiles (BLOCK_2D_SCALING)

# Grouped GEMM: the `mode` attribute and the bits of the `flags` attribute.
GROUPED_RAGGED_M = 0
GROUPED_RAGGED_K = 1
GROUPED_A_KMAJOR = 1
GROUPED_B_KMAJOR = 2
GROUPED_FAST_ACCUM = 4
GROUPED_BLOCK_SCALED = 8
GROUPED_BLOCK_N128 = 16

# Norm: the `norm_type` attribute.
NORM_LAYERNORM = 0
NORM_RMSNORM = 1

# Activation: the `act` attribute.
ACT_LINEAR = 0
ACT_GELU_TANH = 1
ACT_GELU_EXACT = 2
ACT_RELU = 3
ACT_SILU = 4
ACT_QUICK_GELU = 5
ACT_SQUARED_RELU = 6

# Softmax: the `softmax_type` attribute.
SOFTMAX_SCALED = 0
SOFTMAX_SCALED_MASKED = 1
SOFTMAX_SCALED_UPPER_TRIANG_MASKED = 2

# Attention (cuDNN): bits of the `flags` attribute, and the FP8 scale and amax arrays' geometry
# (rows ATTN_SCALE_STRIDE floats apart).
ATTN_CAUSAL = 1
ATTN_PADDING = 2
ATTN_RAGGED = 4
ATTN_DROPOUT = 8
ATTN_SINK = 16
ATTN_FP8 = 32
ATTN_DETERMINISTIC = 64
ATTN_SCALE_STRIDE = 4
ATTN_FP8_FWD_SCALES = 6
ATTN_FP8_BWD_SCALES = 12
ATTN_FP8_FWD_AMAXES = 2
ATTN_FP8_BWD_AMAXES = 4

# MoE: the router's `score` attribute and the permute's `flags` bits.
MOE_SCORE_SOFTMAX = 0
MOE_SCORE_SIGMOID = 1
MOE_SCORE_SQRTSOFTPLUS = 2
MOE_PERMUTE_ROWWISE = 1
MOE_PERMUTE_COLWISE = 2
