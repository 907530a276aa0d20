// Internals of the CUDA grouped GEMM (lowbit/grouped_gemm.h), shared by grouped_gemm.cu (the
// dispatcher and the fallback kernel) and the grouped_gemm_*.cu files that each instantiate one
// CUTLASS sm90 ptr-array grouped GEMM.
//
// One call runs, on the caller's stream:
//  1. a one-block setup kernel: group offsets from group_sizes (an int64 scan, clamped to the
//     grouped extent), each group's path, alpha = a_s[g] * b_s[g], and CUTLASS's per-group
//     problem shapes, pointers and strides, all written into the workspace;
//  2. ragged K with K-major operands (FP8 wgrad): a copy of the groups that do not start on a
//     16-byte boundary to aligned slots (TMA reads only from such addresses); exits at once
//     when every group is aligned;
//  3. the CUTLASS grouped GEMM (persistent; reads the problem shapes on the device);
//  4. the fallback kernel for what CUTLASS cannot take: unaligned strides, empty ragged-K groups
//     (their output is zero) and ragged-M rows in no group (zero). It exits at once when there
//     is nothing of the kind.
// Nothing is copied to the host and nothing synchronises, so XLA may capture it in a graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "lowbit/grouped_gemm.h"

// The CUDA library is built with -DLOWBIT_HAVE_CUTLASS=1 when the headers are found; other
// targets that compile these files (the standalone checks) get CUTLASS when its headers are on
// their include path and nvcc runs with --expt-relaxed-constexpr (CUTLASS needs it); without,
// grouped_gemm_cuda says it was built without CUTLASS.
#ifndef LOWBIT_HAVE_CUTLASS
#if defined(__has_include) && defined(__CUDACC_RELAXED_CONSTEXPR__)
#if __has_include(<cutlass/cutlass.h>)
#define LOWBIT_HAVE_CUTLASS 1
#endif
#endif
#endif
#ifndef LOWBIT_HAVE_CUTLASS
#define LOWBIT_HAVE_CUTLASS 0
#endif

