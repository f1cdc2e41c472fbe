#pragma once

// Device helpers the row kernels share (CUDA sources only): fp32/bf16 loads and stores, and the
// CPU reference's RMS reduction, so every kernel that normalises a row rounds as rmsnorm does.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::gpu::cuda::row_math {

__device__ __forceinline__ float load_as_float(const float* p, uint64_t i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p, uint64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_from_float(float* p, uint64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, uint64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

/// The CPU reference's reduction: lane j of 8 sums x[i]² for i ≡ j (mod 8), then pairwise.
/// Called by a whole warp; returns the reciprocal RMS to every lane.
__device__ __forceinline__ float inv_rms_warp(const float* x, uint32_t dim, float eps) {
  const uint32_t lane = threadIdx.x % 32;
  float acc = 0.0f;
  if (lane < 8)
    for (uint32_t i = lane; i < dim; i += 8) acc = __fadd_rn(acc, __fmul_rn(x[i], x[i]));
  float l[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) l[j] = __shfl_sync(0xffffffffu, acc, j);
  const float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  return 1.0f / sqrtf(__fdiv_rn(s, static_cast<float>(dim)) + eps);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace baton::gpu::cuda::row_math
