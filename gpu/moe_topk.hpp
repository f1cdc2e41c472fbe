#pragma once

// The top-k selection of DeepSeek's routing, shared by the CPU reference (gpu/moe_routing.cpp)
// and the CUDA routing kernel (gpu/cuda/deepseek_kernels.cu), so both pick with the same code.

#include <cstdint>

#if defined(__CUDACC__)
#define BATON_HOST_DEVICE __host__ __device__
#else
#define BATON_HOST_DEVICE
#endif

namespace baton::gpu {

/// Indices of the k largest of v[0..n), best first; the lower index first among equals. n is
/// small (experts or groups, hundreds at most): a partial selection sort keeps it simple and free
/// of allocation, on either side.
BATON_HOST_DEVICE inline void top_k_indices(const float* v, uint32_t n, uint32_t k, uint32_t* out) {
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t best = n;
    for (uint32_t i = 0; i < n; ++i) {
      bool taken = false;
      for (uint32_t p = 0; p < j; ++p) taken = taken || out[p] == i;
      if (!taken && (best == n || v[i] > v[best])) best = i;
    }
    out[j] = best;
  }
}

}  // namespace baton::gpu
