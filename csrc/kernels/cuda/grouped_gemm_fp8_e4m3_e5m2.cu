// One CUTLASS sm90 grouped GEMM instantiation, in its own file so that the build compiles them
// in parallel. FP8 E4M3 . E5M2: HYBRID's weight gradient (lhs^T . dout).
#define LOWBIT_GG_INSTANTIATE 1
#include "grouped_gemm_cutlass.cuh"

#if LOWBIT_HAVE_CUTLASS
namespace lowbit {
namespace gg {

const Config& config_fp8_e4m3_e5m2() {
  return make_config<
      GroupedKernel<cutlass::float_e4m3_t, cutlass::float_e5m2_t, true, true, Fp8Tiles>>();
}

}  // namespace gg
}  // namespace lowbit
#endif
