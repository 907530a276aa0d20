// lowbit's own sm_90a FP8 block-scaled GEMM (lowbit/block_gemm.h, block_gemm_sm90), host side:
// which GEMMs it takes, the TMA tensor maps, the cluster / persistent launch of each
// configuration. The kernel and its structure: block_gemm_sm90_kernel.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "block_gemm_sm90_kernel.cuh"
#include "lowbit/block_gemm.h"
#include "lowbit/block_scaling.h"
#include "sm90_launch.h"
#include "sm90_tensor_map.h"

namespace lowbit {
namespace {

using sm90map::aligned16;
using sm90map::make_map_2d;

// The kernel's TMA maps: A, B, A's scales, B's 1x128 scales (1Dx1D only; else a copy of sa).
struct Maps {
  CUtensorMap a, b, sa, sb;
};

// The persistent launch (sm90_launch.h) of one configuration.
template <bool kE5m2A, bool kE5m2B, bool kB1d, bool kF32Out, bool kMc, int kBN>
Status launch(const Maps& maps, const Args& args, int dev, int sms, cudaStream_t stream) {
  constexpr auto kKernel = block_gemm_sm90_kernel<kE5m2A, kE5m2B, kB1d, kF32Out, kMc, kBN>;
  constexpr size_t kSmemBytes = Tiles<kBN, kB1d, kF32Out>::kSmem;
  const int64_t work = int64_t(args.num_m) * (kMc ? (args.num_n + 1) / 2 : args.num_n);
  const std::string what = "block_gemm sm90own BLOCK_N " + std::to_string(kBN);
  const cudaError_t e = sm90launch::persistent<kKernel, kMc>(maps.a, maps.b, maps.sa, maps.sb, args,
                                                             kSmemBytes, kSmemBytes, work, kThreads,
                                                             dev, sms, stream, what.c_str());
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status::Invalid(std::string("block_gemm sm90own: launch: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

template <int kBN>
Status dispatch(bool e5, bool f32, bool mc, const Maps& maps, const Args& args, int dev, int sms,
                cudaStream_t s) {
  switch ((e5 ? 4 : 0) + (f32 ? 2 : 0) + (mc ? 1 : 0)) {
    case 0: return launch<false, false, false, false, false, kBN>(maps, args, dev, sms, s);
    case 1: return launch<false, false, false, false, true, kBN>(maps, args, dev, sms, s);
    case 2: return launch<false, false, false, true, false, kBN>(maps, args, dev, sms, s);
    case 3: return launch<false, false, false, true, true, kBN>(maps, args, dev, sms, s);
    case 4: return launch<true, false, false, false, false, kBN>(maps, args, dev, sms, s);
    case 5: return launch<true, false, false, false, true, kBN>(maps, args, dev, sms, s);
    case 6: return launch<true, false, false, true, false, kBN>(maps, args, dev, sms, s);
    default: return launch<true, false, false, true, true, kBN>(maps, args, dev, sms, s);
  }
}

// 1Dx1D: A E4M3, B E4M3 or E5M2, BLOCK_N 128, unicast or multicast (A's tile shared by an N
// pair; each CTA loads its own B tile and B column scales).
Status dispatch_1d1d(bool e5b, bool f32, bool mc, const Maps& maps, const Args& args, int dev,
                     int sms, cudaStream_t s) {
  switch ((e5b ? 4 : 0) + (f32 ? 2 : 0) + (mc ? 1 : 0)) {
    case 0: return launch<false, false, true, false, false, 128>(maps, args, dev, sms, s);
    case 1: return launch<false, false, true, false, true, 128>(maps, args, dev, sms, s);
    case 2: return launch<false, false, true, true, false, 128>(maps, args, dev, sms, s);
    case 3: return launch<false, false, true, true, true, 128>(maps, args, dev, sms, s);
    case 4: return launch<false, true, true, false, false, 128>(maps, args, dev, sms, s);
    case 5: return launch<false, true, true, false, true, 128>(maps, args, dev, sms, s);
    case 6: return launch<false, true, true, true, false, 128>(maps, args, dev, sms, s);
    default: return launch<false, true, true, true, true, 128>(maps, args, dev, sms, s);
  }
}

}  // namespace

bool block_gemm_sm90_eligible(const GemmParams& p) {
  const int64_t out_align = p.out_dtype == DType::kF32 ? 4 : 8;
  const int64_t lim = int64_t(1) << 30;
  constexpr DType E4 = DType::kE4M3, E5 = DType::kE5M2;
  if (p.a_block != abi::kGemmBlock_1d) return false;
  if (p.b_block == abi::kGemmBlock_2d) {  // fprop, dgrad
    if ((p.a_dtype != E4 && p.a_dtype != E5) || p.b_dtype != E4) return false;
  } else if (p.b_block == abi::kGemmBlock_1d) {  // wgrad: B's scales through TMA too
    if (p.a_dtype != E4 || (p.b_dtype != E4 && p.b_dtype != E5) || !aligned16(p.b_scale_inv))
      return false;
  } else {
    return false;
  }
  if (p.k % 16 != 0 || p.n % out_align != 0 || p.m >= lim || p.n >= lim || p.k >= lim) return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out) || !aligned16(p.a_scale_inv))
    return false;
  return sm90map::device_ready();
}

Status block_gemm_sm90(const GemmParams& p, const BlockGemmSm90Config& c, void* stream) {
  Status st = validate(p);
  if (!st.ok()) return st;
  if (p.m == 0 || p.n == 0) return Status::Ok();
  if (p.k == 0) return Status::Invalid("gemm: K == 0 must be handled by the caller");
  if (!block_gemm_sm90_eligible(p))
    return Status::Invalid(
        "block_gemm sm90own: needs an sm_90 GPU, 1x128 E4M3/E5M2 A x 128x128 E4M3 B or 1x128 E4M3 "
        "A x 1x128 E4M3/E5M2 B, K a multiple of 16, N of 8 (BF16 out) or 4 (F32) and 16-byte "
        "aligned A, B, out and scales");
  if (c.group < 1) return Status::Invalid("block_gemm sm90own: group must be >= 1");
  if (c.block_n != 128 && c.block_n != 192)
    return Status::Invalid("block_gemm sm90own: block_n must be 128 or 192");
  const bool b1d = p.b_block == abi::kGemmBlock_1d;
  if (b1d && c.block_n != 128)
    return Status::Invalid("block_gemm sm90own: 1x128 x 1x128 runs at block_n 128");
  const int nkb = int(ceil_div(p.k, kBK));
  const int64_t ld_sa = round_up4(p.m);
  Maps maps;
  // Multicast: each CTA of a pair loads half of A's tile rows for both.
  const uint32_t a_rows = c.multicast ? kBM / 2 : kBM;
  bool ok = make_map_2d(&maps.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.a, p.k, p.m, p.k, kBK, a_rows,
                        CU_TENSOR_MAP_SWIZZLE_128B) &&
            make_map_2d(&maps.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.b, p.k, p.n, p.k, kBK,
                        uint32_t(c.block_n), CU_TENSOR_MAP_SWIZZLE_128B) &&
            make_map_2d(&maps.sa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.a_scale_inv, ld_sa, nkb,
                        ld_sa * 4, kBM, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  maps.sb = maps.sa;
  // B's 1x128 scales (nkb, round_up4(N)): the tile's block_n columns of one K block per box.
  const int64_t ld_sbn = round_up4(p.n);
  if (ok && b1d)
    ok = make_map_2d(&maps.sb, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.b_scale_inv, ld_sbn, nkb,
                     ld_sbn * 4, uint32_t(c.block_n), 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  if (!ok) return Status::Invalid("block_gemm sm90own: cuTensorMapEncodeTiled failed");
  Args args{};
  args.m = int(p.m), args.n = int(p.n);
  args.num_m = int(ceil_div(p.m, kBM)), args.num_n = int(ceil_div(p.n, c.block_n));
  args.nkb = nkb, args.group = c.group;
  args.ld_sb = int(round_up4(nkb)), args.sb_rows = int(ceil_div(p.n, 128));
  args.sb = p.b_scale_inv;
  args.bias = p.bias, args.bias_f32 = p.bias && p.bias_dtype == DType::kF32;
  args.out = p.out;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    return Status::Invalid("block_gemm sm90own: no device");
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool e5 = p.a_dtype == DType::kE5M2, f32 = p.out_dtype == DType::kF32;
  if (b1d)
    return dispatch_1d1d(p.b_dtype == DType::kE5M2, f32, c.multicast, maps, args, dev, sms, s);
  return c.block_n == 192 ? dispatch<192>(e5, f32, c.multicast, maps, args, dev, sms, s)
                          : dispatch<128>(e5, f32, c.multicast, maps, args, dev, sms, s);
}

}  // namespace lowbit
