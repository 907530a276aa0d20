// What every check program shares: an exit on a CUDA error naming the call, and the pass/fail
// tally with its summary line. Each check program is one translation unit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::printf("FAIL CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, \
                  #call);                                                                          \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
#define CUDA_OK(call) CK(call)

inline int g_fail = 0, g_pass = 0;

inline void report(bool ok, const std::string& what, const std::string& detail = "") {
  ok ? ++g_pass : ++g_fail;
  if (!ok) std::printf("FAIL %s %s\n", what.c_str(), detail.c_str());
}

// "PASS: n passed, 0 failed" or "FAIL: ..."; the program's exit status.
inline int summary() {
  std::printf("%s: %d passed, %d failed\n", g_fail ? "FAIL" : "PASS", g_pass, g_fail);
  return g_fail ? 1 : 0;
}

// A device buffer filled with 0xCD (an unwritten output byte shows up), optionally from host bytes.
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : bytes(n) {
    if (n) CUDA_OK(cudaMalloc(&p, n));
    if (n) CUDA_OK(cudaMemset(p, 0xCD, n));
  }
  Dev(const void* host, size_t n) : Dev(n) {
    if (n) CUDA_OK(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice));
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(p);
  }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> h(bytes);
    if (bytes) CUDA_OK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
  float scalar() const {
    float f;
    CUDA_OK(cudaMemcpy(&f, p, 4, cudaMemcpyDeviceToHost));
    return f;
  }
};
