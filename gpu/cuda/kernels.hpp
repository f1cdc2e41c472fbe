#pragma once

// The C-like GPU boundary (design.md §7.5): flat parameter structs, one comment per field with
// its unit, `launch_<kernel>(params, stream)`. No CUDA headers here, so CPU-only code can
// include it; the stream is a cudaStream_t passed as void*.
// Every kernel has a CPU reference in gpu/cpu_kernels.hpp and a conformance test in
// tests/gpu/cuda_conformance.test.cpp (CTest label "gpu", skipped without a device).

#include <cstdint>

namespace baton::gpu::cuda {

/// Number of usable CUDA devices; 0 when the build has no CUDA or the machine has no driver.
int device_count();

struct rmsnorm_params {
  const float* x;       ///< device, [rows][dim] fp32 input
  const float* weight;  ///< device, [dim] fp32 scale
  float* y;             ///< device, [rows][dim] fp32 output (may alias x)
  uint32_t rows;        ///< number of rows (tokens)
  uint32_t dim;         ///< values per row (hidden size)
  float eps;            ///< added to the mean square before the reciprocal square root
};
/// Returns 0 on success, else the cudaError_t value of the launch.
int launch_rmsnorm(const rmsnorm_params& p, void* stream);

/// Blocking helpers for the conformance tests: copy host <-> device, allocate, free.
void* device_alloc(uint64_t bytes);
void device_free(void* ptr);
void copy_to_device(void* dst, const void* src, uint64_t bytes);
void copy_to_host(void* dst, const void* src, uint64_t bytes);

}  // namespace baton::gpu::cuda
