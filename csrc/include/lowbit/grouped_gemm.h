// Kernel-level interface of the grouped GEMM (mixture of experts), in two shapes:
//
//   ragged M (forward, dgrad): out(M, N); rows [start_g, start_g + size_g) of out are
//       A[those rows] (size_g, K) . B_g (K, N)             B_g at b + g * b_group_stride
//   ragged K (wgrad):          out(G, M, N); out[g] = A_g (M, size_g) . B_g (size_g, N), where
//       A_g and B_g are the rows [start_g, start_g + size_g) of the grouped K axis.
//
// Group g's rows are [start_g, start_g + size_g): start = exclusive cumulative sum of the sizes,
// both clamped to the grouped extent R (M or K); negative sizes count as 0. So a sum below R
// leaves rows in no group (their ragged-M output rows are zero) and a sum above R never reads
// or writes past R. Ragged-K groups with no rows get zero output.
//
// Operands are BF16, or FP8 (E4M3/E5M2, not both E5M2) with one float32 decode scale per group
// for each operand, multiplied into the result: out = (sum of products) * (a_s[g] * b_s[g]);
// or FP8 with block scales (block_scaled, Float8BlockScaling): one float32 decode scale per
// 1x128 block of A along the contraction, and per 1x128 or 128x128 block of B (b_block_n = 1 or
// 128 along n), each product being A(i, c) s_A(i, c) . B(c, j) s_B(c, j) (the CUDA kernel
// scales the float32 partial sum of each 128-deep block instead; the same up to rounding).
// Products accumulate in float32; out is BF16. Group sizes and scales stay on the device for
// CUDA: the kernels derive everything from them there (no host copy, no synchronisation).
//
// CUDA kernels: CUTLASS's sm90 ptr-array grouped GEMMs (grouped_gemm_cutlass.cuh); for ragged-M
// calls with 1x128 x 128x128 block scales also lowbit's own sm_90a kernel in its grouped form
// (grouped_gemm_sm90.cu), the two timed at the first call per shape and the faster kept
// (grouped_gemm_select.cc). LOWBIT_GROUPED_BLOCK_GEMM: auto (default), cutlass, sm90own or
// sm90own:n128[_mc]/group<8|16>; LOWBIT_GROUPED_BLOCK_GEMM_LOG=1 prints the measurements.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lowbit/block_scaling.h"
#include "lowbit/error.h"
#include "lowbit/tensor.h"

namespace lowbit {

enum class GroupedGemmMode : int32_t {
  kRaggedM = abi::kGroupedRaggedM,
  kRaggedK = abi::kGroupedRaggedK
};

struct GroupedGemmParams {
  GroupedGemmMode mode = GroupedGemmMode::kRaggedM;
  // GEMM extents: out (m, n) per row block (ragged M) or per group (ragged K), contraction k.
  // The grouped extent R is m for ragged M and k for ragged K.
  int64_t m = 0, n = 0, k = 0;
  int64_t num_groups = 0;
  const int32_t* group_sizes = nullptr;  // (num_groups,)

  // A (logical (m, k)): K-major = element (i, c) at a[i * lda + c]; else a[c * lda + i].
  // Ragged M needs K-major A (its rows are the groups).
  const void* a = nullptr;
  DType a_dtype = DType::kBF16;
  bool a_kmajor = true;
  int64_t lda = 0;
  // B (logical (k, n)): K-major = element (c, j) at b[j * ldb + c]; else b[c * ldb + j].
  // Ragged M: group g's B starts at b + g * b_group_stride elements.
  const void* b = nullptr;
  DType b_dtype = DType::kBF16;
  bool b_kmajor = false;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;

  // FP8 only: (num_groups,) float32 decode scales of A and B; with block_scaled, the block
  // scales in the per-group, M-major layouts CUTLASS's grouped blockwise GEMM reads (see
  // grouped_block_scale_offsets):
  //   ragged M: A: the grouped rowwise layout of lowbit/block_scaling.h for the (m, k) operand
  //             (group g at start_g * ceil(k/128), (ceil(k/128), size_g) M-major);
  //             B: (num_groups, ceil(k/128), ceil(n/b_block_n)) row-major.
  //   ragged K: A / B: the grouped colwise layouts of lowbit/block_scaling.h of the token-major
  //             (m, k) / (n, k) operands: (k/128 + G, m) and (k/128 + G, n); b_block_n = 1.
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  bool block_scaled = false;
  int32_t b_block_n = 1;
  int64_t a_scale_elements = -1, b_scale_elements = -1;  // -1: unchecked

  void* out = nullptr;  // row-major, ld = n
  DType out_dtype = DType::kBF16;

  bool fast_accum = false;  // CUDA FP8: no periodic promotion of the partial sums (forward)

  // Buffer sizes in elements, checked against the extents the strides reach (-1: unchecked).
  int64_t a_elements = -1, b_elements = -1, out_elements = -1;

