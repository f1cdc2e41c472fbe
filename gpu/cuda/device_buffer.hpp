#pragma once

// Device and page-locked host allocations that free themselves (host code of the CUDA backend
// only: this header includes the CUDA runtime's).

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::gpu::cuda {

/// A device allocation that frees itself; grow() keeps the old one when it is large enough.
struct device_buffer {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }
  void release() {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
  }
  cudaError_t grow(uint64_t need) {
    if (need <= bytes) return cudaSuccess;
    release();
    const auto rc = cudaMalloc(&ptr, need);
    if (rc == cudaSuccess) bytes = need;
    return rc;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

/// Pinned host memory that frees itself.
struct pinned_buffer {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  ~pinned_buffer() {
    if (ptr) cudaFreeHost(ptr);
  }
  cudaError_t grow(uint64_t need) {
    if (need <= bytes) return cudaSuccess;
    if (ptr) cudaFreeHost(ptr);
    ptr = nullptr;
    bytes = 0;
    const auto rc = cudaMallocHost(&ptr, need);
    if (rc == cudaSuccess) bytes = need;
    return rc;
  }
};

}  // namespace baton::gpu::cuda
