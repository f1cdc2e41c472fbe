// Drawing a token at a temperature over the whole vocabulary, on the device: sample_token's plain
// draw (no top-k, no top-p, no penalties). One block per row: the row's max, the sum of
// exp((x - max) / T) in double, then a scan over the row in chunks of the block, stopping at the
// first token whose running sum passes u times the total. Every reduction has a fixed order, so a
// row's token depends on its logits and its draw only, not on its batch. Against sample_token
// (which divides each term by the total as it goes) only rounding differs: a draw that falls
// within rounding of a boundary between two tokens may pick the other one.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

namespace {

constexpr uint32_t threads = 1024, warps_per_block = threads / 32;

__device__ float block_max_of(float v, float* scratch) {  // NaN never wins (fmaxf drops it)
  for (int o = 16; o; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float m = scratch[0];
  for (uint32_t w = 1; w < warps_per_block; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

/// The block's sum, in one fixed order (lanes pairwise, then the warps in order).
__device__ double block_sum_of(double v, double* scratch) {
  for (int o = 16; o; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0.0;
  for (uint32_t w = 0; w < warps_per_block; ++w) s += scratch[w];
  return s;
}

__device__ __forceinline__ double prob(float x, float mx, float temperature) {
  const double e = x == mx ? 1.0 : exp((static_cast<double>(x) - mx) / temperature);
  return isnan(e) ? 0.0 : e;  // a NaN logit (or an infinite temperature over -inf) has none, as on the host
}

__global__ void __launch_bounds__(threads) draw_kernel(draw_params p) {
  __shared__ float fscratch[warps_per_block];
  __shared__ double dscratch[warps_per_block];
  __shared__ double warp_sums[warps_per_block];
  __shared__ int32_t found;
  __shared__ int32_t last_possible;
  const uint32_t row = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32;
  if (p.u[row] < 0.0) return;  // a row that makes no draw (the same for every thread)
  const float* x = p.logits + static_cast<uint64_t>(row) * p.cols;
  const float temperature = p.temperature[row];

  float local_max = -INFINITY;
  int any_number = 0;
  for (uint32_t i = t; i < p.cols; i += threads) {
    local_max = fmaxf(local_max, x[i]);
    any_number |= !isnan(x[i]);
  }
  if (!__syncthreads_or(any_number)) {  // no number in the row: as sample_token, token 0
    if (t == 0) p.out[row] = 0;
    return;
  }
  const float mx = block_max_of(local_max, fscratch);
  double local_sum = 0.0;
  for (uint32_t i = t; i < p.cols; i += threads) local_sum += prob(x[i], mx, temperature);
  const double target = p.u[row] * block_sum_of(local_sum, dscratch);

  if (t == 0) found = -1;
  double before = 0.0;  // the sum over the chunks already passed (the same in every thread)
  for (uint32_t c0 = 0; c0 < p.cols; c0 += threads) {
    const uint32_t i = c0 + t;
    const double mine = i < p.cols ? prob(x[i], mx, temperature) : 0.0;
    // Inclusive scan of the chunk: within each warp, then the warps' totals in order.
    double incl = mine;
    for (int o = 1; o < 32; o *= 2) {
      const double y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= static_cast<uint32_t>(o)) incl += y;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    double offset = before;
    for (uint32_t w = 0; w < warp; ++w) offset += warp_sums[w];
    const double running = offset + incl;
    // The first token whose running sum passes the target (and has any probability).
    if (i < p.cols && mine > 0.0 && running > target) atomicMin(reinterpret_cast<unsigned*>(&found), i);
    __syncthreads();
    if (found >= 0) break;
    for (uint32_t w = 0; w < warps_per_block; ++w) before += warp_sums[w];
  }
  if (found < 0) {  // rounding left the sum just under the target (the same in every thread)
    // The last token that had a chance, as sample_token: never one with none (a NaN logit).
    // Only here, so a draw's common path takes no atomics.
    if (t == 0) last_possible = 0;
    __syncthreads();
    int32_t mine_last = -1;
    for (uint32_t i = t; i < p.cols; i += threads)
      if (prob(x[i], mx, temperature) > 0.0) mine_last = static_cast<int32_t>(i);
    if (mine_last >= 0) atomicMax(&last_possible, mine_last);
    __syncthreads();
  }
  if (t == 0) p.out[row] = found >= 0 ? found : last_possible;
}

}  // namespace

int launch_draw(const draw_params& p, void* stream) {
  if (p.rows == 0) return 0;
  if (p.cols == 0) return static_cast<int>(cudaErrorInvalidValue);
  draw_kernel<<<p.rows, threads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace baton::gpu::cuda
