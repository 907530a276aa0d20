// CUDA GEMM through cuBLASLt: FP8 (per-tensor scales) and BF16, optional bias epilogue.
//
// cuBLASLt is column-major. Our row-major out(M, N) is the column-major (N, M) matrix
// B(N,K) . A(M,K)^T, so cuBLASLt's "A" is our B (stored K-major: a (K, N) column-major matrix,
// transposed) and its "B" is our A (a (K, M) column-major matrix, not transposed): the "TN"
// layout Hopper FP8 kernels require. The bias epilogue adds a vector over cuBLASLt's rows, i.e.
// over our N.
//
// FP8 block scaling (Float8BlockScaling, Hopper, cuBLAS >= 12.9): each operand's scale mode is
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (1x128 blocks along K) or BLK128x128_32F (128x128
// tiles); 1Dx1D, 1Dx2D and 2Dx1D, TN only (both operands K-major, as here), split accumulation
// (no FAST_ACCUM), no epilogue (Python adds the bias). The scale arrays are in the layout cuBLASLt
// reads (lowbit/block_scaling.h, docs/numerics.md), so they are passed as they are: cuBLASLt's
// A (our B) takes b's scales, its B (our A) a's.
//
// Nothing here synchronizes or allocates device memory: the workspace is a caller buffer and the
// scales stay on the device (passed as pointers), so the call is safe inside CUDA graphs.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "lowbit/block_gemm.h"
#include "lowbit/gemm.h"

namespace lowbit {
namespace {

std::string lt_error(const char* what, cublasStatus_t s) {
  return std::string("gemm: ") + what + " failed: " + cublasLtGetStatusString(s) + " (" +
         std::to_string(static_cast<int>(s)) + ")";
}

#define LOWBIT_LT_CHECK(call, what)                                              \
  do {                                                                           \
    cublasStatus_t _s = (call);                                                  \
    if (_s != CUBLAS_STATUS_SUCCESS) return Status::Invalid(lt_error(what, _s)); \
  } while (0)

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kE4M3: return CUDA_R_8F_E4M3;
    case DType::kE5M2: return CUDA_R_8F_E5M2;
    case DType::kBF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// Largest power of two (<= 256, cuBLASLt's default assumption) dividing the address.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

// One cuBLASLt handle per device, created on first use and kept for the process.
Status handle_for(int device, cublasLtHandle_t* out) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) {
    *out = it->second;
    return Status::Ok();
  }
  cublasLtHandle_t h = nullptr;
  LOWBIT_LT_CHECK(cublasLtCreate(&h), "cublasLtCreate");
  handles.emplace(device, h);
  *out = h;
  return Status::Ok();
}

// Everything the heuristic's choice depends on.
using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, size_t,
                           uint32_t, uint32_t, uint32_t, uint32_t, int, int>;

struct AlgoCache {
  std::mutex mu;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
};

AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}

// Owns the descriptors of one call (cheap host objects; the expensive part, the heuristic, is
// cached).
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// cuBLASLt's handle creation and heuristic query may make calls that are illegal while a stream
// is being captured into a CUDA graph (XLA records command buffers by capture). They only touch
// host state and run once per shape, so this thread relaxes the capture rules around them.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

int current_device(cudaStream_t stream) {
  int device = 0;
#if CUDART_VERSION >= 12080
  if (cudaStreamGetDevice(stream, &device) == cudaSuccess) return device;
  cudaGetLastError();  // clear the error a legacy/default stream may leave
#endif
  cudaGetDevice(&device);
  return device;
}

}  // namespace

int gemm_stream_device(void* stream) { return current_device(static_cast<cudaStream_t>(stream)); }

Status gemm_cuda_init() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return Status::Invalid("gemm: no current CUDA device");
  cublasLtHandle_t handle;
  return handle_for(device, &handle);
}

Status gemm_cublaslt(const GemmParams& p, void* stream_ptr) {
  Status s = validate(p);
  if (!s.ok()) return s;
  // Empty problems are handled by the caller (no kernel can write an empty output; K == 0 needs
  // a fill the Python side does).
  if (p.m == 0 || p.n == 0) return Status::Ok();
  if (p.k == 0) return Status::Invalid("gemm: K == 0 must be handled by the caller");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int device = current_device(stream);
  cublasLtHandle_t handle;
  {
    RelaxedCapture relaxed;
    s = handle_for(device, &handle);
  }
  if (!s.ok()) return s;

  const bool fp8 = is_fp8(p.a_dtype);
  const cudaDataType_t t_a = cuda_type(p.b_dtype);  // cuBLASLt's A is our B
  const cudaDataType_t t_b = cuda_type(p.a_dtype);  // cuBLASLt's B is our A
  const cudaDataType_t t_d = cuda_type(p.out_dtype);
  const cudaDataType_t t_bias = cuda_type(p.bias_dtype);

  Descs d;
  LOWBIT_LT_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                  "cublasLtMatmulDescCreate");
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  LOWBIT_LT_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)),
      "set TRANSA");
  LOWBIT_LT_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)),
      "set TRANSB");
  if (fp8) {
    // Per-tensor decode scales as device pointers: cuBLASLt reads them on the device.
    const void* sa = p.b_scale_inv;
    const void* sb = p.a_scale_inv;
    LOWBIT_LT_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)),
        "set A_SCALE_POINTER");
    LOWBIT_LT_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)),
        "set B_SCALE_POINTER");
    const bool block = p.a_block != 0;
    const int8_t fast = p.fast_accum && !block ? 1 : 0;
    LOWBIT_LT_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
        "set FAST_ACCUM");
    if (block) {
#if CUBLAS_VERSION >= 120900
      if (p.bias) return Status::Invalid("gemm: no bias epilogue with FP8 block scaling");
      auto lt_mode = [](int b) -> int32_t {
        return b == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                      : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      };
      const int32_t mode_a = lt_mode(p.b_block), mode_b = lt_mode(p.a_block);
      LOWBIT_LT_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                     &mode_a, sizeof(mode_a)),
                      "set A_SCALE_MODE");
      LOWBIT_LT_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                     &mode_b, sizeof(mode_b)),
                      "set B_SCALE_MODE");
