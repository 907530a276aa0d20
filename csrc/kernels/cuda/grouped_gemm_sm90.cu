// lowbit's own sm_90a block-scaled GEMM serving the grouped GEMM's ragged-M calls, host side:
// eligibility, tensor maps (A 2D over all rows, B 3D over (K, N, group)), the persistent launch.
// The kernel (its grouped form: walk, scales, zero rows): block_gemm_sm90_kernel.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "block_gemm_sm90_kernel.cuh"
#include "grouped_gemm_sm90.h"
#include "lowbit/block_scaling.h"
#include "sm90_launch.h"
#include "sm90_tensor_map.h"

namespace lowbit {
namespace gg {
namespace {

using T = Tiles<128, false, false>;

// Dynamic shared memory: the dense tile ring and staging plus the groups' two tables.
size_t smem_bytes(int64_t groups) { return T::kSmem + size_t(8 * (groups + 1) + 15) / 16 * 16; }
static_assert(T::kSmem + 8 * (kSm90MaxGroups + 1) + 15 <= 227 * 1024, "shared memory");

// Persistent grid: one CTA per SM (multicast: as many 2-CTA clusters as fit), at most the tiles
// there can be (every group's partial last tile included) and at least one (the zero rows).
template <bool kE5m2A, bool kMc>
Status launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const Args& args, int dev,
              int sms, cudaStream_t stream) {
  constexpr auto kKernel = block_gemm_sm90_kernel<kE5m2A, false, false, false, kMc, 128, true>;
  const int64_t tiles_m = ceil_div(args.m, 128) + std::min<int64_t>(args.groups, args.m);
  const int64_t work = std::max<int64_t>(1, tiles_m * (kMc ? (args.num_n + 1) / 2 : args.num_n));
  const cudaError_t e = sm90launch::persistent<kKernel, kMc>(
      map_a, map_b, map_a, map_a, args, smem_bytes(args.groups), smem_bytes(kSm90MaxGroups), work,
      kThreads, dev, sms, stream, "grouped_gemm sm90own");
  return cuda_status(e, "grouped_gemm sm90own: launch");
}

bool aligned4(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 3u) == 0; }

}  // namespace

bool sm90_grouped_eligible(const GroupedGemmParams& p) {
  constexpr DType E4 = DType::kE4M3, E5 = DType::kE5M2;
  const int64_t lim = int64_t(1) << 30;
  if (p.mode != GroupedGemmMode::kRaggedM || !p.block_scaled || p.b_block_n != 128) return false;
  if ((p.a_dtype != E4 && p.a_dtype != E5) || p.b_dtype != E4 || p.out_dtype != DType::kBF16)
    return false;
  if (!p.a_kmajor || !p.b_kmajor || p.num_groups < 1 || p.num_groups > kSm90MaxGroups) return false;
  if (p.k <= 0 || p.k % 16 != 0 || p.n % 8 != 0 || p.m >= lim || p.n >= lim || p.k >= lim)
    return false;
  // TMA: 16-byte aligned bases and row / group strides (FP8: bytes = elements).
  if (p.lda % 16 != 0 || p.ldb % 16 != 0 || p.b_group_stride % 16 != 0 ||
      (p.b_group_stride <= 0 && p.num_groups > 1))
    return false;
  if (!sm90map::aligned16(p.a) || !sm90map::aligned16(p.b) || !sm90map::aligned16(p.out) ||
      !aligned4(p.a_scale_inv) || !aligned4(p.b_scale_inv))
    return false;
  return sm90map::device_ready();
}

Status sm90_grouped(const GroupedGemmParams& p, const Sm90GroupedConfig& c, cudaStream_t stream) {
  if (!sm90_grouped_eligible(p))
    return Status::Invalid(
        "grouped_gemm sm90own: needs an sm_90 GPU and a ragged-M call with 1x128 E4M3/E5M2 A x "
        "128x128 E4M3 B block scales, K-major A and B, BF16 out, K > 0 a multiple of 16, N of 8, "
        "16-byte aligned pointers and strides, at most " +
        std::to_string(kSm90MaxGroups) + " groups");
  if (c.group < 1) return Status::Invalid("grouped_gemm sm90own: group must be >= 1");
  if (p.m == 0 || p.n == 0) return Status::Ok();
  const int nkb = int(ceil_div(p.k, 128));
  CUtensorMap map_a, map_b;
  // A: (K, M) rows lda bytes apart (multicast: each CTA of a pair loads half of the tile's rows).
  const uint32_t a_rows = c.multicast ? 64 : 128;
  bool ok =
      sm90map::make_map_2d(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.a, uint64_t(p.k), uint64_t(p.m),
                           uint64_t(p.lda), 128, a_rows, CU_TENSOR_MAP_SWIZZLE_128B);
  // B: (K, N, G); one group (stride unused) may come with a group stride of 0.
  const uint64_t dims[3] = {uint64_t(p.k), uint64_t(p.n), uint64_t(p.num_groups)};
  const uint64_t gstride = p.num_groups > 1 ? uint64_t(p.b_group_stride) : uint64_t(p.ldb * p.n);
  const uint64_t strides[2] = {uint64_t(p.ldb), gstride};
  const uint32_t box[3] = {128, 128, 1};
  ok = ok && sm90map::make_map(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.b, 3, dims, strides, box,
                               CU_TENSOR_MAP_SWIZZLE_128B);
  if (!ok) return Status::Invalid("grouped_gemm sm90own: cuTensorMapEncodeTiled failed");
  Args args{};
  args.m = int(p.m), args.n = int(p.n);
  args.num_m = 0;  // the grouped walk counts the M tiles on the device
  args.num_n = int(ceil_div(p.n, 128));
  args.nkb = nkb, args.group = c.group;
  args.ld_sb = 0, args.sb_rows = int(ceil_div(p.n, 128));
  args.sb = p.b_scale_inv;
  args.bias = nullptr, args.bias_f32 = 0;
  args.out = p.out;
  args.group_sizes = p.group_sizes;
  args.sa = p.a_scale_inv;
  args.groups = int(p.num_groups);
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cuda_status(cudaErrorNoDevice, "grouped_gemm");
  const int sms = current_sm_count();
  if (sms <= 0) return Status::Invalid("grouped_gemm sm90own: cannot read the SM count");
  const bool e5 = p.a_dtype == DType::kE5M2;
  if (e5)
    return c.multicast ? launch<true, true>(map_a, map_b, args, dev, sms, stream)
                       : launch<true, false>(map_a, map_b, args, dev, sms, stream);
  return c.multicast ? launch<false, true>(map_a, map_b, args, dev, sms, stream)
                     : launch<false, false>(map_a, map_b, args, dev, sms, stream);
}

}  // namespace gg
}  // namespace lowbit
