// How the routers that pick a kernel per shape by measurement (block_gemm.cu's, and
// grouped_gemm_select.cc's for the grouped block GEMMs) time a candidate: one warm-up call, then
// `reps` calls between two events on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lowbit {

// Calls for ~0.2 ms of work at ~1 PFLOP/s: at least 2 and at most 20.
inline int candidate_reps(int64_t m, int64_t n, int64_t k) {
  const double est_s = 2.0 * double(m) * double(n) * double(k) / 1e15;
  return int(std::min(20.0, std::max(2.0, 2e-4 / std::max(est_s, 1e-9))));
}

// Mean milliseconds of `reps` calls of run() (a Status-returning launch) after one warm-up;
// infinity when a call or an event fails.
template <class Run>
double time_candidate(const Run& run, cudaStream_t s, int reps) {
  if (!run().ok()) return INFINITY;
  cudaEvent_t e0, e1;
  if (cudaEventCreate(&e0) != cudaSuccess) return INFINITY;
  if (cudaEventCreate(&e1) != cudaSuccess) {
    cudaEventDestroy(e0);
    return INFINITY;
  }
  bool ok = cudaEventRecord(e0, s) == cudaSuccess;
  for (int i = 0; ok && i < reps; ++i) ok = run().ok();
  ok = ok && cudaEventRecord(e1, s) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess;
  float ms = 0;
  ok = ok && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (!ok) cudaGetLastError();
  return ok ? double(ms) / reps : INFINITY;
}

}  // namespace lowbit
