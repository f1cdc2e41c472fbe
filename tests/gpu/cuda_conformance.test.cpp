// Conformance of every CUDA kernel with its CPU reference (design.md §7.5). Built only when
// nvcc exists; each case skips (passes without checking) when the machine has no GPU.

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "gpu/cpu_kernels.hpp"
#include "gpu/cuda/kernels.hpp"
#include "tests/test_util.hpp"

using namespace baton::gpu;

TEST_CASE("cuda rmsnorm equals the CPU reference bit for bit" * doctest::skip(cuda::device_count() == 0)) {
  const uint32_t rows = 7, dim = 259;  // a dim that is not a multiple of 8 exercises the lane tails
  std::vector<float> x(rows * dim), w(dim), ref(rows * dim), got(rows * dim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i) * 0.7f) * 3.0f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = 1.0f + 0.01f * static_cast<float>(i % 13);
  rmsnorm(x.data(), w.data(), rows, dim, 1e-5f, ref.data());
  auto* dx = static_cast<float*>(cuda::device_alloc(x.size() * 4));
  auto* dw = static_cast<float*>(cuda::device_alloc(w.size() * 4));
  auto* dy = static_cast<float*>(cuda::device_alloc(got.size() * 4));
  REQUIRE(dx);
  cuda::copy_to_device(dx, x.data(), x.size() * 4);
  cuda::copy_to_device(dw, w.data(), w.size() * 4);
  CHECK(cuda::launch_rmsnorm({dx, dw, dy, rows, dim, 1e-5f}, nullptr) == 0);
  cuda::copy_to_host(got.data(), dy, got.size() * 4);
  CHECK(baton::test::same_bits(got, ref));
  cuda::device_free(dx);
  cuda::device_free(dw);
  cuda::device_free(dy);
}
