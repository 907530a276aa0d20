// lowbit's sm_90a FP8 block-scaled GEMM (lowbit/block_gemm.h) on CUTLASS's blockwise-scaling
// collective: out(M, N) = sum over 128-deep K blocks of (A . B^T)_block * sa * sb (+ bias).
//
// The mainloop (CUTLASS's sm90 warp-specialized, TMA-fed, persistent kernel) runs the 128-deep
// K tile as four FP8 wgmmas into zeroed registers, then promotes that partial sum into the
// float32 accumulator with the block's scale product (one FFMA per element per K block). A's
// 1x128 scales arrive through TMA (or cp.async), B's 128x128 or 1x128 scales through cp.async
// from a producer warp. The epilogue adds the float32 bias (null: none) to the accumulator and
// rounds once to BF16 or F32.
//
// Each family (A type, B type, B's scale block, output type) is its own translation unit,
// generated from block_gemm_config.cu.in by CMakeLists.txt (LOWBIT_BLOCK_GEMM_CONFIGS), holding
// its variants (tile shape and schedule).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "lowbit/gemm.h"

// Same detection as grouped_gemm_cutlass.cuh: the library is built with -DLOWBIT_HAVE_CUTLASS=1;
// other targets get CUTLASS when its headers are on the path and nvcc has --expt-relaxed-constexpr.
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
namespace bg {

// One compiled kernel. `bias` is float32 (N,) or null; `ws` the CUTLASS workspace.
struct Variant {
  const char* name;
  size_t (*workspace)(const GemmParams& p, int sm_count);
  Status (*run)(const GemmParams& p, const float* bias, int swizzle, void* ws, size_t ws_bytes,
                int sm_count, cudaStream_t stream);
};

struct Family {
  const Variant* variants;
  int count;
};

#if LOWBIT_HAVE_CUTLASS
// Generated (CMakeLists.txt): A 1x128 with B 128x128 ("1d2d") or 1x128 ("1d1d").
const Family& family_1d2d_e4m3_e4m3_bf16();
const Family& family_1d2d_e4m3_e4m3_f32();
const Family& family_1d2d_e5m2_e4m3_bf16();
const Family& family_1d2d_e5m2_e4m3_f32();
const Family& family_1d1d_e4m3_e4m3_bf16();
const Family& family_1d1d_e4m3_e4m3_f32();
const Family& family_1d1d_e4m3_e5m2_bf16();
const Family& family_1d1d_e4m3_e5m2_f32();
#endif

}  // namespace bg
}  // namespace lowbit

// ------------------------------------------------------------------------------------------------
// CUTLASS kernels: only the generated files define LOWBIT_BG_INSTANTIATE before including.
#if LOWBIT_HAVE_CUTLASS && defined(LOWBIT_BG_INSTANTIATE)

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "lowbit/block_scaling.h"

