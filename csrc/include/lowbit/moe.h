// Kernel-level interface of the MoE router, dispatch (plan + permute, optionally FP8) and
// combine (lowbit.moe's fused kernels; the pure-JAX path in src/lowbit/moe is the reference).
//
// Router (float32 logits z (T, E)): scores s = softmax(z) | sigmoid(z) | sqrt(softplus(z));
// the choice ranks s + bias (sigmoid / sqrtsoftplus) or, softmax without pre-softmax, z itself;
// grouped top-k keeps the experts of the group_topk groups whose (topk / group_topk) best
// choice values sum highest. Ties go to the lower index (jax.lax.top_k's order); a group score
// tie to the lower group. Weights: s at the chosen experts (softmax over the chosen logits
// without pre-softmax), sigmoid / sqrtsoftplus normalised by (sum + 1e-20) when k > 1, times
// scaling_factor. Backward: dz from dweights through the weights only (the choice is constant).
//
// Dispatch plan (experts (T, k) int32): pair q = t * k + j goes to row dest[q] = offsets[e] +
// rank, rank its position among expert e's pairs in pair order, when rank < kept[e] =
// min(count[e], capacity); else dest = rows (dropped). sizes[e] = kept[e] rounded up to align;
// src[r] = the pair in row r, P = T * k for padding.
//
// Permute: out[r] = x[src[r] / k] (zero when src[r] == P); with FP8 tensor scaling the rows are
// quantized per expert group (the row's expert = experts[src[r]]): scale_e = delayed[e] or
// scale_from_amax(amax_e), amax_e = max |x| over the tokens of e's kept pairs (always returned),
// q = encode_rne(float(x) * scale_e); the colwise copy is the (d, rows) transpose; scale_inv =
// 1 / scale_e. Equal to grouped_quantize(permute(x), sizes) bit for bit.
//
// Combine: out[t] = sum_j w[t, j] * y[dest[t, j]] (float32, j in order; dropped pairs add 0),
// rounded once. Backward: dy[r] = w[q] * g[q / k] rounded to y's dtype (0 for padding),
// dw[q] = sum_c y[dest[q], c] * g[t, c] in float32.
#pragma once

#include <cstdint>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

enum class MoeScore : int32_t {
  kSoftmax = abi::kMoeScoreSoftmax,
  kSigmoid = abi::kMoeScoreSigmoid,
  kSqrtSoftplus = abi::kMoeScoreSqrtsoftplus,
};

constexpr int kMoeMaxTopk = 64;    // the kernels keep the chosen experts in registers/locals
constexpr int kMoeMaxGroups = 64;  // group mask bits
constexpr int kMoeMaxExperts = 1024;

struct MoeRouterParams {
  const float* logits = nullptr;  // (T, E)
  const float* bias = nullptr;    // (E,) or null
  int64_t T = 0, E = 0;
  int32_t topk = 1, num_groups = 0, group_topk = 0;
  MoeScore score = MoeScore::kSoftmax;
  bool pre_softmax = false;
  float scaling = 1.0f;
  float* weights = nullptr;    // (T, k)
  int32_t* experts = nullptr;  // (T, k)
};

struct MoeRouterBwdParams {
  const float* logits = nullptr;     // (T, E)
  const int32_t* experts = nullptr;  // (T, k)
  const float* dweights = nullptr;   // (T, k)
  int64_t T = 0, E = 0;
  int32_t topk = 1;
  MoeScore score = MoeScore::kSoftmax;
  bool pre_softmax = false;
  float scaling = 1.0f;
  float* dlogits = nullptr;  // (T, E)
};

struct MoePlanParams {
  const int32_t* experts = nullptr;  // (T, k)
  int64_t T = 0, k = 0, E = 0, rows = 0;
  int64_t align = 1, capacity = -1;  // capacity < 0: none
  int32_t* dest = nullptr;           // (T, k)
  int32_t* src = nullptr;            // (rows,)
  int32_t* sizes = nullptr;          // (E,)
  int32_t* offsets = nullptr;        // (E,)
  int32_t* counts = nullptr;         // (E,)
  int32_t* scratch = nullptr;        // CUDA: moe_plan_scratch_len int32 (the CPU needs none)
  int64_t scratch_len = 0;
};

// Pairs per chunk of the CUDA plan and its scratch length (per-chunk counts, one flag).
constexpr int64_t kMoePlanChunk = 1024;
inline int64_t moe_plan_scratch_len(int64_t T, int64_t k, int64_t E) {
  const int64_t chunks = (T * k + kMoePlanChunk - 1) / kMoePlanChunk;
  return (chunks > 1 ? chunks : 1) * E + 1;
}

struct MoePermuteParams {
  const void* x = nullptr;  // (T, d)
  DType dtype = DType::kBF16;
  const int32_t* src = nullptr;      // (rows,)
  const int32_t* experts = nullptr;  // (T, k): the row's expert (FP8 only)
  int64_t T = 0, k = 0, d = 0, rows = 0, E = 0;
  // FP8: mode kDelayedTensor (delayed (E,)) or kCurrentTensor; kNoScaling: a plain gather.
  ScalingMode mode = ScalingMode::kNoScaling;
  DType q = DType::kE4M3;
  const float* delayed = nullptr;
  void* out = nullptr;         // (rows, d): x's dtype, or FP8 bytes
  uint8_t* out_col = nullptr;  // (d, rows) FP8 or null
  float* scale_inv = nullptr;  // (E,)
  float* amax = nullptr;       // (E,)
  float* row_amax = nullptr;   // (T,) scratch (FP8)
};

