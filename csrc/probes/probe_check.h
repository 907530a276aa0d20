// Error checks shared by the device probes: print where a CUDA or cuBLASLt call failed and exit.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

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
