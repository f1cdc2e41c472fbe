// Paged causal attention of prefill rows on the tensor cores (issue 12): bf16 mma.sync
// (m16n8k16, fp32 accumulate), flash-attention style.
//
// One block per (tile of up to 64 consecutive rows of one sequence, query head): four warps of 16
// rows each. K and V move through shared memory 64 positions at a time, gathered from their pages;
// each warp computes its 16 x 64 scores with the query in registers, folds them into a running
// max and sum per row (online softmax), and accumulates P·V with the probabilities rounded to
// bf16 as the A operand (the scores' accumulator fragment is the next product's A fragment, so
// they never leave registers).
//
// Every row walks the same blocks in the same order and its arithmetic never reads another
// row's numbers, so its result does not depend on its tile-mates: a block past a row's position
// is all masked (probability 0, a max and sum left as they were).
// bf16 only, head_dim 64 or 128. Written without a GPU at hand: its conformance case is in the
// doctest suite "unverified" until it has passed on the H200, and the executor uses it only when
// cuda_executor_config::flash_attention is set.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/cuda/kernels.hpp"
#include "gpu/cuda/row_math.cuh"

namespace baton::gpu::cuda {

namespace {

constexpr uint32_t block_positions = 64;
constexpr uint32_t warps = flash_tile_rows / 16;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (the lower index) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  const __nv_bfloat162 v{lo, hi};
  return *reinterpret_cast<const uint32_t*>(&v);
}

using row_math::mma_bf16;

/// The max (or sum) of a row's values over the four lanes that hold it (lanes 4i .. 4i + 3).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <uint32_t HD>
__global__ void __launch_bounds__(warps * 32) flash_attention_kernel(attention_params p) {
  constexpr uint32_t k_steps = HD / 16, score_tiles = block_positions / 8, out_tiles = HD / 8, pad = 8;
  __shared__ __align__(16) __nv_bfloat16 k_s[block_positions][HD + pad];  // padded rows: fewer bank conflicts
  __shared__ __align__(16) __nv_bfloat16 v_s[block_positions][HD + pad];
  const uint32_t tile = blockIdx.x, head = blockIdx.y;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, in_quad = lane % 4;
  const uint32_t first = p.tiles[tile], rows = p.tile_count[tile];
  const uint32_t kvh = head / (p.num_heads / p.num_kv_heads), kvd = p.num_kv_heads * HD;
  const uint32_t* pages = p.page_table + p.row_pages[first];
  const auto* kv = static_cast<const __nv_bfloat16*>(p.kv_layer);
  // A tile's rows are consecutive positions of one sequence: its last row sees the most.
  const uint32_t len = p.positions[first + rows - 1] + 1;

  // This thread's two rows of the warp's 16 (the accumulator layout of m16n8k16).
  const uint32_t r_lo = warp * 16 + quad, r_hi = r_lo + 8;
  const bool has_lo = r_lo < rows, has_hi = r_hi < rows;
  const uint32_t pos_lo = has_lo ? p.positions[first + r_lo] : 0, pos_hi = has_hi ? p.positions[first + r_hi] : 0;

  // The query in registers as A fragments, rounded to bf16 (rows past the tile: zeros).
  uint32_t qa[k_steps][4];
  auto q_pair = [&](uint32_t r, bool has, uint32_t d) -> uint32_t {
    if (!has) return 0;
    const float* src = p.q + uint64_t{first + r} * p.q_stride + head * HD + d;
    return pack_bf16(src[0], src[1]);
  };
#pragma unroll
  for (uint32_t kk = 0; kk < k_steps; ++kk) {
    const uint32_t d = kk * 16 + in_quad * 2;
    qa[kk][0] = q_pair(r_lo, has_lo, d);
    qa[kk][1] = q_pair(r_hi, has_hi, d);
    qa[kk][2] = q_pair(r_lo, has_lo, d + 8);
    qa[kk][3] = q_pair(r_hi, has_hi, d + 8);
  }

  float o[out_tiles][4];
#pragma unroll
  for (uint32_t j = 0; j < out_tiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;  // l: this thread's share of the row sum

  for (uint32_t c0 = 0; c0 < len; c0 += block_positions) {
    __syncthreads();  // every warp is done with the previous block
    constexpr uint32_t parts = HD / 8;  // 16-byte pieces per position
    for (uint32_t i = threadIdx.x; i < block_positions * parts; i += warps * 32) {
      const uint32_t j = i / parts, part = i % parts, t = c0 + j;
      uint4 kval{0, 0, 0, 0}, vval{0, 0, 0, 0};
      if (t < len) {
        const uint64_t at = uint64_t{pages[t / p.page_size_tokens]} * p.page_elems +
                            uint64_t{t % p.page_size_tokens} * kvd + kvh * HD + part * 8;
        kval = *reinterpret_cast<const uint4*>(kv + at);
        vval = *reinterpret_cast<const uint4*>(kv + at + uint64_t{p.page_size_tokens} * kvd);
      }
      *reinterpret_cast<uint4*>(&k_s[j][part * 8]) = kval;
      *reinterpret_cast<uint4*>(&v_s[j][part * 8]) = vval;
    }
    __syncthreads();

    // Scores: s[nt] holds (r_lo, c0 + nt*8 + in_quad*2 + {0, 1}) and the same columns of r_hi.
    float s[score_tiles][4];
#pragma unroll
    for (uint32_t nt = 0; nt < score_tiles; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (uint32_t kk = 0; kk < k_steps; ++kk) {
        const __nv_bfloat16* kp = &k_s[nt * 8 + quad][kk * 16 + in_quad * 2];
        mma_bf16(s[nt], qa[kk], *reinterpret_cast<const uint32_t*>(kp), *reinterpret_cast<const uint32_t*>(kp + 8));
      }
    }
    // Scale and causal mask (rows past the tile stay finite: nothing of theirs is stored).
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (uint32_t nt = 0; nt < score_tiles; ++nt)
#pragma unroll
      for (uint32_t e = 0; e < 2; ++e) {
        const uint32_t t = c0 + nt * 8 + in_quad * 2 + e;
        s[nt][e] = (!has_lo || t <= pos_lo) ? s[nt][e] * p.scale : -INFINITY;
        s[nt][2 + e] = (!has_hi || t <= pos_hi) ? s[nt][2 + e] * p.scale : -INFINITY;
        mx_lo = fmaxf(mx_lo, s[nt][e]);
        mx_hi = fmaxf(mx_hi, s[nt][2 + e]);
      }
    const float new_lo = fmaxf(m_lo, quad_max(mx_lo)), new_hi = fmaxf(m_hi, quad_max(mx_hi));
    // A row's first block always holds its position 0, so new_* is finite from the first block on.
    const float alpha_lo = expf(m_lo - new_lo), alpha_hi = expf(m_hi - new_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (uint32_t nt = 0; nt < score_tiles; ++nt)
#pragma unroll
      for (uint32_t e = 0; e < 2; ++e) {
        s[nt][e] = expf(s[nt][e] - new_lo);
        s[nt][2 + e] = expf(s[nt][2 + e] - new_hi);
        sum_lo += s[nt][e];
        sum_hi += s[nt][2 + e];
      }
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
    for (uint32_t j = 0; j < out_tiles; ++j) {
      o[j][0] *= alpha_lo;
      o[j][1] *= alpha_lo;
      o[j][2] *= alpha_hi;
      o[j][3] *= alpha_hi;
    }
    // O += P · V: P's accumulator fragments are the A fragments of the next product (positions
    // 16*ks .. 16*ks + 15 are score tiles 2*ks and 2*ks + 1). V is [position][dim] in shared
    // memory, so each B element pair (two positions, one dim) is gathered.
#pragma unroll
    for (uint32_t ks = 0; ks < block_positions / 16; ++ks) {
      const uint32_t pa[4] = {pack_bf16(s[2 * ks][0], s[2 * ks][1]), pack_bf16(s[2 * ks][2], s[2 * ks][3]),
                              pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]), pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3])};
      const uint32_t k0 = ks * 16 + in_quad * 2;
#pragma unroll
      for (uint32_t j = 0; j < out_tiles; ++j) {
        const uint32_t d = j * 8 + quad;
        mma_bf16(o[j], pa, pack_bf16(v_s[k0][d], v_s[k0 + 1][d]), pack_bf16(v_s[k0 + 8][d], v_s[k0 + 9][d]));
      }
    }
  }

  const float inv_lo = 1.0f / quad_sum(l_lo), inv_hi = 1.0f / quad_sum(l_hi);
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  const uint32_t width = p.num_heads * HD;
#pragma unroll
  for (uint32_t j = 0; j < out_tiles; ++j) {
    const uint32_t d = head * HD + j * 8 + in_quad * 2;
    if (has_lo)
      *reinterpret_cast<uint32_t*>(out + uint64_t{first + r_lo} * width + d) = pack_bf16(o[j][0] * inv_lo, o[j][1] * inv_lo);
    if (has_hi)
      *reinterpret_cast<uint32_t*>(out + uint64_t{first + r_hi} * width + d) = pack_bf16(o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
}

}  // namespace

bool flash_attention_supported(uint32_t head_dim, dtype type) {
  return type == dtype::bf16 && (head_dim == 64 || head_dim == 128);
}

int launch_flash_attention(const attention_params& p, void* stream) {
  if (p.num_tiles == 0) return 0;
  if (!flash_attention_supported(p.head_dim, p.type) || p.tile_rows != flash_tile_rows || p.splits != 1 ||
      p.num_heads == 0 || p.num_kv_heads == 0 || p.num_heads % p.num_kv_heads != 0 || p.page_elems % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.kv_layer) % 16 != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid{p.num_tiles, p.num_heads};
  auto s = static_cast<cudaStream_t>(stream);
  if (p.head_dim == 64)
    flash_attention_kernel<64><<<grid, warps * 32, 0, s>>>(p);
  else
    flash_attention_kernel<128><<<grid, warps * 32, 0, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace baton::gpu::cuda
