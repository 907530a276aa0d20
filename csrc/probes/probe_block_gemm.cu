// Device probe (not part of the library): cuBLASLt's block-scaled FP8 GEMM on Hopper.
// 1. Which scale-tensor layout cuBLASLt reads for VEC128_32F (1x128) and BLK128x128_32F
//    (128x128) operands: the GPU result is compared with host references computed under each
//    candidate layout, on sampled output entries.
// 2. Which operand-mode combinations it accepts (1Dx1D, 1Dx2D, 2Dx1D, 2Dx2D).
// 3. TFLOP/s next to BF16 and per-tensor FP8 on the same shapes (median of timed repeats).
// Our convention as in gemm_cublaslt.cc: out(M,N) = A(M,K) . B(N,K)^T; cuBLASLt's A is our B.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "probe_check.h"

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t up4(int64_t a) { return cdiv(a, 4) * 4; }

enum Mode { kTensor = 0, k1D = 1, k2D = 2, kBF16 = 3 };
static const char* mode_name(int m) {
  return m == kTensor ? "tensor" : m == k1D ? "1x128" : m == k2D ? "128x128" : "bf16";
}

// Candidate scale layouts of a (rows, K) operand.
// 1D: 0 = row-major (rows, kb); 1 = kb-major (kb, rows); 2 = kb-major with rows padded to 4.
// 2D: 0 = (rb, kb) row-major; 1 = (kb, rb); 2 = (rb, kb) with kb padded to 4; 3 = (kb, rb) with rb
// padded to 4.
static int64_t scale_index(int mode, int layout, int64_t rows, int64_t K, int64_t r, int64_t k) {
  const int64_t kb = cdiv(K, 128), rb = cdiv(rows, 128), b = k / 128, rr = r / 128;
  if (mode == k1D) {
    if (layout == 0) return r * kb + b;
    if (layout == 1) return b * rows + r;
    return b * up4(rows) + r;
  }
  if (mode == k2D) {
    if (layout == 0) return rr * kb + b;
    if (layout == 1) return b * rb + rr;
    if (layout == 2) return rr * up4(kb) + b;
    return b * up4(rb) + rr;
  }
  return 0;
}

struct Operand {
  int64_t rows, K;
  int mode;
  std::vector<uint8_t> q;     // fp8 e4m3 bytes or bf16 halves
  std::vector<float> scales;  // enough for the largest candidate layout
  uint8_t* dq = nullptr;
  float* ds = nullptr;
};

static float e4m3_to_float(uint8_t b) {
  __nv_fp8_e4m3 v;
  *reinterpret_cast<uint8_t*>(&v) = b;
  return float(v);
}

static void make_operand(Operand& o, std::mt19937& g) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.25f, 4.0f);
  const int64_t n = o.rows * o.K;
  const int esz = o.mode == kBF16 ? 2 : 1;
  o.q.resize(n * esz);
  if (o.mode == kBF16) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      __nv_bfloat16 h = __float2bfloat16(nd(g));
      memcpy(&o.q[2 * i], &h, 2);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint8_t b;
      do b = uint8_t(byte(g)) & 0xBF;  // |x| < 2 (exponent top bit cleared) keeps sums tame
      while ((b & 0x7F) == 0x7F);
      o.q[i] = b;
    }
  }
  const int64_t ns = 4 * (cdiv(o.rows, 4) + 8) * (cdiv(o.K, 128) + 8);
  o.scales.resize(ns);
  for (auto& s : o.scales) s = sc(g);
  CK(cudaMalloc(&o.dq, o.q.size()));
  CK(cudaMemcpy(o.dq, o.q.data(), o.q.size(), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&o.ds, o.scales.size() * sizeof(float)));
  CK(cudaMemcpy(o.ds, o.scales.data(), o.scales.size() * sizeof(float), cudaMemcpyHostToDevice));
}

static double value(const Operand& o, int layout, int64_t r, int64_t k) {
  if (o.mode == kBF16) {
    __nv_bfloat16 h;
    memcpy(&h, &o.q[2 * (r * o.K + k)], 2);
    return double(__bfloat162float(h));
  }
  const double s = o.scales[scale_index(o.mode, layout, o.rows, o.K, r, k)];
  return double(e4m3_to_float(o.q[r * o.K + k])) * s;
}

