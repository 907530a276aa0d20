// The persistent launch of lowbit's own sm_90a GEMM kernels (block_gemm_sm90.cu,
// grouped_gemm_sm90.cu): one CTA per SM, or (kMc) as many 2-CTA clusters as fit at once (an SM
// pair of one GPC each; cudaOccupancyMaxActiveClusters, cached per device), never more than the
// work. The shared-memory opt-in once per device (a driver call per launch costs small GEMMs).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace lowbit {
namespace sm90launch {

// kKernel(a, b, sa, sb, args) with `smem` bytes now; `max_smem`: the most any call of kKernel
// asks for (the opt-in and the cluster fit use it). `work`: CTAs (kMc: clusters) with something
// to do; `threads` per CTA. `what` names the kernel in LOWBIT_BLOCK_GEMM_LOG's line on the clusters
// that fit.
template <auto kKernel, bool kMc, class Args>
cudaError_t persistent(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& sa,
                       const CUtensorMap& sb, const Args& args, size_t smem, size_t max_smem,
                       int64_t work, unsigned threads, int dev, int sms, cudaStream_t stream,
                       const char* what) {
  const bool cached = dev >= 0 && dev < 64;
  static std::atomic<bool> smem_set[64];
  cudaError_t e = cudaSuccess;
  if (!cached || !smem_set[dev].load()) {
    e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem));
    if (e == cudaSuccess && cached) smem_set[dev].store(true);
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  if constexpr (kMc) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr, cfg.numAttrs = 1;
    static std::atomic<int> fit[64];
    int clusters = cached ? fit[dev].load() : 0;
    if (e == cudaSuccess && clusters == 0) {
      cfg.gridDim = dim3(2 * std::max(1, sms / 2));
      cfg.dynamicSmemBytes = max_smem;
      e = cudaOccupancyMaxActiveClusters(&clusters, kKernel, &cfg);
      if (e == cudaSuccess && clusters < 1) e = cudaErrorInvalidConfiguration;
      if (e == cudaSuccess && cached) fit[dev].store(clusters);
      // Fewer than sms / 2 clusters would leave SMs idle: the log says how many fit.
      if (e == cudaSuccess && std::getenv("LOWBIT_BLOCK_GEMM_LOG"))
        std::fprintf(stderr, "lowbit %s multicast: %d clusters of 2 on %d SMs\n", what, clusters,
                     sms);
    }
    cfg.gridDim = dim3(unsigned(2 * std::min<int64_t>(work, clusters)));
  } else {
    cfg.gridDim = dim3(unsigned(std::min<int64_t>(work, sms)));
  }
  cfg.dynamicSmemBytes = smem;
  if (e == cudaSuccess) e = cudaLaunchKernelEx(&cfg, kKernel, a, b, sa, sb, args);
  return e;
}

}  // namespace sm90launch
}  // namespace lowbit
