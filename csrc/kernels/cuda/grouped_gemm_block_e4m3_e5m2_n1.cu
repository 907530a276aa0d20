// One CUTLASS sm90 grouped GEMM instantiation, in its own file so that the build compiles them
// in parallel. FP8 block scaling: A (e4m3) with 1x128 scales . B (e5m2) with 1x128 scales.
#define LOWBIT_GG_INSTANTIATE 1
#include "grouped_gemm_cutlass.cuh"

#if LOWBIT_HAVE_CUTLASS
namespace lowbit {
namespace gg {

const Config& config_block_e4m3_e5m2_n1() {
  return make_config<
      GroupedKernel<cutlass::float_e4m3_t, cutlass::float_e5m2_t, true, true, BlockTiles<1>>>();
}

}  // namespace gg
}  // namespace lowbit
#endif