// Timing operands are filled on the device (host RNG over 64M elements is far too slow).
__global__ void fill_kernel(uint8_t* q, int64_t nbytes, bool bf16, float* sc, int64_t ns,
                            uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nbytes;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = probe_hash(uint64_t(i), seed);
    uint8_t b = uint8_t(h) & 0xBF;
    if (bf16 && (i & 1))
      b = uint8_t(0x3C | (h >> 8 & 0x80)) |
          (uint8_t(h >> 16) & 0x01);  // bf16 high byte: sign, exp ~ 1
    q[i] = (b & 0x7F) == 0x7F ? 0x38 : b;
    if (i < ns) sc[i] = 0.5f + float((h >> 20) & 0xFF) / 256.0f;
  }
}

static void make_device_operand(Operand& o, uint32_t seed) {
  const int64_t nbytes = o.rows * o.K * (o.mode == kBF16 ? 2 : 1);
  const int64_t ns = 4 * (cdiv(o.rows, 4) + 8) * (cdiv(o.K, 128) + 8);
  CK(cudaMalloc(&o.dq, nbytes));
  CK(cudaMalloc(&o.ds, ns * sizeof(float)));
  fill_kernel<<<1024, 256>>>(o.dq, nbytes, o.mode == kBF16, o.ds, ns, seed);
  CK(cudaGetLastError());
}

static cublasLtHandle_t lt;

// Returns status; fills out (M,N) bf16 row-major; time_ms if iters > 0.
static cublasStatus_t run_gemm(const Operand& A, const Operand& B, __nv_bfloat16* out, void* ws,
                               size_t wsb, int iters, float* ms, std::string* algo_note) {
  const int64_t M = A.rows, N = B.rows, K = A.K;
  cublasLtMatmulDesc_t op;
  cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn));
  const bool fp8 = A.mode != kBF16;
  if (fp8) {
    const void* sa = B.ds;  // cuBLASLt's A is our B
    const void* sb = A.ds;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
    auto mm = [](int m) {
      return m == k1D   ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
             : m == k2D ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                        : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    };
    int32_t ma = mm(B.mode), mb = mm(A.mode);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb));
  }
  const cudaDataType_t ti = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatrixLayoutCreate(&la, ti, K, N, K);
  cublasLtMatrixLayoutCreate(&lb, ti, K, M, K);
  cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, M, N);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  uint64_t w = wsb;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w,
                                       sizeof(w));
  cublasLtMatmulHeuristicResult_t res[8];
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 8, res, &found);
  if (st == CUBLAS_STATUS_SUCCESS && found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
  if (st == CUBLAS_STATUS_SUCCESS) {
    const float alpha = 1.f, beta = 0.f;
    st = cublasLtMatmul(lt, op, &alpha, B.dq, la, A.dq, lb, &beta, out, ld, out, ld, &res[0].algo,
                        ws, wsb, 0);
    if (st == CUBLAS_STATUS_SUCCESS && iters > 0) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      std::vector<float> t;
      for (int rep = 0; rep < 5; ++rep) {
        cudaEventRecord(e0);
        for (int i = 0; i < iters; ++i)
          cublasLtMatmul(lt, op, &alpha, B.dq, la, A.dq, lb, &beta, out, ld, out, ld, &res[0].algo,
                         ws, wsb, 0);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float x;
        cudaEventElapsedTime(&x, e0, e1);
        t.push_back(x / iters);
      }
      std::sort(t.begin(), t.end());
      *ms = t[2];
    }
    if (algo_note) {
      int id = 0;
      size_t sz;
      cublasLtMatmulAlgoConfigGetAttribute(&res[0].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id),
                                           &sz);
      *algo_note = "algo " + std::to_string(id) + ", " + std::to_string(found) + " found";
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  CK(cudaDeviceSynchronize());
  return st;
}

