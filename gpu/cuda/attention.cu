// Paged causal attention on CUDA cores, one block per (tile of query rows, query head).
//
// Positions are taken 128 at a time: thread t scores position c0 + t against every row of the
// tile (the K row is read once for the tile), the block folds the chunk into a running
// max/sum (online softmax), then thread d accumulates output dims d and d + 128 over the chunk's
// V rows (coalesced: consecutive threads read consecutive elements of one V row). Every row's
// arithmetic is the same whatever its tile-mates, so batching does not change a result.
// Long decodes split their positions over several blocks (splits > 1: the chip would otherwise
// run one block per sequence and head), each leaving a partial softmax that a second kernel merges;
// the split count follows the context length alone, so it too is the same whatever the batch.
// This is the correct, simple version (issue 11); the tensor-core kernel is issue 12's.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

namespace {

constexpr uint32_t chunk = 128;     // positions per step = threads per block
constexpr uint32_t max_head_dim = 256;
constexpr uint32_t R = attention_tile_rows;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ float block_max(float v, float* scratch) {  // scratch: 4 floats; blockDim.x == 128
  for (int o = 16; o; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  return fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
}

__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  return (scratch[0] + scratch[1]) + (scratch[2] + scratch[3]);
}

template <typename T>
__global__ void __launch_bounds__(chunk) attention_kernel(attention_params p) {
  __shared__ float q_s[R][max_head_dim];
  __shared__ float p_s[R][chunk];
  __shared__ uint64_t v_off[chunk];
  __shared__ float scratch[4];
  const uint32_t tile = blockIdx.x, head = blockIdx.y, t = threadIdx.x;
  const uint32_t first = p.tiles[tile], rows = p.tile_count[tile];
  const uint32_t hd = p.head_dim, kvh = head / (p.num_heads / p.num_kv_heads);
  const uint32_t kvd = p.num_kv_heads * hd;
  const uint32_t* pages = p.page_table + p.row_pages[first];
  const T* kv = static_cast<const T*>(p.kv_layer);

  uint32_t pos[R];
#pragma unroll
  for (uint32_t r = 0; r < R; ++r) pos[r] = r < rows ? p.positions[first + r] : 0;
  uint32_t len = 0;
#pragma unroll
  for (uint32_t r = 0; r < R; ++r) len = r < rows ? max(len, pos[r] + 1) : len;
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t d = t; d < hd; d += chunk) q_s[r][d] = r < rows ? p.q[uint64_t{first + r} * p.q_stride + head * hd + d] : 0.0f;
  __syncthreads();

  float m[R], l[R], acc[R][2];
#pragma unroll
  for (uint32_t r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    acc[r][0] = acc[r][1] = 0.0f;
  }
  // This block's share of the positions: all of them, or split blockIdx.z's range.
  const uint32_t begin = blockIdx.z * p.split_positions;
  const uint32_t end = p.splits > 1 ? min(len, begin + p.split_positions) : len;
  for (uint32_t c0 = p.splits > 1 ? begin : 0; c0 < end; c0 += chunk) {
    const uint32_t j = c0 + t;
    float s[R];
#pragma unroll
    for (uint32_t r = 0; r < R; ++r) s[r] = 0.0f;
    if (j < end) {
      const uint64_t base = uint64_t{pages[j / p.page_size_tokens]} * p.page_elems +
                            uint64_t{j % p.page_size_tokens} * kvd + uint64_t{kvh} * hd;
      v_off[t] = base + uint64_t{p.page_size_tokens} * kvd;
      // 16-byte loads: each thread walks its own K row (launch_attention checks alignment).
      const uint4* k = reinterpret_cast<const uint4*>(kv + base);
      constexpr uint32_t per = 16 / sizeof(T);
      for (uint32_t d0 = 0; d0 < hd; d0 += per) {
        const uint4 raw = k[d0 / per];
        const T* kd = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (uint32_t i = 0; i < per; ++i) {
          const float kf = to_f(kd[i]);
#pragma unroll
          for (uint32_t r = 0; r < R; ++r) s[r] = fmaf(q_s[r][d0 + i], kf, s[r]);
        }
      }
    }
#pragma unroll
    for (uint32_t r = 0; r < R; ++r) {
      const float sc = (j < end && r < rows && j <= pos[r]) ? s[r] * p.scale : -INFINITY;
      const float cmax = block_max(sc, scratch);
      const float new_m = fmaxf(m[r], cmax);  // -inf only while a split has seen none of the row's positions
      const float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - new_m);
      const float pr = sc == -INFINITY ? 0.0f : expf(sc - new_m);
      p_s[r][t] = pr;
      l[r] = l[r] * corr + block_sum(pr, scratch);
      acc[r][0] *= corr;
      acc[r][1] *= corr;
      m[r] = new_m;
    }
    __syncthreads();
    const uint32_t n = min(chunk, end - c0);
    for (uint32_t i = 0; i < n; ++i) {
      const T* v = kv + v_off[i];
      const float v0 = t < hd ? to_f(v[t]) : 0.0f;
      const float v1 = t + chunk < hd ? to_f(v[t + chunk]) : 0.0f;
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        acc[r][0] = fmaf(p_s[r][i], v0, acc[r][0]);
        acc[r][1] = fmaf(p_s[r][i], v1, acc[r][1]);
      }
    }
    __syncthreads();  // p_s and v_off are rewritten by the next chunk
  }
  const uint32_t qd = p.num_heads * hd;
