#include <cuda_runtime.h>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

int device_count() {
  int n = 0;
  // Without a driver this fails ("driver version is insufficient"): that means no device.
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

void* device_alloc(uint64_t bytes) {
  void* p = nullptr;
  return cudaMalloc(&p, bytes) == cudaSuccess ? p : nullptr;
}

void device_free(void* ptr) { cudaFree(ptr); }

void copy_to_device(void* dst, const void* src, uint64_t bytes) {
  cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
}

void copy_to_host(void* dst, const void* src, uint64_t bytes) {
  cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
}

void* host_register_mapped(void* host, uint64_t bytes) {
  if (cudaHostRegister(host, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
    cudaGetLastError();
    cudaHostUnregister(host);
    return nullptr;
  }
  return dev;
}

void host_unregister(void* host) { cudaHostUnregister(host); }

}  // namespace baton::gpu::cuda
