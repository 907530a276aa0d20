// The sm_90a instructions lowbit's own block-scaled GEMM (block_gemm_sm90.cu, and its grouped
// form, grouped_gemm_sm90.cu) is built from, as small inline-PTX wrappers: mbarriers, TMA 2D / 3D
// loads, cp.async, wgmma (m64n128k32 / m64n192k32, FP8 x FP8 -> F32, both operands from shared
// memory through descriptors) and setmaxnreg. Only the sm_90a pass emits them; other targets get
// empty bodies (the host never launches the kernel there).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOWBIT_SM90A 1
#else
#define LOWBIT_SM90A 0
#endif

namespace lowbit {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers (CTA scope) ---------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if LOWBIT_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes the initialised barriers visible to the other threads and to the TMA unit.
__device__ __forceinline__ void mbar_init_fence() {
#if LOWBIT_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if LOWBIT_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if LOWBIT_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

// One arrival on the barrier at the same shared-memory offset in cluster CTA `cta`. The default
// (.release.cta) semantics: the stage's shared reads are done by then, and the peer only writes the
// stage with TMA after the barrier completes. An explicit .release.cluster made ptxas put a
// MEMBAR.ALL.GPU before every remote arrive (each consumer warp, each K block: the multicast
// kernels ran at half the unicast speed).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
#if LOWBIT_SM90A
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(bar),
      "r"(cta)
      : "memory");
#endif
}

// Every thread of every CTA of the cluster (barriers initialised before any remote use).
__device__ __forceinline__ void cluster_sync() {
#if LOWBIT_SM90A
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
#endif
}

// Waits until the phase of parity `parity` has completed (a fresh barrier counts parity 1 as
// completed, so a producer's first pass over the "empty" barriers does not block).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if LOWBIT_SM90A
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// ---- TMA -------------------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
#if LOWBIT_SM90A
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
#endif
}

// Box at coordinates (c0 innermost, c1) of the tensor map into shared memory at `dst`; the box's
// bytes (all of them, out-of-bounds parts zero-filled) complete on barrier `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1) {
#if LOWBIT_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

// The same box into shared memory at `dst` of every cluster CTA in `mask`, completing on the
// barrier at `bar`'s offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* tmap, uint32_t bar,
                                                      int c0, int c1, uint16_t mask) {
#if LOWBIT_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
#endif
}

// The 3D form: coordinates (c0 innermost, c1, c2); the grouped GEMM's B, (K, N, group).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1, int c2) {
#if LOWBIT_SM90A
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#endif
}

// ---- cp.async (4-byte copies whose completion an mbarrier tracks) ------------------------------

// Global -> shared copy of one float: for scales whose rows TMA cannot address (a grouped A's
// scale rows start anywhere, not on 16-byte boundaries).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
#if LOWBIT_SM90A
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
#endif
}

// One arrival on `bar` once this thread's earlier cp.asyncs have landed (.noinc: the arrival is
// one of the barrier's expected count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
#if LOWBIT_SM90A
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if LOWBIT_SM90A
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ---- register reconfiguration ------------------------------------------------------------------

