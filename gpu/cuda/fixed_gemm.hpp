#pragma once

// Batch-invariant matrix products of many rows, behind the C-like GPU boundary (no CUDA headers;
// streams as void*).
//
// cuBLAS picks a kernel per shape, so a row's result could change whenever its batch grew by one
// row: another tile, another split of k, another summation order. fixed_gemm gives each (weight
// shape, row bucket) one cuBLASLt algorithm, chosen once among the heuristic's candidates at the
// bucket's largest and smallest sizes, given split-K 1 and no reduction (nothing that sums over k
// in an order the grid decides), and checked to run at both; one needing no workspace if any
// does (on the H200 none did for Llama-3-8B's qkv at 513-8192 rows). Within a bucket a row's bits
// then do not depend on how many rows share the product; crossing a bucket's edge may change
// them. The buckets are few so that each keeps a kernel fit for its sizes.

#include <cstdint>
#include <memory>
#include <string>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

class fixed_gemm {
public:
  /// Null and why when cuBLASLt cannot start (no device, no library).
  static std::unique_ptr<fixed_gemm> create(dtype type, std::string* why);
  ~fixed_gemm();
  fixed_gemm(const fixed_gemm&) = delete;
  fixed_gemm& operator=(const fixed_gemm&) = delete;

  /// y[m][n] (fp32) = beta·y + a[m][k] · w[n][k]ᵀ, a and w of the type given at creation, fp32
  /// accumulation, on `stream`. Empty on success, else a sentence naming the shape. Not
  /// thread-safe: one caller thread (an executor's job thread).
  std::string run(const void* a, const void* w, float* y, uint32_t m, uint32_t n, uint32_t k, float beta, void* stream);

  /// The bucket of m rows: its largest size (1-64: 64, 65-512: 512, more: 8192).
  static uint32_t row_bucket(uint32_t m);
  /// The algorithm chosen for a shape's bucket, in words (for benchmarks' reports); chooses it if
  /// no product ran yet.
  std::string describe(uint32_t m, uint32_t n, uint32_t k);

private:
  struct impl;
  explicit fixed_gemm(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace baton::gpu::cuda