struct MoeCombineParams {
  const void* y = nullptr;  // (rows, d)
  DType y_dtype = DType::kBF16;
  const float* w = nullptr;       // (T, k)
  const int32_t* dest = nullptr;  // (T, k)
  int64_t T = 0, k = 0, d = 0, rows = 0;
  void* out = nullptr;  // (T, d)
  DType out_dtype = DType::kBF16;
};

struct MoeCombineBwdParams {
  const void* g = nullptr;  // (T, d)
  DType g_dtype = DType::kBF16;
  const void* y = nullptr;  // (rows, d)
  DType y_dtype = DType::kBF16;
  const float* w = nullptr;       // (T, k)
  const int32_t* dest = nullptr;  // (T, k)
  const int32_t* src = nullptr;   // (rows,)
  int64_t T = 0, k = 0, d = 0, rows = 0;
  void* dy = nullptr;   // (rows, d), y's dtype
  float* dw = nullptr;  // (T, k)
};

inline bool moe_float_ok(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

inline Status validate(const MoeRouterParams& p) {
  if (p.T < 0 || p.E < 1 || p.E > kMoeMaxExperts)
    return Status::Invalid("moe_router: experts must be in [1, 1024]");
  if (p.topk < 1 || p.topk > p.E || p.topk > kMoeMaxTopk)
    return Status::Invalid("moe_router: topk must be in [1, min(E, 64)]");
  if (p.num_groups > 0) {
    if (p.num_groups > kMoeMaxGroups || p.E % p.num_groups || p.group_topk < 1 ||
        p.group_topk > p.num_groups || p.topk % p.group_topk ||
        p.topk / p.group_topk > p.E / p.num_groups)
      return Status::Invalid("moe_router: bad num_groups / group_topk");
  }
  if (int32_t(p.score) < 0 || int32_t(p.score) > 2)
    return Status::Invalid("moe_router: unknown score function");
  return Status::Ok();
}

inline Status validate(const MoeRouterBwdParams& p) {
  if (p.T < 0 || p.E < 1 || p.topk < 1 || p.topk > p.E || p.topk > kMoeMaxTopk)
    return Status::Invalid("moe_router_bwd: bad shape");
  if (int32_t(p.score) < 0 || int32_t(p.score) > 2)
    return Status::Invalid("moe_router_bwd: unknown score function");
  return Status::Ok();
}

inline Status validate(const MoePlanParams& p) {
  if (p.T < 0 || p.k < 1 || p.E < 1 || p.E > kMoeMaxExperts || p.align < 1 || p.rows < 0)
    return Status::Invalid("moe_plan: bad shape");
  if (p.T * p.k > INT32_MAX - 1 || p.rows > INT32_MAX - 1)
    return Status::Invalid("moe_plan: too many pairs for int32 indices");
  return Status::Ok();
}

inline Status validate(const MoePermuteParams& p) {
  if (p.T < 0 || p.k < 1 || p.d < 0 || p.rows < 0 || !moe_float_ok(p.dtype))
    return Status::Invalid("moe_permute: bad shape or dtype");
  if (p.mode != ScalingMode::kNoScaling) {
    if (!is_tensor_scaling(p.mode) || (p.q != DType::kE4M3 && p.q != DType::kE5M2))
      return Status::Invalid("moe_permute: FP8 needs tensor scaling to E4M3 / E5M2");
    if (p.mode == ScalingMode::kDelayedTensor && !p.delayed)
      return Status::Invalid("moe_permute: delayed scaling needs the scales");
    if (!p.experts || !p.scale_inv || !p.amax || !p.row_amax || p.E < 1)
      return Status::Invalid("moe_permute: FP8 needs experts, scale_inv, amax and scratch");
  }
  return Status::Ok();
}

inline Status validate(const MoeCombineParams& p) {
  if (p.T < 0 || p.k < 1 || p.d < 0 || !moe_float_ok(p.y_dtype) || !moe_float_ok(p.out_dtype))
    return Status::Invalid("moe_combine: bad shape or dtype");
  return Status::Ok();
}

inline Status validate(const MoeCombineBwdParams& p) {
  if (p.T < 0 || p.k < 1 || p.d < 0 || !moe_float_ok(p.y_dtype) || !moe_float_ok(p.g_dtype))
    return Status::Invalid("moe_combine_bwd: bad shape or dtype");
  return Status::Ok();
}

Status moe_router_fwd_cpu(const MoeRouterParams& p);
Status moe_router_bwd_cpu(const MoeRouterBwdParams& p);
Status moe_plan_cpu(const MoePlanParams& p);
Status moe_permute_cpu(const MoePermuteParams& p);
Status moe_combine_fwd_cpu(const MoeCombineParams& p);
Status moe_combine_bwd_cpu(const MoeCombineBwdParams& p);

Status moe_router_fwd_cuda(const MoeRouterParams& p, void* stream);
Status moe_router_bwd_cuda(const MoeRouterBwdParams& p, void* stream);
Status moe_plan_cuda(const MoePlanParams& p, void* stream);
Status moe_permute_cuda(const MoePermuteParams& p, void* stream);
Status moe_combine_fwd_cuda(const MoeCombineParams& p, void* stream);
Status moe_combine_bwd_cuda(const MoeCombineBwdParams& p, void* stream);

}  // namespace lowbit
