// Matrix products of a few rows (decode: one row per sequence) without cuBLAS: the input rows are
// staged in shared memory, and one warp per output column streams that weight row once with
// 16-byte loads and dots it with every input row. Memory-bound by design (the weights are read once per step); cuBLAS's general kernels read
// them at about a quarter of the HBM rate at m = 1 (docs/perf.md). Each output sums in one fixed
// order (lane partials over 16-byte chunks, then a butterfly), whatever m is: batch-invariant for
// every m up to gemv_max_rows.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gpu/cuda/kernels.hpp"
#include "gpu/cuda/row_math.cuh"

namespace baton::gpu::cuda {

namespace {

using row_math::widen;

constexpr uint32_t threads = 512;  // 16 warps, 16 columns per block

/// U: 16-byte loads each lane issues before it uses the first (more bytes in flight hide more of
/// the memory latency, at the cost of registers). Every lane still takes its chunks in ascending
/// order, so the sums and their bits do not depend on U.
template <typename T, int U>
__global__ void __launch_bounds__(threads) gemv_kernel(gemv_params p) {
  constexpr uint32_t per = 16 / sizeof(T);  // elements per 16-byte chunk
  const uint32_t chunks = p.k / per;
  // The input rows, staged once per block: every warp reads them for its column.
  extern __shared__ uint4 a_s[];
  const uint4* a_g = static_cast<const uint4*>(p.a);
  for (uint32_t i = threadIdx.x; i < p.m * chunks; i += blockDim.x) a_s[i] = a_g[i];
  __syncthreads();
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t col = blockIdx.x * (blockDim.x / 32) + warp;
  if (col >= p.n) return;
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + uint64_t{col} * p.k);
  float acc[gemv_max_rows];
#pragma unroll
  for (uint32_t r = 0; r < gemv_max_rows; ++r) acc[r] = 0.0f;
  // U chunks in flight per lane before the first use.
  uint32_t c = lane;
  for (; c + 32 * (U - 1) < chunks; c += 32 * U) {
    uint4 wr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) wr[u] = __ldg(w + c + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float wf[per];
      widen(wr[u], wf, static_cast<const T*>(nullptr));
#pragma unroll
      for (uint32_t r = 0; r < gemv_max_rows; ++r) {
        if (r >= p.m) break;
        float af[per];
        widen(a_s[r * chunks + c + 32 * u], af, static_cast<const T*>(nullptr));
#pragma unroll
        for (uint32_t i = 0; i < per; ++i) acc[r] = fmaf(wf[i], af[i], acc[r]);
      }
    }
  }
  for (; c < chunks; c += 32) {
    float wf[per];
    widen(__ldg(w + c), wf, static_cast<const T*>(nullptr));
#pragma unroll
    for (uint32_t r = 0; r < gemv_max_rows; ++r) {
      if (r >= p.m) break;
      float af[per];
      widen(a_s[r * chunks + c], af, static_cast<const T*>(nullptr));
#pragma unroll
      for (uint32_t i = 0; i < per; ++i) acc[r] = fmaf(wf[i], af[i], acc[r]);
    }
  }
#pragma unroll
  for (uint32_t r = 0; r < gemv_max_rows; ++r) {
    if (r >= p.m) break;
    float v = acc[r];
    for (int o = 16; o; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) {
      float* y = p.y + uint64_t{r} * p.n + col;
      *y = p.beta == 0.0f ? v : p.beta * *y + v;
    }
  }
}

}  // namespace

int launch_gemv(const gemv_params& p, void* stream) {
  if (p.m == 0 || p.n == 0) return 0;
  const uint32_t per = 16 / dtype_bytes(p.type);
  const uint64_t smem = uint64_t{p.m} * p.k * dtype_bytes(p.type);
  if (p.m > gemv_max_rows || p.k % per != 0 || smem > gemv_max_input_bytes ||
      (p.loads_in_flight != 0 && p.loads_in_flight != 4 && p.loads_in_flight != 8))
    return static_cast<int>(cudaErrorInvalidValue);
  // Above 48 KiB a block's dynamic shared memory must be allowed first (once per kernel and device).
  row_math::allow_dynamic_smem<gemv_kernel<float, 4>>(gemv_max_input_bytes);
  row_math::allow_dynamic_smem<gemv_kernel<__nv_bfloat16, 4>>(gemv_max_input_bytes);
  row_math::allow_dynamic_smem<gemv_kernel<float, 8>>(gemv_max_input_bytes);
  row_math::allow_dynamic_smem<gemv_kernel<__nv_bfloat16, 8>>(gemv_max_input_bytes);
  const unsigned blocks = (p.n + threads / 32 - 1) / (threads / 32);
  auto s = static_cast<cudaStream_t>(stream);
  const bool eight = p.loads_in_flight == 8;
  if (p.type == dtype::f32)
    eight ? gemv_kernel<float, 8><<<blocks, threads, smem, s>>>(p) : gemv_kernel<float, 4><<<blocks, threads, smem, s>>>(p);
  else if (eight)
    gemv_kernel<__nv_bfloat16, 8><<<blocks, threads, smem, s>>>(p);
  else
    gemv_kernel<__nv_bfloat16, 4><<<blocks, threads, smem, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace baton::gpu::cuda
