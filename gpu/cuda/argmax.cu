#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

namespace {

constexpr int32_t none = INT32_MAX;

/// (value, index) pairs: the larger value wins, the lower index among equal values. A NaN
/// compares false both ways, so it never displaces a number.
__device__ __forceinline__ void keep_better(float& best, int32_t& at, float v, int32_t i) {
  if (v > best || (v == best && i < at)) {
    best = v;
    at = i;
  }
}

__device__ __forceinline__ void warp_reduce(float& best, int32_t& at) {
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, off);
    const int32_t i = __shfl_down_sync(0xffffffffu, at, off);
    keep_better(best, at, v, i);
  }
}

// One block per row; each thread strides over the row in increasing order, then the warps and
// the block reduce. The result is the same whatever the block size: a maximum with a fixed
// tie-break is order-free.
__global__ void argmax_kernel(argmax_params p) {
  const float* x = p.x + static_cast<uint64_t>(blockIdx.x) * p.cols;
  float best = -INFINITY;
  int32_t at = none;
  for (uint32_t i = threadIdx.x; i < p.cols; i += blockDim.x) keep_better(best, at, x[i], static_cast<int32_t>(i));
  warp_reduce(best, at);
  __shared__ float warp_best[32];
  __shared__ int32_t warp_at[32];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_at[warp] = at;
  }
  __syncthreads();
  if (warp != 0) return;
  const bool have = lane < blockDim.x / 32;
  best = have ? warp_best[lane] : -INFINITY;
  at = have ? warp_at[lane] : none;
  warp_reduce(best, at);
  if (lane == 0) p.out[blockIdx.x] = at == none ? 0 : at;  // a row of NaNs: 0, as the reference
}

}  // namespace

int launch_argmax(const argmax_params& p, void* stream) {
  if (p.rows == 0) return 0;
  argmax_kernel<<<p.rows, 1024, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace baton::gpu::cuda