template <int N>
__device__ __forceinline__ void regs_dealloc() {
#if LOWBIT_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
#if LOWBIT_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// ---- wgmma -------------------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major tile written by TMA with the 128-byte swizzle:
// rows of 128 bytes, 8-row atoms 1024 bytes apart (SBO), LBO unused (1), layout SWIZZLE_128B.
// The tile base must be 1024-byte aligned; a k offset inside the row is added to the address.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  uint64_t d = uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t(1) << 16;
  d |= uint64_t(1024 >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
#if LOWBIT_SM90A
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if LOWBIT_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed wgmma groups are still running (N = 0: all
// done; N = 1: every group but the newest).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if LOWBIT_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of accumulator registers across the
// asynchronous wgmma boundaries.
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#define LOWBIT_WG_D16(i)                                                                          \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7]), "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]),            \
      "+f"(d[i + 11]), "+f"(d[i + 12]), "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
#define LOWBIT_WG_D64 LOWBIT_WG_D16(0), LOWBIT_WG_D16(16), LOWBIT_WG_D16(32), LOWBIT_WG_D16(48)
#define LOWBIT_WG_D96 LOWBIT_WG_D64, LOWBIT_WG_D16(64), LOWBIT_WG_D16(80)
#define LOWBIT_WG_R64                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define LOWBIT_WG_R96                                                                \
  LOWBIT_WG_R64                                                                      \
  ", "                                                                               \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"

// d(64 x N per warpgroup) = A(64x32) . B(Nx32)^T (+ d when accumulate != 0), FP8 types TA, TB;
// REGS/OUTS the N/2 accumulator operands, then the descriptors and the flag (%D, %D+1, %D+2).
#define LOWBIT_WGMMA(NAME, N, TA, TB, REGS, OUTS, D, D1, D2)                                 \
  __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int accumulate) { \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #D2                                  \
                 ", 0;\n"                                                                    \
                 " wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." TA "." TB " {" REGS      \
                 "}, "                                                                       \
                 "%" #D ", %" #D1 ", p, 1, 1;\n}"                                            \
                 : OUTS                                                                      \
                 : "l"(da), "l"(db), "r"(accumulate));                                       \
  }

#if LOWBIT_SM90A
LOWBIT_WGMMA(wgmma_n128_e4m3_e4m3, 128, "e4m3", "e4m3", LOWBIT_WG_R64, LOWBIT_WG_D64, 64, 65, 66)
LOWBIT_WGMMA(wgmma_n128_e5m2_e4m3, 128, "e5m2", "e4m3", LOWBIT_WG_R64, LOWBIT_WG_D64, 64, 65, 66)
LOWBIT_WGMMA(wgmma_n192_e4m3_e4m3, 192, "e4m3", "e4m3", LOWBIT_WG_R96, LOWBIT_WG_D96, 96, 97, 98)
LOWBIT_WGMMA(wgmma_n192_e5m2_e4m3, 192, "e5m2", "e4m3", LOWBIT_WG_R96, LOWBIT_WG_D96, 96, 97, 98)
LOWBIT_WGMMA(wgmma_n128_e4m3_e5m2, 128, "e4m3", "e5m2", LOWBIT_WG_R64, LOWBIT_WG_D64, 64, 65, 66)
#else
__device__ __forceinline__ void wgmma_n128_e4m3_e4m3(float*, uint64_t, uint64_t, int) {}
__device__ __forceinline__ void wgmma_n128_e5m2_e4m3(float*, uint64_t, uint64_t, int) {}
__device__ __forceinline__ void wgmma_n192_e4m3_e4m3(float*, uint64_t, uint64_t, int) {}
__device__ __forceinline__ void wgmma_n192_e5m2_e4m3(float*, uint64_t, uint64_t, int) {}
__device__ __forceinline__ void wgmma_n128_e4m3_e5m2(float*, uint64_t, uint64_t, int) {}
#endif
#undef LOWBIT_WGMMA
#undef LOWBIT_WG_R96
#undef LOWBIT_WG_R64
#undef LOWBIT_WG_D96
#undef LOWBIT_WG_D64
#undef LOWBIT_WG_D16

// One m64nNk32 wgmma: A E5M2 or E4M3 with B E4M3 at N 128 or 192, or A E4M3 with B E5M2 at N
// 128 (the wgrad's E4M3 activations x E5M2 gradients).
template <bool kE5m2A, bool kE5m2B, int N>
__device__ __forceinline__ void wgmma(float* d, uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 128 || N == 192, "BLOCK_N 128 or 192");
  static_assert(!kE5m2B || (!kE5m2A && N == 128), "B E5M2: A E4M3, BLOCK_N 128 only");
  if constexpr (kE5m2B)
    wgmma_n128_e4m3_e5m2(d, da, db, accumulate);
  else if constexpr (N == 128 && kE5m2A)
    wgmma_n128_e5m2_e4m3(d, da, db, accumulate);
  else if constexpr (N == 128)
    wgmma_n128_e4m3_e4m3(d, da, db, accumulate);
  else if constexpr (kE5m2A)
    wgmma_n192_e5m2_e4m3(d, da, db, accumulate);
  else
    wgmma_n192_e4m3_e4m3(d, da, db, accumulate);
}

}  // namespace sm90
}  // namespace lowbit
