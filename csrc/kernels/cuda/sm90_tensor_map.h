// TMA tensor maps for lowbit's own sm_90a GEMMs (block_gemm_sm90.cu, grouped_gemm_sm90.cu): the
// driver's cuTensorMapEncodeTiled reached through the runtime (the library links no libcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lowbit {
namespace sm90map {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Null when the driver has no such entry point.
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A `rank`-dimensional map (2 or 3): dim 0 contiguous, dim i `strides[i - 1]` bytes apart, boxes
// of `box`; out-of-bounds parts of a box read as zeros.
inline bool make_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, int rank,
                     const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                     CUtensorMapSwizzle swizzle) {
  const EncodeTiled fn = encode_tiled();
  if (!fn || rank < 1 || rank > 3) return false;
  cuuint64_t d[3], st[2];
  cuuint32_t b[3], elem[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) st[i] = strides[i];
  return fn(map, type, cuuint32_t(rank), const_cast<void*>(base), d, st, b, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The 2D case: dim0 contiguous, dim1 `stride1` bytes apart.
inline bool make_map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* base, uint64_t dim0,
                        uint64_t dim1, uint64_t stride1, uint32_t box0, uint32_t box1,
                        CUtensorMapSwizzle swizzle) {
  const uint64_t dims[2] = {dim0, dim1}, strides[1] = {stride1};
  const uint32_t box[2] = {box0, box1};
  return make_map(map, type, base, 2, dims, strides, box, swizzle);
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Whether the current device can run lowbit's own sm_90a kernels: compute capability 9.x and a
// driver that encodes TMA maps.
inline bool device_ready() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && encode_tiled() != nullptr;
}

}  // namespace sm90map
}  // namespace lowbit
