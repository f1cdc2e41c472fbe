#pragma once

// Helpers of the CUDA conformance tests (tests/gpu/*.test.cpp): device copies that free
// themselves, deterministic inputs, and bf16 rounding done by the device itself.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu/cuda/kernels.hpp"

namespace baton::test {

namespace cuda = baton::gpu::cuda;

/// Device copies that free themselves (tests only).
struct dev_vec {
  void* ptr = nullptr;
  explicit dev_vec(uint64_t bytes) : ptr(cuda::device_alloc(bytes)) {}
  template <typename T>
  explicit dev_vec(const std::vector<T>& host) : ptr(cuda::device_alloc(host.size() * sizeof(T))) {
    cuda::copy_to_device(ptr, host.data(), host.size() * sizeof(T));
  }
  ~dev_vec() { cuda::device_free(ptr); }
  template <typename T>
  T* as() { return static_cast<T*>(ptr); }
  template <typename T>
  std::vector<T> get(size_t n) const {
    std::vector<T> out(n);
    cuda::copy_to_host(out.data(), ptr, n * sizeof(T));
    return out;
  }
};

inline std::vector<float> wavy(size_t n, float a, float b, float scale = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(static_cast<float>(i) * a + b);
  return v;
}

/// fp32 -> bf16 -> fp32 on the device (round to nearest even), for bf16 inputs of references.
inline std::vector<float> through_bf16(const std::vector<float>& x) {
  dev_vec src{x}, mid{x.size() * 2}, back{x.size() * 4};
  cuda::launch_convert({src.ptr, cuda::dtype::f32, mid.ptr, cuda::dtype::bf16, x.size()}, nullptr);
  cuda::launch_convert({mid.ptr, cuda::dtype::bf16, back.ptr, cuda::dtype::f32, x.size()}, nullptr);
  return back.get<float>(x.size());
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace baton::test