namespace lowbit {
namespace gg {

// Per-group results of the setup kernel, read by the later kernels and CUTLASS's epilogue.
enum Path : int32_t { kPathCutlass = 0, kPathFallback = 1, kPathNone = 2 };
struct GroupInfo {
  int64_t start;  // first row of the group on the grouped axis (clamped)
  int64_t size;   // rows of the group (clamped)
  int64_t slot;   // ragged K, realigned: first column of the group's copy; else -1
  int32_t path;
  float alpha;  // decode scale of the group's product (1 for BF16)
};

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Workspace: [GroupInfo x G | covered rows, any-realign flag (int64 each)] [realign copies]
// [CUTLASS arrays] [CUTLASS workspace].
inline size_t info_bytes(int64_t groups) {
  return align_up(size_t(groups) * sizeof(GroupInfo) + 2 * sizeof(int64_t), 256);
}

// Ragged K reads each group's K-major operands from column start_g, which TMA can only take at
// a 16-byte boundary. Groups that start elsewhere are copied to 16-aligned slots of a scratch
// (rows x realign_cols) first; the slots hold at most k + 15 * G columns.
inline int64_t realign_cols(int64_t k, int64_t groups) {
  return int64_t(align_up(size_t(k + 15 * groups), 16));
}

// Everything the device kernels need about one call, by value.
struct Problem {
  int32_t mode;  // GroupedGemmMode
  int64_t m, n, k, groups;
  const int32_t* group_sizes;
  const char* a;
  const char* b;
  char* out;
  int32_t a_dtype, b_dtype;  // DType
  bool a_kmajor, b_kmajor;
  int64_t lda, ldb, b_group_stride;
  const float* a_scale_inv;
  const float* b_scale_inv;
  bool block_scaled;  // FP8 block scales (lowbit/grouped_gemm.h), alpha 1
  int32_t b_block_n;  // 1 or 128
  bool cutlass_ok;    // a CUTLASS kernel is there and every stride is 16-byte aligned
  GroupInfo* info;
  int64_t* flags;   // [0]: ragged M, rows covered by the groups; [1]: some group is realigned
  char* realign_a;  // ragged K, K-major A: (m, realign_ld) scratch, or null
  char* realign_b;  // ragged K, K-major B: (n, realign_ld) scratch, or null
  int64_t realign_ld;
};

// `info_area`: info_bytes(); `realign_area`: ragged K's realigned copies, or null.
Problem make_problem(const GroupedGemmParams& p, void* info_area, void* realign_area,
                     bool cutlass_ok);

// One group's operands as (pointer, element strides): A(i, c) = A[i * a_si + c * a_sc],
// B(c, j) = B[c * b_sc + j * b_sj], D(i, j) = D[i * n + j]; out extent rows x n, contraction
// kc. a_ld / b_ld: the strides that are not 1, as CUTLASS's stride arrays take them.
// Block scaling: the decode scale of A(i, c) is SA[(c / 128) * sa_ld + i], that of B(c, j)
// SB[(c / 128) * sb_ld + j / b_block_n] (c counted from the group's first contraction index);
// SA / SB are null otherwise.
struct GroupView {
  const char* A;
  const char* B;
  char* D;
  int64_t a_si, a_sc, b_sc, b_sj, a_ld, b_ld;
  int64_t rows, kc;
  const float* SA;
  const float* SB;
  int64_t sa_ld, sb_ld;
};

__host__ __device__ inline GroupView group_view(const Problem& p, int64_t g, int64_t start,
                                                int64_t size) {
  GroupView v;
  const int ea = p.a_dtype == int32_t(DType::kBF16) ? 2 : 1;
  const int eb = p.b_dtype == int32_t(DType::kBF16) ? 2 : 1;
  if (p.mode == int32_t(GroupedGemmMode::kRaggedM)) {
    v.A = p.a + start * p.lda * ea;
    v.B = p.b + g * p.b_group_stride * eb;
    v.D = p.out + start * p.n * 2;
    v.rows = size;
    v.kc = p.k;
  } else {
    v.A = p.a + (p.a_kmajor ? start : start * p.lda) * ea;
    v.B = p.b + (p.b_kmajor ? start : start * p.ldb) * eb;
    v.D = p.out + g * p.m * p.n * 2;
    v.rows = p.m;
    v.kc = size;
  }
  v.a_si = p.a_kmajor ? p.lda : 1;
  v.a_sc = p.a_kmajor ? 1 : p.lda;
  v.b_sc = p.b_kmajor ? 1 : p.ldb;
  v.b_sj = p.b_kmajor ? p.ldb : 1;
  v.a_ld = p.lda;
  v.b_ld = p.ldb;
  v.SA = v.SB = nullptr;
  v.sa_ld = v.sb_ld = 0;
  if (p.block_scaled) {
    const BlockScaleOffsets o = grouped_block_scale_offsets(
        p.mode == int32_t(GroupedGemmMode::kRaggedM), p.m, p.n, p.k, p.b_block_n, g, start, size);
    v.SA = p.a_scale_inv + o.a_off;
    v.SB = p.b_scale_inv + o.b_off;
    v.sa_ld = o.a_ld;
    v.sb_ld = o.b_ld;
  }
  return v;
}

__host__ __device__ inline bool aligned16(const void* a, const void* b, const void* c) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
           reinterpret_cast<uintptr_t>(c)) &
          15u) == 0;
}

// Writes nothing besides GroupInfo (no CUTLASS kernel for this call).
struct NoArrays {
  __device__ void write(int64_t, const GroupView&, bool, GroupInfo*) const {}
};

constexpr int kSetupThreads = 512;

// Block-wide inclusive scan of one int64 per thread (kSetupThreads threads). Ends with a
// barrier after its last read of warp_sums, so calls may follow each other.
__device__ inline int64_t block_inclusive_scan(int64_t v, int64_t* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kSetupThreads / 32 ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += u;
    }
    warp_sums[lane] = w;  // inclusive totals per warp
  }
  __syncthreads();
  const int64_t out = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();
  return out;
}

