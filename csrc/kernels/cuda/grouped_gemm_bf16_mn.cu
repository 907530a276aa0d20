// One CUTLASS sm90 grouped GEMM instantiation, in its own file so that the build compiles them
// in parallel. BF16, A M-major . B N-major: the weight gradient (lhs^T . dout).
#define LOWBIT_GG_INSTANTIATE 1
#include "grouped_gemm_cutlass.cuh"

#if LOWBIT_HAVE_CUTLASS
namespace lowbit {
namespace gg {

const Config& config_bf16_mn() {
  return make_config<
      GroupedKernel<cutlass::bfloat16_t, cutlass::bfloat16_t, false, false, Bf16Tiles>>();
}

}  // namespace gg
}  // namespace lowbit
#endif