namespace lowbit {
namespace bg {

using namespace cute;

// Split (promoted) accumulation keeps a second accumulator set in registers, so a consumer
// warpgroup holds at most 64x128 of each: 128x128 for the cooperative schedule (two consumer
// warpgroups on one tile), 64x128 per warpgroup for ping-pong (the two alternate tiles, one's
// MMAs overlapping the other's promotion and epilogue).
struct CoopTiles {
  static constexpr const char* kName = "coop128x128_c1x2";
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
// The same tile with the cluster along M: the two CTAs share B's tile (multicast) instead of A's.
struct CoopTilesM2 {
  static constexpr const char* kName = "coop128x128_c2x1";
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_2, _1, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct PingTiles {
  static constexpr const char* kName = "ping64x128_c1x2";
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

// A per (1 row, 128 k), M-major; B per (GranN columns, 128 k): 1x128 blocks M/N-major like A,
// 128x128 tiles K-major (lowbit's 2D array has the K blocks contiguous).
template <int GranN>
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranN, 128, cute::GMMA::Major::MN,
                                                              GranN == 1 ? cute::GMMA::Major::MN
                                                                         : cute::GMMA::Major::K>;

template <class EA, class EB, int GranN, class EOut, class Tiles>
struct BlockKernel {
  using SC = ScaleConfig<GranN>;
  using LayoutSFA = decltype(SC::deduce_layoutSFA());
  using LayoutSFB = decltype(SC::deduce_layoutSFB());
  using LayoutA = cutlass::layout::RowMajor;     // A (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // B as CUTLASS's (K, N): our (N, K), K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignD = 16 / sizeof(EOut);

  // D = beta * C + (alpha * acc + bias) with no C, alpha 1, beta 0: acc + bias in float32,
  // rounded once to EOut.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<EOut, float, float, void, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tiles::Tile,
      typename Tiles::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      LayoutD, kAlignD, EOut, LayoutD, kAlignD, typename Tiles::EpiSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, cute::tuple<LayoutA, LayoutSFA>, 16,
      EB, cute::tuple<LayoutB, LayoutSFB>, 16, float, typename Tiles::Tile, typename Tiles::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::Schedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// A packed stride (ld, 1, batch) of CUTLASS's K-major / row-major operands.
template <class S>
S packed_stride(int64_t ld, int64_t batch) {
  S s{};
  cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;
  return s;
}

// lowbit's 1x128 scale array of a (rows, K) copy, (ceil(K/128), round_up(rows, 4)) row-major, as
// CUTLASS's M/N-major layout: extent round_up(rows, 4) (the padding entries are real memory, so
// TMA may read them; rows past `rows` are never stored), k-block stride round_up(rows, 4).
template <class L>
L scales_1d(int64_t rows, int64_t k) {
  const int ld = int(round_up4(rows)), nkb = int(ceil_div(k, 128));
  return L(make_shape(make_shape(_1{}, ld), make_shape(_128{}, nkb), 1),
           make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * nkb));
}

// lowbit's 128x128 scale array of an (N, K) copy, (ceil(N/128), round_up(ceil(K/128), 4)): the
// K-major layout with n-block stride round_up(ceil(K/128), 4).
template <class L>
L scales_2d(int64_t rows, int64_t k) {
  const int nkb = int(ceil_div(k, 128)), ld = int(round_up4(nkb)), nrb = int(ceil_div(rows, 128));
  return L(make_shape(make_shape(_128{}, nrb), make_shape(_128{}, nkb), 1),
           make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * nrb));
}

template <class K, int GranN>
typename K::Gemm::Arguments make_arguments(const GemmParams& p, const float* bias, int swizzle,
                                           int sm_count) {
  using Kernel = typename K::Kernel;
  using EA = typename Kernel::ElementA;
  using EB = typename Kernel::ElementB;
  using ED = typename Kernel::ElementD;
  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(int(p.m), int(p.n), int(p.k), 1);
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const EA*>(p.a);
  ml.dA = packed_stride<typename Kernel::StrideA>(p.k, p.m * p.k);
  ml.ptr_B = static_cast<const EB*>(p.b);
  ml.dB = packed_stride<typename Kernel::StrideB>(p.k, p.n * p.k);
  ml.ptr_SFA = p.a_scale_inv;
  ml.layout_SFA = scales_1d<typename K::LayoutSFA>(p.m, p.k);
  ml.ptr_SFB = p.b_scale_inv;
  if constexpr (GranN == 1) {
    ml.layout_SFB = scales_1d<typename K::LayoutSFB>(p.n, p.k);
  } else {
    ml.layout_SFB = scales_2d<typename K::LayoutSFB>(p.n, p.k);
  }
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.bias_ptr = bias;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.ptr_D = static_cast<ED*>(p.out);
  args.epilogue.dD = packed_stride<typename Kernel::StrideD>(p.n, p.m * p.n);
  cudaGetDevice(&args.hw_info.device_id);
  args.hw_info.sm_count = sm_count;
  args.scheduler.max_swizzle_size = swizzle;
  return args;
}

template <class K, int GranN>
size_t workspace(const GemmParams& p, int sm_count) {
  return K::Gemm::get_workspace_size(make_arguments<K, GranN>(p, nullptr, 1, sm_count));
}

template <class K, int GranN>
Status run(const GemmParams& p, const float* bias, int swizzle, void* ws, size_t ws_bytes,
           int sm_count, cudaStream_t stream) {
  auto args = make_arguments<K, GranN>(p, bias, swizzle, sm_count);
  if (K::Gemm::get_workspace_size(args) > ws_bytes)
    return Status::Invalid("block_gemm: CUTLASS workspace too small");
  if (K::Gemm::can_implement(args) != cutlass::Status::kSuccess)
    return Status::Invalid("block_gemm: CUTLASS cannot run M=" + std::to_string(p.m) +
                           " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k));
  typename K::Gemm op;
  const cutlass::Status init = op.initialize(args, ws, stream);
  const cutlass::Status launch = init == cutlass::Status::kSuccess ? op.run(stream) : init;
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::Invalid(std::string("block_gemm: CUTLASS launch: ") + cudaGetErrorString(e));
  if (launch != cutlass::Status::kSuccess)
    return Status::Invalid(std::string("block_gemm: CUTLASS ") +
                           (init != cutlass::Status::kSuccess ? "initialize" : "run") +
                           " failed: " + cutlass::cutlassGetStatusString(launch));
  return Status::Ok();
}

template <class EA, class EB, int GranN, class EOut, class Tiles>
constexpr Variant variant() {
  using K = BlockKernel<EA, EB, GranN, EOut, Tiles>;
  return Variant{Tiles::kName, &workspace<K, GranN>, &run<K, GranN>};
}

template <class EA, class EB, int GranN, class EOut>
const Family& make_family() {
  static const Variant v[] = {variant<EA, EB, GranN, EOut, CoopTiles>(),
                              variant<EA, EB, GranN, EOut, CoopTilesM2>(),
                              variant<EA, EB, GranN, EOut, PingTiles>()};
  static const Family f{v, int(sizeof(v) / sizeof(v[0]))};
  return f;
}

}  // namespace bg
}  // namespace lowbit

#endif  // LOWBIT_HAVE_CUTLASS && LOWBIT_BG_INSTANTIATE