// One block: group offsets (an int64 scan of the clamped sizes), each group's path and alpha,
// realignment slots, and (through `arrays`) CUTLASS's per-group arguments.
template <class Arrays>
__global__ void __launch_bounds__(kSetupThreads) setup_kernel(Problem p, Arrays arrays) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t carry, slot_carry;
  const int64_t extent = p.mode == int32_t(GroupedGemmMode::kRaggedM) ? p.m : p.k;
  const bool fp8 = p.a_dtype != int32_t(DType::kBF16);
  const int ea = fp8 ? 1 : 2, eb = p.b_dtype == int32_t(DType::kBF16) ? 2 : 1;
  if (threadIdx.x == 0) {
    carry = 0;
    slot_carry = 0;
    p.flags[1] = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < p.groups; base += kSetupThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t v = g < p.groups ? int64_t(p.group_sizes[g]) : 0;
    v = v < 0 ? 0 : (v > extent ? extent : v);  // keeps the int64 sum far from overflow
    const int64_t incl = block_inclusive_scan(v, warp_sums);
    const int64_t off = carry + incl - v;
    const int64_t start = off < extent ? off : extent;
    const int64_t size = v < extent - start ? v : extent - start;
    const int64_t slot_size = (size + 15) / 16 * 16;
    const int64_t slot_incl = block_inclusive_scan(slot_size, warp_sums);
    const int64_t slot = slot_carry + slot_incl - slot_size;
    __syncthreads();  // every thread has read carry and slot_carry
    if (threadIdx.x == kSetupThreads - 1) {
      carry += incl;
      slot_carry += slot_incl;
    }
    if (g < p.groups) {
      GroupView view = group_view(p, g, start, size);
      int32_t path;
      int64_t realigned = -1;
      if (view.rows == 0 || p.n == 0) {
        path = kPathNone;
      } else if (view.kc == 0) {
        path = kPathFallback;  // zero output; CUTLASS would leave it unwritten
      } else if (!p.cutlass_ok) {
        path = kPathFallback;
      } else if (aligned16(view.A, view.B, view.D)) {
        path = kPathCutlass;
      } else if ((p.realign_a || p.realign_b) && aligned16(nullptr, nullptr, view.D)) {
        // Ragged K: read the K-major operands from their realigned copies.
        if (p.realign_a) {
          view.A = p.realign_a + slot * ea;
          view.a_si = view.a_ld = p.realign_ld;
        }
        if (p.realign_b) {
          view.B = p.realign_b + slot * eb;
          view.b_sj = view.b_ld = p.realign_ld;
        }
        const bool ok = aligned16(view.A, view.B, view.D);
        path = ok ? kPathCutlass : kPathFallback;
        if (ok) {
          realigned = slot;
          p.flags[1] = 1;
        }
      } else {
        path = kPathFallback;
      }
      GroupInfo& gi = p.info[g];
      gi.start = start;
      gi.size = size;
      gi.slot = realigned;
      gi.path = path;
      gi.alpha = fp8 && !p.block_scaled ? p.a_scale_inv[g] * p.b_scale_inv[g] : 1.0f;
      arrays.write(g, view, path == kPathCutlass, &gi);
    }
    __syncthreads();  // carries updated before the next chunk
  }
  if (threadIdx.x == 0) p.flags[0] = carry < extent ? carry : extent;
}

// One CUTLASS configuration, as seen by the dispatcher.
struct Config {
  size_t (*arrays_bytes)(int64_t groups);
  size_t (*cutlass_bytes)(int sm_count);
  // The setup kernel, writing CUTLASS's per-group arguments into `arrays`.
  Status (*setup)(const Problem& p, char* arrays, cudaStream_t stream);
  // The CUTLASS grouped GEMM on those arguments.
  Status (*gemm)(const Problem& p, char* arrays, char* cutlass_ws, size_t cutlass_ws_bytes,
                 int sm_count, cudaStream_t stream);
};