  void* workspace = nullptr;  // CUDA only, grouped_gemm_workspace_bytes()
  size_t workspace_bytes = 0;
};

inline bool grouped_is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// Block scales of group g (rows [start, start + size) of the grouped axis): the decode scale of
// A(i, c) is a_s[a_off + (c / 128) * a_ld + i] and that of B(c, j) is
// b_s[b_off + (c / 128) * b_ld + j / b_block_n], c counted from the group's first row (ragged
// K) or from 0 (ragged M).
struct BlockScaleOffsets {
  int64_t a_off, a_ld, b_off, b_ld;
};
LOWBIT_HD BlockScaleOffsets grouped_block_scale_offsets(bool ragged_m, int64_t m, int64_t n,
                                                        int64_t k, int32_t b_block_n, int64_t g,
                                                        int64_t start, int64_t size) {
  BlockScaleOffsets o;
  if (ragged_m) {
    const int64_t nkb = (k + 127) / 128, nbn = (n + b_block_n - 1) / b_block_n;
    o.a_off = start * nkb;
    o.a_ld = size;
    o.b_off = g * nkb * nbn;
    o.b_ld = nbn;
  } else {
    const int64_t first = grouped_block_colwise_first(start, g);
    o.a_off = first * m;
    o.a_ld = m;
    o.b_off = first * n;
    o.b_ld = n;
  }
  return o;
}

// Checks shared by both backends (the Python side checks first, with clearer messages).
inline Status validate(const GroupedGemmParams& p) {
  const char* w = "grouped_gemm: ";
  auto bad = [&](const char* m) { return Status::Invalid(std::string(w) + m); };
  if (p.m < 0 || p.n < 0 || p.k < 0) return bad("negative dimension");
  if (p.num_groups < 1) return bad("need at least one group");
  if (p.mode != GroupedGemmMode::kRaggedM && p.mode != GroupedGemmMode::kRaggedK)
    return bad("unknown mode");
  const bool fp8 = grouped_is_fp8(p.a_dtype) && grouped_is_fp8(p.b_dtype);
  const bool bf16 = p.a_dtype == DType::kBF16 && p.b_dtype == DType::kBF16;
  if (!fp8 && !bf16) return bad("operands must both be BF16 or both FP8 (E4M3/E5M2)");
  if (fp8 && p.a_dtype == DType::kE5M2 && p.b_dtype == DType::kE5M2)
    return bad("E5M2 x E5M2 is not supported (one operand must be E4M3)");
  if (fp8 && (!p.a_scale_inv || !p.b_scale_inv)) return bad("FP8 operands need per-group scales");
  if (p.block_scaled) {
    if (!fp8) return bad("block scaling needs FP8 operands");
    if (p.b_block_n != 1 && p.b_block_n != 128) return bad("b_block_n must be 1 or 128");
    if (p.mode == GroupedGemmMode::kRaggedK && p.b_block_n != 1)
      return bad("ragged K takes 1x128 block scales for B (b_block_n = 1)");
    int64_t a_need, b_need;
    if (p.mode == GroupedGemmMode::kRaggedM) {
      const int64_t nkb = (p.k + 127) / 128;
      a_need = p.m * nkb;
      b_need = p.num_groups * nkb * ((p.n + p.b_block_n - 1) / p.b_block_n);
    } else {
      a_need = grouped_block_colwise_rows(p.k, p.num_groups) * p.m;
      b_need = grouped_block_colwise_rows(p.k, p.num_groups) * p.n;
    }
    if ((p.a_scale_elements >= 0 && p.a_scale_elements < a_need) ||
        (p.b_scale_elements >= 0 && p.b_scale_elements < b_need))
      return bad("block scales smaller than the grouped layouts need");
  }
  if (p.out_dtype != DType::kBF16) return bad("the output must be BF16");
  if (p.mode == GroupedGemmMode::kRaggedM && !p.a_kmajor)
    return bad("ragged M needs a K-major A (its rows are the groups)");
  if (p.mode == GroupedGemmMode::kRaggedK && p.b_group_stride != 0)
    return bad("ragged K takes no b_group_stride");
  if (!p.group_sizes) return bad("missing group sizes");
  // Reach of each operand, in elements (the last element addressed, plus one).
  auto reach = [](bool kmajor, int64_t rows_kmajor, int64_t cols_kmajor, int64_t ld) -> int64_t {
    // kmajor: (rows, cols) with row stride ld; otherwise the transpose, (cols, rows).
    const int64_t r = kmajor ? rows_kmajor : cols_kmajor, c = kmajor ? cols_kmajor : rows_kmajor;
    return (r == 0 || c == 0) ? 0 : (r - 1) * ld + c;
  };
  const int64_t lda_min = p.a_kmajor ? p.k : p.m, ldb_min = p.b_kmajor ? p.k : p.n;
  if (p.lda < lda_min || p.ldb < ldb_min) return bad("leading dimension smaller than a row");
  const int64_t a_need = reach(p.a_kmajor, p.m, p.k, p.lda);
  int64_t b_need = reach(p.b_kmajor, p.n, p.k, p.ldb);
  if (p.mode == GroupedGemmMode::kRaggedM && b_need > 0)
    b_need += (p.num_groups - 1) * p.b_group_stride;
  const int64_t out_need = p.m * p.n * (p.mode == GroupedGemmMode::kRaggedK ? p.num_groups : 1);
  if (p.a_elements >= 0 && p.a_elements < a_need)
    return bad("operand a is smaller than its strides reach");
  if (p.b_elements >= 0 && p.b_elements < b_need)
    return bad("operand b is smaller than its strides reach");
  if (p.out_elements >= 0 && p.out_elements < out_need)
    return bad("output is smaller than its extents");
  if ((a_need && !p.a) || (b_need && !p.b) || (out_need && !p.out)) return bad("missing buffer");
  return Status::Ok();
}

// CPU backend (csrc/kernels/cpu/grouped_gemm.cc): float32 loops on threads.
Status grouped_gemm_cpu(const GroupedGemmParams& p);

// CUDA backend (csrc/kernels/cuda/grouped_gemm*.cu). Workspace: per-group arguments built on the
// device plus CUTLASS's own (TMA descriptors per SM), for the current device's SM count.
size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p);
Status grouped_gemm_cuda(const GroupedGemmParams& p, void* stream);

}  // namespace lowbit
