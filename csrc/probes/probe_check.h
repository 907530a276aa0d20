// Shared by the device probes: error checks (print where a CUDA or cuBLASLt call failed and
// exit) and the hash their operand-filling kernels draw bytes from.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)
#define LT(x)                                                               \
  do {                                                                      \
    cublasStatus_t st_ = (x);                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                     \
      printf("cuBLASLt error %d at %s:%d\n", int(st_), __FILE__, __LINE__); \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

// A well-mixed 32-bit hash of an element index (the probes' device-side operand RNG).
__device__ inline uint32_t probe_hash(uint64_t i, uint32_t seed) {
  uint32_t h = uint32_t(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}
