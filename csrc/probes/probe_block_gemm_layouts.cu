// Host-only probe (no GPU): lowbit's FP8 block-scale arrays as the CUTLASS block GEMM hands them
// to CUTLASS's blockwise collective (block_gemm_cutlass.cuh: scales_1d / scales_2d), tiled the way
// the collective's scale loads tile them, address the same float as fp8_block_scale_index for
// every (row, k): the 1x128 layout with its round_up(rows, 4) leading dimension, the 128x128 one
// K-major. Build and run from the repository root:
//   nvcc -std=c++17 -O1 --expt-relaxed-constexpr -arch=sm_90a -I csrc/include -I <cutlass>/include
//   \
//     csrc/probes/probe_block_gemm_layouts.cu -o build/probe_block_gemm_layouts && \
//     build/probe_block_gemm_layouts
#define LOWBIT_HAVE_CUTLASS 1
#define LOWBIT_BG_INSTANTIATE 1
#include <cstdio>
#include <vector>

#include "../kernels/cuda/block_gemm_cutlass.cuh"
using namespace lowbit;
using namespace cute;
int fails = 0;
template <int GN>
void run(int64_t M, int64_t N, int64_t K) {
  using SC = bg::ScaleConfig<GN>;
  using LA = decltype(SC::deduce_layoutSFA());
  using LB = decltype(SC::deduce_layoutSFB());
  LA la = bg::scales_1d<LA>(M, K);
  LB lb;
  if constexpr (GN == 1)
    lb = bg::scales_1d<LB>(N, K);
  else
    lb = bg::scales_2d<LB>(N, K);
  std::vector<float> buf(1 << 22);
  float* base = buf.data();
  auto tA = make_tensor(base, la);
  auto tB = make_tensor(base, lb);
  using Tile = Shape<_128, _128, _128>;
  auto gA = local_tile(tA, Tile{}, make_coord(_, _, _), Step<_1, Underscore, _1>{});
  auto gB = local_tile(tB, Tile{}, make_coord(_, _, _), Step<Underscore, _1, _1>{});
  const ScalingMode mb = GN == 1 ? ScalingMode::kBlock1d : ScalingMode::kBlock2d;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 37) {
      int64_t got = &gA(m % 128, k % 128, m / 128, k / 128, 0) - base;
      int64_t want = fp8_block_scale_index(ScalingMode::kBlock1d, M, K, m, k);
      if (got != want && fails++ < 5)
        printf("A M=%ld K=%ld m=%ld k=%ld got %ld want %ld\n", M, K, m, k, got, want);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; k += 37) {
      int64_t got = &gB(n % 128, k % 128, n / 128, k / 128, 0) - base;
      int64_t want = fp8_block_scale_index(mb, N, K, n, k);
      if (got != want && fails++ < 5)
        printf("B GN=%d N=%ld K=%ld n=%ld k=%ld got %ld want %ld\n", GN, N, K, n, k, got, want);
    }
  printf("GN=%d M=%ld N=%ld K=%ld shapeA=", GN, M, N, K);
  print(shape(la));
  printf(" shapeB=");
  print(shape(lb));
  printf("\n");
}
int main() {
  run<128>(200, 136, 448);
  run<128>(1, 300, 1152);
  run<1>(77, 264, 640);
  run<1>(1000, 1048, 2304);
  printf(fails ? "FAIL %d\n" : "PASS\n", fails);
  return fails != 0;
}