// The instantiations, one translation unit each, generated from LOWBIT_GROUPED_GEMM_CONFIGS in
// CMakeLists.txt (grouped_gemm_config.cu.in); each returns its Config.
#if LOWBIT_HAVE_CUTLASS
const Config& config_bf16_kk();  // A K-major, B K-major   (dgrad: dout . rhs^T)
const Config& config_bf16_kn();  // A K-major, B N-major   (forward: lhs . rhs)
const Config& config_bf16_mn();  // A M-major, B N-major   (wgrad: lhs^T . dout)
// FP8 per-group scales (A type, B type): split accumulation, or fast (`_fast`: wide tiles).
const Config& config_fp8_e4m3_e4m3_fast();
const Config& config_fp8_e4m3_e4m3();
const Config& config_fp8_e5m2_e4m3_fast();
const Config& config_fp8_e5m2_e4m3();
const Config& config_fp8_e4m3_e5m2_fast();
const Config& config_fp8_e4m3_e5m2();
// FP8 block scaling: A 1x128; B 128x128 (n128) or 1x128 (n1).
const Config& config_block_e4m3_e4m3_n128();
const Config& config_block_e5m2_e4m3_n128();
const Config& config_block_e4m3_e4m3_n1();
const Config& config_block_e5m2_e4m3_n1();
const Config& config_block_e4m3_e5m2_n1();
#endif

// SM count of the current device (cached per device).
int current_sm_count();

Status cuda_status(cudaError_t e, const char* what);

}  // namespace gg
}  // namespace lowbit

// ------------------------------------------------------------------------------------------------
// CUTLASS kernels: only the instantiation files define LOWBIT_GG_INSTANTIATE before including.
#if LOWBIT_HAVE_CUTLASS && defined(LOWBIT_GG_INSTANTIATE)

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.hpp"