#pragma unroll
  for (uint32_t r = 0; r < R; ++r) {
    if (r >= rows) continue;
    if (p.splits > 1) {  // unnormalised, with the running max and sum, for attention_merge
      float* part = p.partial + ((uint64_t{blockIdx.z} * p.rows + first + r) * p.num_heads + head) * (hd + 2);
      if (t < hd) part[t] = acc[r][0];
      if (t + chunk < hd) part[t + chunk] = acc[r][1];
      if (t == 0) {
        part[hd] = m[r];
        part[hd + 1] = l[r];
      }
      continue;
    }
    T* out = static_cast<T*>(p.out) + uint64_t{first + r} * qd + head * hd;
    if (t < hd) put(out + t, acc[r][0] / l[r]);
    if (t + chunk < hd) put(out + t + chunk, acc[r][1] / l[r]);
  }
}

/// One block per (row, head): the splits' partial softmaxes rescaled to their common max.
template <typename T>
__global__ void attention_merge_kernel(attention_params p) {
  const uint32_t row = blockIdx.x, head = blockIdx.y, hd = p.head_dim;
  auto part = [&](uint32_t z) { return p.partial + ((uint64_t{z} * p.rows + row) * p.num_heads + head) * (hd + 2); };
  float mx = -INFINITY;
  for (uint32_t z = 0; z < p.splits; ++z) mx = fmaxf(mx, part(z)[hd]);
  float l = 0.0f;
  for (uint32_t z = 0; z < p.splits; ++z) {
    const float m = part(z)[hd];
    if (m != -INFINITY) l += expf(m - mx) * part(z)[hd + 1];
  }
  T* out = static_cast<T*>(p.out) + uint64_t{row} * p.num_heads * hd + head * hd;
  for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (uint32_t z = 0; z < p.splits; ++z) {
      const float m = part(z)[hd];
      if (m != -INFINITY) acc += expf(m - mx) * part(z)[d];
    }
    put(out + d, acc / l);
  }
}

}  // namespace

int launch_attention(const attention_params& p, void* stream) {
  if (p.num_tiles == 0) return 0;
  // 16-byte K loads need every K vector 16-byte aligned: head_dim a multiple of 8 elements.
  if (p.head_dim > max_head_dim || p.head_dim % 8 != 0 || p.tile_rows != R || p.num_heads % p.num_kv_heads != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (p.splits == 0 || (p.splits > 1 && (!p.partial || p.split_positions == 0 || p.split_positions % chunk != 0)))
    return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid{p.num_tiles, p.num_heads, p.splits};
  auto s = static_cast<cudaStream_t>(stream);
  if (p.type == dtype::f32)
    attention_kernel<float><<<grid, chunk, 0, s>>>(p);
  else
    attention_kernel<__nv_bfloat16><<<grid, chunk, 0, s>>>(p);
  if (p.splits > 1) {
    const dim3 merge{p.rows, p.num_heads};
    if (p.type == dtype::f32)
      attention_merge_kernel<float><<<merge, 128, 0, s>>>(p);
    else
      attention_merge_kernel<__nv_bfloat16><<<merge, 128, 0, s>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace baton::gpu::cuda