#else
      return Status::Invalid("gemm: FP8 block scaling needs cuBLAS 12.9 or newer at build time");
#endif
    }
  }
  if (p.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    LOWBIT_LT_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
        "set EPILOGUE");
    LOWBIT_LT_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                                   sizeof(p.bias)),
                    "set BIAS_POINTER");
    // Only state the bias type where it differs from the output type (FP8 with F32 output takes
    // a BF16 bias); otherwise cuBLASLt's default (the output type) applies.
    if (t_bias != t_d) {
      const int32_t bt = static_cast<int32_t>(t_bias);
      LOWBIT_LT_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                     sizeof(bt)),
                      "set BIAS_DATA_TYPE");
    }
  }
  // Column-major views: A (K, N) ld K, B (K, M) ld K, C = D (N, M) ld N.
  LOWBIT_LT_CHECK(cublasLtMatrixLayoutCreate(&d.a, t_a, p.k, p.n, p.k), "layout A");
  LOWBIT_LT_CHECK(cublasLtMatrixLayoutCreate(&d.b, t_b, p.k, p.m, p.k), "layout B");
  LOWBIT_LT_CHECK(cublasLtMatrixLayoutCreate(&d.d, t_d, p.n, p.m, p.n), "layout D");

  const uint32_t al_a = alignment_of(p.b), al_b = alignment_of(p.a), al_d = alignment_of(p.out);
  const uint32_t al_bias = p.bias ? alignment_of(p.bias) : 256;
  const AlgoKey key{device,
                    p.m,
                    p.n,
                    p.k,
                    static_cast<int>(p.a_dtype),
                    static_cast<int>(p.b_dtype),
                    static_cast<int>(p.out_dtype),
                    p.bias ? static_cast<int>(p.bias_dtype) : -1,
                    p.fast_accum ? 1 : 0,
                    p.workspace_bytes,
                    al_a,
                    al_b,
                    al_d,
                    al_bias,
                    p.a_block,
                    p.b_block};

  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    AlgoCache& c = algo_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.algos.find(key);
    if (it != c.algos.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    RelaxedCapture relaxed;
    LOWBIT_LT_CHECK(cublasLtMatmulPreferenceCreate(&d.pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t ws = p.workspace_bytes;
    LOWBIT_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
                        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                    "set MAX_WORKSPACE_BYTES");
    // Tell the heuristic the real alignments so it never picks a kernel that needs more.
    const uint32_t al[4] = {al_a, al_b, al_d, al_d};
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      LOWBIT_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, which[i], &al[i], sizeof(al[i])),
                      "set MIN_ALIGNMENT");
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    LOWBIT_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.d, d.d, d.pref, 1,
                                                   &result, &found),
                    "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
      return Status::Invalid(
          "gemm: cuBLASLt has no algorithm for M=" + std::to_string(p.m) +
          " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
          (p.a_block ? " (FP8 block scaling: a_block=" + std::to_string(p.a_block) +
                           " b_block=" + std::to_string(p.b_block) +
                           "; cuBLASLt >= 12.9 on sm_90 offers 1Dx1D, 1Dx2D and 2Dx1D)"
           : fp8 ? std::string(" (FP8 needs K and N multiples of 16 and 16-byte aligned operands)")
                 : std::string()));
    algo = result.algo;
    AlgoCache& c = algo_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    c.algos.emplace(key, algo);
  }

  const float alpha = 1.0f, beta = 0.0f;
  LOWBIT_LT_CHECK(cublasLtMatmul(handle, d.op, &alpha, p.b, d.a, p.a, d.b, &beta, p.out, d.d, p.out,
                                 d.d, &algo, p.workspace, p.workspace_bytes, stream),
                  "cublasLtMatmul");
  return Status::Ok();
}

// FP8 block scaling goes to block_gemm.cu: lowbit's CUTLASS kernels or cuBLASLt, whichever
// measured faster for the shape.
Status gemm_cuda(const GemmParams& p, void* stream) {
  if (p.a_block != 0) return block_gemm_cuda(p, stream);
  return gemm_cublaslt(p, stream);
}

}  // namespace lowbit