namespace lowbit {
namespace gg {

using namespace cute;

// Tile and cluster choices. The cluster spans N: N is static and a multiple of the tile in the
// MoE shapes, while a cluster along the ragged M axis would pad every group to two M tiles.
struct Bf16Tiles {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// FP8 with CUTLASS's split (promoted) accumulation keeps a second set of accumulators in
// registers: a 128x256 tile spills, so split GEMMs take 128x128; fast accumulation keeps one set
// and the wide tile.
struct Fp8Tiles {
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// Fast accumulation (TE 2.20's default for every grouped FP8 GEMM): one accumulator set, the wide
// tile. Also where split accumulation is asked for but adds the same sums: the weight gradient of
// many small experts (ragged K, <= 256 rows per group on average; pick_config in grouped_gemm.cu),
// where each tile runs one or two 128-deep k-blocks and then stores its BF16 tile, so the per-tile
// cost (group switch, epilogue) bounds it and the wide tile halves the tiles. (A 64 x 128
// ping-pong tile measured slower: 0.70 ms against 0.54 at G=128.)
struct Fp8FastTiles {
  using Tile = Shape<_128, _256, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Blockwise-scaled FP8 (CUTLASS's sm90 ptr-array blockwise collective): the scale loads go
// through cp.async in a producer warp, the partial sums of each 128-deep k-block are scaled and
// promoted in float32 registers (split accumulation), so the tile is 128x128.
template <int GranN>
struct BlockTiles {
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  // Scales: A per (1 row, 128 k), B per (GranN columns, 128 k), both M/N-major (CUTLASS sm90
  // reads only MN-major scale layouts).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranN, 128>;
};

template <class Tiles, class = void>
struct ScaleTypes {
  static constexpr bool kBlockwise = false;
  using LayoutSFA = int;
  using LayoutSFB = int;
  template <class L>
  using PairA = L*;
  template <class L>
  using PairB = L*;
};
template <class Tiles>
struct ScaleTypes<Tiles, std::void_t<typename Tiles::ScaleConfig>> {
  static constexpr bool kBlockwise = true;
  using LayoutSFA = decltype(Tiles::ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(Tiles::ScaleConfig::deduce_layoutSFB());
  template <class L>
  using PairA = cute::tuple<L*, LayoutSFA*>;
  template <class L>
  using PairB = cute::tuple<L*, LayoutSFB*>;
};

template <class EA, class EB, bool AKMajor, bool BKMajor, class Tiles>
struct GroupedKernel {
  using TilesT = Tiles;
  using Scales = ScaleTypes<Tiles>;
  static constexpr bool kBlockwise = Scales::kBlockwise;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA =
      std::conditional_t<AKMajor, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutB =
      std::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16 / sizeof(EA);
  static constexpr int kAlignB = 16 / sizeof(EB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tiles::Tile,
      typename Tiles::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, typename Tiles::EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA,
      typename Scales::template PairA<LayoutA>, kAlignA, EB,
      typename Scales::template PairB<LayoutB>, kAlignB, float, typename Tiles::Tile,
      typename Tiles::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::Schedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// A cute stride with one dynamic (int64) mode, set to `ld`.
template <class S>
CUTLASS_HOST_DEVICE S stride_with_ld(int64_t ld) {
  S s{};
  if constexpr (cute::is_static<decltype(cute::get<0>(s))>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// Per-group CUTLASS arguments in the workspace, carved the same way for sizing and for use.
template <class K>
struct Arrays {
  typename K::Shape3* shapes;
  const void** a;
  const void** b;
  void** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideD* sd;
  const float** alpha;
  // Block scaling only (else unused, null): per-group scale pointers and layouts.
  const float** sfa;
  const float** sfb;
  typename K::Scales::LayoutSFA* lsfa;
  typename K::Scales::LayoutSFB* lsfb;
  int64_t n;  // N of every group (the row stride of D)

  static size_t carve(char* base, int64_t groups, Arrays* out) {
    size_t off = 0;
    auto take = [&](size_t bytes) {
      char* p = base ? base + off : nullptr;
      off = align_up(off + bytes, 128);
      return p;
    };
    const size_t G = size_t(groups);
    char* shapes = take(G * sizeof(typename K::Shape3));
    char* a = take(G * sizeof(void*));
    char* b = take(G * sizeof(void*));
    char* d = take(G * sizeof(void*));
    char* sa = take(G * sizeof(typename K::StrideA));
    char* sb = take(G * sizeof(typename K::StrideB));
    char* sd = take(G * sizeof(typename K::StrideD));
    char* alpha = take(G * sizeof(float*));
    char *sfa = nullptr, *sfb = nullptr, *lsfa = nullptr, *lsfb = nullptr;
    if constexpr (K::kBlockwise) {
      sfa = take(G * sizeof(float*));
      sfb = take(G * sizeof(float*));
      lsfa = take(G * sizeof(typename K::Scales::LayoutSFA));
      lsfb = take(G * sizeof(typename K::Scales::LayoutSFB));
    }
    if (out) {
      out->sfa = reinterpret_cast<const float**>(sfa);
      out->sfb = reinterpret_cast<const float**>(sfb);
      out->lsfa = reinterpret_cast<typename K::Scales::LayoutSFA*>(lsfa);
      out->lsfb = reinterpret_cast<typename K::Scales::LayoutSFB*>(lsfb);
      out->shapes = reinterpret_cast<typename K::Shape3*>(shapes);
      out->a = reinterpret_cast<const void**>(a);
      out->b = reinterpret_cast<const void**>(b);
      out->d = reinterpret_cast<void**>(d);
      out->sa = reinterpret_cast<typename K::StrideA*>(sa);
      out->sb = reinterpret_cast<typename K::StrideB*>(sb);
      out->sd = reinterpret_cast<typename K::StrideD*>(sd);
      out->alpha = reinterpret_cast<const float**>(alpha);
    }
    return off;
  }

  __device__ void write(int64_t g, const GroupView& v, bool use, GroupInfo* gi) const {
    // Groups CUTLASS skips get an M of 0 (no tiles); their pointers are never read.
    shapes[g] = use ? make_shape(int(v.rows), int(n), int(v.kc)) : make_shape(0, 0, 0);
    a[g] = v.A;
    b[g] = v.B;
    d[g] = v.D;
    sa[g] = stride_with_ld<typename K::StrideA>(v.a_ld);
    sb[g] = stride_with_ld<typename K::StrideB>(v.b_ld);
    sd[g] = stride_with_ld<typename K::StrideD>(n);
    alpha[g] = &gi->alpha;
    if constexpr (K::kBlockwise) {
      // CUTLASS derives each group's scale layout from its extents (k-block stride = the
      // group's M, resp. ceil(N / GranN)); the grouped layouts of lowbit/grouped_gemm.h are
      // those, so only the base pointers move per group.
      using SC = typename K::TilesT::ScaleConfig;
      const auto mnk = make_shape(use ? int(v.rows) : 0, use ? int(n) : 0, use ? int(v.kc) : 0, 1);
      sfa[g] = v.SA;
      sfb[g] = v.SB;
      lsfa[g] = SC::tile_atom_to_shape_SFA(mnk);
      lsfb[g] = SC::tile_atom_to_shape_SFB(mnk);
    }
  }
};

template <class K>
size_t arrays_bytes(int64_t groups) {
  return Arrays<K>::carve(nullptr, groups, nullptr);
}

template <class K>
typename K::Gemm::Arguments make_arguments(const Arrays<K>& arr, int64_t groups, bool fp8,
                                           int sm_count) {
  typename K::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(groups), arr.shapes, nullptr};
  args.mainloop.ptr_A = reinterpret_cast<typename K::Kernel::ElementA const**>(arr.a);
  args.mainloop.dA = arr.sa;
  args.mainloop.ptr_B = reinterpret_cast<typename K::Kernel::ElementB const**>(arr.b);
  args.mainloop.dB = arr.sb;
  if constexpr (K::kBlockwise) {
    args.mainloop.ptr_SFA = arr.sfa;
    args.mainloop.layout_SFA = arr.lsfa;
    args.mainloop.ptr_SFB = arr.sfb;
    args.mainloop.layout_SFB = arr.lsfb;
  }
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = fp8 ? arr.alpha : nullptr;  // alpha = a_s[g] * b_s[g]
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, fp8 ? 1 : 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<typename K::ElementD**>(arr.d);
  args.epilogue.dD = arr.sd;
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class K>
size_t cutlass_bytes(int sm_count) {
  Arrays<K> arr{};
  auto args = make_arguments<K>(arr, 1, true, sm_count);
  return K::Gemm::get_workspace_size(args);
}

template <class K>
Status setup(const Problem& p, char* arrays_area, cudaStream_t stream) {
  Arrays<K> arr{};
  Arrays<K>::carve(arrays_area, p.groups, &arr);
  arr.n = p.n;
  setup_kernel<Arrays<K>><<<1, kSetupThreads, 0, stream>>>(p, arr);
  return cuda_status(cudaGetLastError(), "grouped_gemm setup kernel");
}

template <class K>
Status gemm(const Problem& p, char* arrays_area, char* ws, size_t ws_bytes, int sm_count,
            cudaStream_t stream) {
  Arrays<K> arr{};
  Arrays<K>::carve(arrays_area, p.groups, &arr);
  // Per-group alpha for tensor-scaled FP8; block scales are applied in the mainloop (alpha 1).
  const bool fp8 = p.a_dtype != int32_t(DType::kBF16) && !K::kBlockwise;
  auto args = make_arguments<K>(arr, p.groups, fp8, sm_count);
  cudaGetDevice(&args.hw_info.device_id);
  if (K::Gemm::get_workspace_size(args) > ws_bytes)
    return Status::Invalid("grouped_gemm: CUTLASS workspace too small");
  typename K::Gemm op;
  if (op.can_implement(args) != cutlass::Status::kSuccess)
    return Status::Invalid("grouped_gemm: CUTLASS cannot run this problem");
  const cutlass::Status init = op.initialize(args, ws, stream);
  const cutlass::Status launch = init == cutlass::Status::kSuccess ? op.run(stream) : init;
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_status(e, "grouped_gemm: CUTLASS kernel launch");
  if (launch != cutlass::Status::kSuccess)
    return Status::Invalid(std::string("grouped_gemm: CUTLASS ") +
                           (init != cutlass::Status::kSuccess ? "initialize" : "launch") +
                           " failed: " + cutlass::cutlassGetStatusString(launch));
  return Status::Ok();
}

template <class K>
const Config& make_config() {
  static const Config c{&arrays_bytes<K>, &cutlass_bytes<K>, &setup<K>, &gemm<K>};
  return c;
}

}  // namespace gg
}  // namespace lowbit

#endif  // LOWBIT_HAVE_CUTLASS && LOWBIT_GG_INSTANTIATE
