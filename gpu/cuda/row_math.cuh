#pragma once

// Helpers the kernels share (CUDA sources only): fp32/bf16 loads and stores, 16-byte loads
// widened to fp32, the CPU reference's RMS reduction (so every kernel that normalises a row
// rounds as rmsnorm does), warp reductions, the bf16 tensor-core product, and the launchers'
// stream and error plumbing.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace baton::gpu::cuda::row_math {

/// Lets `Kernel` take as much dynamic shared memory as the device allows a block (above 48 KiB
/// a kernel must ask first), when a launch needs more than 48 KiB (`bytes`). It asks for the
/// device's opt-in limit, not for `bytes`: a later launch of the same kernel may need more
/// (a wider model in the same process), and the attribute is set once per device. It belongs
/// to the device's context, so once per device, not per process; every executor launches each
/// kernel once before it captures a graph, so it never runs during a capture. A launch needing
/// more than the device has fails, and the launch's error says so.
template <auto Kernel>
inline void allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> asked{0};  // a bit per device
  if (bytes <= 48 * 1024) return;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return;
  const uint64_t bit = uint64_t{1} << device;
  if (asked.load(std::memory_order_acquire) & bit) return;
  int optin = 0;
  cudaFuncAttributes attr{};
  // A failure here leaves no error behind (the launchers read cudaGetLastError): the launch that
  // then needs more than it may have fails, and says so itself.
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attr, Kernel) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  const int dynamic_max = optin - static_cast<int>(attr.sharedSizeBytes);
  if (dynamic_max > 0 &&
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_max) == cudaSuccess)
    asked.fetch_or(bit, std::memory_order_acq_rel);
  else
    cudaGetLastError();
}

__device__ __forceinline__ float load_as_float(const float* p, uint64_t i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p, uint64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_from_float(float* p, uint64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, uint64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

/// 16 bytes of fp32 or bf16 values (the pointer's type says which) widened to fp32, exactly as
/// load_as_float widens each.
__device__ __forceinline__ void widen(const uint4& raw, float* out, const float*) {
  const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = f[i];
}
__device__ __forceinline__ void widen(const uint4& raw, float* out, const __nv_bfloat16*) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
/// The 16 bytes at p (16-byte aligned), widened.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float* out) {
  widen(*reinterpret_cast<const uint4*>(p), out, p);
}

/// c += a · b for one 16x8x16 tile on the tensor cores: a row-major 16x16, b column-major 16x8,
/// c 16x8 fp32 (mma.sync m16n8k16, bf16 inputs).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
/// A launcher's return: 0, or the cudaError_t of its launch.
inline int last_error() { return static_cast<int>(cudaGetLastError()); }

/// The CPU reference's reduction: lane j of 8 sums x[i]² for i ≡ j (mod 8), then pairwise.
/// Called by a whole warp; returns the reciprocal RMS to every lane.
__device__ __forceinline__ float inv_rms_warp(const float* x, uint32_t dim, float eps) {
  const uint32_t lane = threadIdx.x % 32;
  float acc = 0.0f;
  if (lane < 8) {
#pragma unroll 8  // the loads go ahead of the serial adds
    for (uint32_t i = lane; i < dim; i += 8) acc = __fadd_rn(acc, __fmul_rn(x[i], x[i]));
  }
  float l[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) l[j] = __shfl_sync(0xffffffffu, acc, j);
  const float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  return 1.0f / sqrtf(__fdiv_rn(s, static_cast<float>(dim)) + eps);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace baton::gpu::cuda::row_math