int main(int argc, char** argv) {
  cublasLtCreate(&lt);
  size_t wsb = size_t(64) << 20;
  void* ws;
  CK(cudaMalloc(&ws, wsb));
  std::mt19937 g(1234);
  printf("cuBLASLt version %zu\n", cublasLtGetVersion());

  // 1+2: layouts and combinations on a ragged shape (M, N not multiples of 128; K = 3.5 blocks?
  // K must stay a multiple of 16 for FP8).
  const int64_t checks[][3] = {{320, 384, 448}, {256, 384, 512}, {102, 400, 640}};
  for (auto& shape : checks) {
    const int64_t M = shape[0], N = shape[1], K = shape[2];
    const int combos[4][2] = {{k1D, k1D}, {k1D, k2D}, {k2D, k1D}, {k2D, k2D}};
    for (auto& c : combos) {
      Operand A{M, K, c[0]}, B{N, K, c[1]};
      make_operand(A, g);
      make_operand(B, g);
      __nv_bfloat16* out;
      CK(cudaMalloc(&out, M * N * 2));
      CK(cudaMemset(out, 0xFF, M * N * 2));
      std::string note;
      cublasStatus_t st = run_gemm(A, B, out, ws, wsb, 0, nullptr, &note);
      printf("layout check A %s x B %s (M %ld N %ld K %ld): %s %s\n", mode_name(c[0]),
             mode_name(c[1]), M, N, K, cublasLtGetStatusString(st), note.c_str());
      if (st != CUBLAS_STATUS_SUCCESS) continue;
      std::vector<__nv_bfloat16> h(M * N);
      CK(cudaMemcpy(h.data(), out, M * N * 2, cudaMemcpyDeviceToHost));
      const int nla = c[0] == k1D ? 3 : 4, nlb = c[1] == k1D ? 3 : 4;
      for (int la = 0; la < nla; ++la)
        for (int lb = 0; lb < nlb; ++lb) {
          double err = 0, ref2 = 0;
          std::uniform_int_distribution<int64_t> rm(0, M - 1), rn(0, N - 1);
          for (int s = 0; s < 400; ++s) {
            const int64_t i = rm(g), j = rn(g);
            double ref = 0;
            for (int64_t k = 0; k < K; ++k) ref += value(A, la, i, k) * value(B, lb, j, k);
            const double got = __bfloat162float(h[i * N + j]);
            err += (got - ref) * (got - ref);
            ref2 += ref * ref;
          }
          const double rel = std::sqrt(err / ref2);
          if (rel < 0.02) printf("   MATCH A layout %d, B layout %d: rel err %.3e\n", la, lb, rel);
        }
      cudaFree(out);
    }
  }
  if (argc > 1 && std::string(argv[1]) == "--layouts") return 0;
  // 3: speed. Shapes: 8192^3 and the layer's GEMMs (tokens 8192, hidden 4096, ffn 16384).
  const int64_t shapes[][3] = {{8192, 8192, 8192},  {8192, 12288, 4096}, {8192, 4096, 4096},
                               {8192, 16384, 4096}, {8192, 4096, 16384}, {4096, 16384, 8192},
                               {16384, 4096, 8192}, {4096, 4096, 8192},  {12288, 4096, 8192}};
  const int modes[][2] = {{kBF16, kBF16}, {kTensor, kTensor}, {k1D, k2D}, {k1D, k1D}, {k2D, k1D}};
  printf("\n%-22s %-18s %9s %9s %s\n", "M x N x K", "A x B", "ms", "TFLOP/s", "vs bf16");
  for (auto& s : shapes) {
    double bf = 0;
    for (auto& md : modes) {
      Operand A{s[0], s[2], md[0]}, B{s[1], s[2], md[1]};
      make_device_operand(A, 17u);
      make_device_operand(B, 91u);
      __nv_bfloat16* out;
      CK(cudaMalloc(&out, s[0] * s[1] * 2));
      float ms = 0;
      cublasStatus_t st = run_gemm(A, B, out, ws, wsb, 20, &ms, nullptr);
      char shp[64], md_s[64];
      snprintf(shp, sizeof shp, "%ldx%ldx%ld", s[0], s[1], s[2]);
      snprintf(md_s, sizeof md_s, "%s x %s", mode_name(md[0]), mode_name(md[1]));
      if (st != CUBLAS_STATUS_SUCCESS) {
        printf("%-22s %-18s %s\n", shp, md_s, cublasLtGetStatusString(st));
      } else {
        const double tf = 2.0 * s[0] * s[1] * s[2] / (ms * 1e-3) / 1e12;
        if (md[0] == kBF16) bf = ms;
        printf("%-22s %-18s %9.3f %9.1f %.2fx\n", shp, md_s, ms, tf, bf / ms);
      }
      cudaFree(out);
      cudaFree(A.dq);
      cudaFree(A.ds);
      cudaFree(B.dq);
      cudaFree(B.ds);
    }
  }
  return 0;
}
