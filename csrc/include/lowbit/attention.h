// Kernel-level interface of lowbit's fused attention: cuDNN's SDPA through the frontend graph
// API (csrc/kernels/cuda/attention_cudnn.cc), forward and backward. GPU only: the CPU path is
// the Python reference (src/lowbit/ops/fused_attention.py).
//
// Layouts: q (b, sq, h, d), k (b, skv, hk, d), v (b, skv, hk, dv), o (b, sq, h, dv) row-major
// (BSHD); h % hk == 0 (GQA/MQA). Ragged (THD): q/o are (tq, h, d) and k/v (tkv, hk, d) packed
// token by token; sq/skv are then the longest sequence, and `ragged_offsets` holds the element
// offsets of each sequence's first token (rows q, k, v, o, each b + 1 entries, row stride
// ragged_stride). Stats (b, h, sq) float32: the softmax's log-sum-exp per query row (cuDNN's
// natural-log convention), written by the forward, read by the backward.
// Numerics: s = scale * q.k^T (float32) + bias; masked entries (causal: key j > query i,
// top-left; padding: query i >= seqlens_q[b] or key j >= seqlens_kv[b]) are excluded; p =
// softmax(s) (with a sink: one more logit sink[h] in the denominator); dropout keeps p/(1-rate)
// with probability 1-rate from cuDNN's Philox stream (seed, offset); o = p.v rounded once.
#pragma once

#include <cstdint>
#include <functional>

#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

// FP8 scale rows (float32, abi::kAttnScaleStride floats apart so each pointer is 16-byte
// aligned). Forward: descale q, k, v, s; scale s, o. Backward: descale q, k, v, o, dO, s, dP;
// scale s, dQ, dK, dV, dP.
enum AttnFwdScale : int {
  kFwdDescaleQ,
  kFwdDescaleK,
  kFwdDescaleV,
  kFwdDescaleS,
  kFwdScaleS,
  kFwdScaleO
};
enum AttnBwdScale : int {
  kBwdDescaleQ,
  kBwdDescaleK,
  kBwdDescaleV,
  kBwdDescaleO,
  kBwdDescaleDO,
  kBwdDescaleS,
  kBwdDescaleDP,
  kBwdScaleS,
  kBwdScaleDQ,
  kBwdScaleDK,
  kBwdScaleDV,
  kBwdScaleDP,
};
// Amax result rows: forward s, o; backward dQ, dK, dV, dP.

struct AttentionParams {
  int64_t b = 0, h = 0, hk = 0, sq = 0, skv = 0, d = 0, dv = 0;
  int64_t bias_b = 0, bias_h = 0;   // bias (bias_b, bias_h, sq, skv); 0: no bias
  DType dtype = DType::kBF16;       // q, k, v (and o): BF16/F16, or E4M3 with fp8
  DType do_dtype = DType::kBF16;    // backward: dO (E4M3 or E5M2 with fp8)
  DType o_dtype = DType::kBF16;     // forward output (fp8: E4M3, or BF16/F16)
  DType dqkv_dtype = DType::kBF16;  // backward outputs (fp8: E4M3/E5M2, or BF16/F16)
  DType bias_dtype = DType::kBF16;
  bool causal = false, padding = false, ragged = false, dropout = false, sink = false;
  bool fp8 = false, deterministic = false;
  float scale = 1.0f, dropout_rate = 0.0f;

  const void *q = nullptr, *k = nullptr, *v = nullptr, *bias = nullptr;
  const int32_t *seqlens_q = nullptr, *seqlens_kv = nullptr;  // (b,), padding
  const int32_t* ragged_offsets = nullptr;                    // (4, ragged_stride)
  int64_t ragged_stride = 0;
  const void *seed = nullptr, *offset = nullptr;  // one int64 each (device)
  const float* sink_logits = nullptr;             // (h,)
  const float* fp8_scales = nullptr;              // rows above
  float* amax = nullptr;                          // amax rows above

  // Forward results; backward inputs.
  void* o = nullptr;
  float* stats = nullptr;
  // Backward only.
  const void* dout = nullptr;
  void *grad_q = nullptr, *grad_k = nullptr, *grad_v = nullptr, *grad_bias = nullptr;
  float* grad_sink = nullptr;  // (h,)
};

// Asked once per call for the graph's scratch (XLA's scratch allocator, or cudaMalloc in the
// check program); returns nullptr on failure.
using WorkspaceFn = std::function<void*(size_t)>;

inline bool attention_io_dtype_ok(DType t, bool fp8) {
  return fp8 ? t == DType::kE4M3 : (t == DType::kBF16 || t == DType::kF16);
}

inline Status validate(const AttentionParams& p) {
  if (p.b <= 0 || p.h <= 0 || p.hk <= 0 || p.sq <= 0 || p.skv <= 0 || p.d <= 0 || p.dv <= 0)
    return Status::Invalid("attention: every dimension must be positive");
  if (p.h % p.hk) return Status::Invalid("attention: q's heads must be a multiple of k's heads");
  if (!attention_io_dtype_ok(p.dtype, p.fp8))
    return Status::Invalid(p.fp8 ? "attention: fp8 q, k, v must be float8_e4m3fn"
                                 : "attention: q, k, v must be bfloat16 or float16");
  if (p.d % 8 || p.dv % 8) return Status::Invalid("attention: head dims must be multiples of 8");
  if (p.bias && ((p.bias_b != 1 && p.bias_b != p.b) || (p.bias_h != 1 && p.bias_h != p.h)))
    return Status::Invalid("attention: bias must be (1 or b, 1 or h, sq, skv)");
  if (p.ragged && !p.padding) return Status::Invalid("attention: ragged layouts need seqlens");
  if (p.dropout && !(p.dropout_rate > 0.0f && p.dropout_rate < 1.0f))
    return Status::Invalid("attention: dropout rate must be in (0, 1)");
  if (p.fp8 && p.fp8_scales == nullptr) return Status::Invalid("attention: fp8 needs its scales");
  return Status::Ok();
}

// CUDA backend (`stream` is a cudaStream_t). Forward: o, stats (and amax with fp8). Backward:
// dq, dk, dv (dbias, dsink, amax). Never synchronizes; the graph is built (and cached) on the
// first call of its shape. Without cuDNN support compiled in, both return an error.
Status attention_fwd_cuda(const AttentionParams& p, void* stream, const WorkspaceFn& ws);
Status attention_bwd_cuda(const AttentionParams& p, void* stream, const WorkspaceFn& ws);
// Loads libcudnn (path, else "libcudnn.so.9" from the loader's path); 0 on success, else the
// reason in `err` (up to err_len bytes). Idempotent. cuDNN version (e.g. 91900) or 0.
int attention_cudnn_load(const char* path, char* err, int err_len);
int64_t attention_cudnn_version();

}  // namespace lowbit
