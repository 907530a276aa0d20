// One CUTLASS sm90 grouped GEMM instantiation, in its own file so that the build compiles them
// in parallel. BF16, A K-major . B K-major: the data gradient (dout . rhs^T).
#define LOWBIT_GG_INSTANTIATE 1
#include "grouped_gemm_cutlass.cuh"

#if LOWBIT_HAVE_CUTLASS
namespace lowbit {
namespace gg {

const Config& config_bf16_kk() {
  return make_config<
      GroupedKernel<cutlass::bfloat16_t, cutlass::bfloat16_t, true, true, Bf16Tiles>>();
}

}  // namespace gg
}  // namespace lowbit
#endif
