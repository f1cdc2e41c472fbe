// Paged causal attention on CUDA cores, one block per (tile of query rows, group of query heads
// sharing a KV head): a K or V row is read once for every (row, head) pair of the block.
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

/// Query heads one block serves: the heads of one KV head (grouped-query attention), up to this
/// many, so that a K or V row read from memory serves R·G (row, head) pairs. More heads per KV
/// head (Llama-3-70B's 8) take more blocks, each reading the rows again; groups of 1 or 2 heads
/// take a variant sized for them (heads_per_block), so no block computes for absent heads.
constexpr uint32_t max_group = 4;

/// G of the kernel variant for `group` query heads per KV head.
uint32_t heads_per_block(uint32_t group) { return group >= 3 ? 4 : group; }

/// Each pair's value reduced over the block's 128 threads as block_max / block_sum did, one
/// pair at a time (lanes by xor shuffles, then the four warps as (w0 ∘ w1) ∘ (w2 ∘ w3)), but
/// with two barriers for all pairs instead of two per pair.
template <bool is_max, uint32_t P>
__device__ void block_reduce(float (&v)[P], float (*scratch)[4]) {
#pragma unroll
  for (uint32_t q = 0; q < P; ++q)
    for (int o = 16; o; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v[q], o);
      v[q] = is_max ? fmaxf(v[q], other) : v[q] + other;
    }
  __syncthreads();  // the previous reduction's readers are done with scratch
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (uint32_t q = 0; q < P; ++q) scratch[q][threadIdx.x / 32] = v[q];
  __syncthreads();
#pragma unroll
  for (uint32_t q = 0; q < P; ++q) {
    const float* w = scratch[q];
    v[q] = is_max ? fmaxf(fmaxf(w[0], w[1]), fmaxf(w[2], w[3])) : (w[0] + w[1]) + (w[2] + w[3]);
  }
}

/// One block per (tile of up to R rows of one sequence, group of up to G query heads sharing a
/// KV head, range of positions). Pair q = r·G + g is row r with head g of the group. Each
/// pair's arithmetic (its dot products in dimension order, its online softmax over chunks of
/// 128 positions, its weighted sum of V in position order) is the same whatever the tile's other
/// rows and the group's other heads, so batching and grouping do not change a result.
///
/// RT is the most rows a tile holds: 1 for decode rows (a launch whose tiles all hold one row),
/// else R; G the query heads a block serves (heads_per_block); WIDE says head_dim exceeds the 128
/// threads (each then owns two output dims). None changes a pair's arithmetic, only how much
/// work the block does for pairs that do not exist.
template <typename T, uint32_t RT, uint32_t G, bool WIDE>
__global__ void __launch_bounds__(chunk) attention_kernel(attention_params p) {
  constexpr uint32_t P = RT * G;  // (row, head) pairs per block
  __shared__ float q_s[P][max_head_dim];
  __shared__ float p_s[P][chunk];
  __shared__ uint64_t v_off[chunk];
  __shared__ float scratch[P][4];
  const uint32_t tile = blockIdx.x, t = threadIdx.x;
  const uint32_t group = p.num_heads / p.num_kv_heads, blocks_per_kv = (group + G - 1) / G;
  const uint32_t kvh = blockIdx.y / blocks_per_kv, head0 = kvh * group + (blockIdx.y % blocks_per_kv) * G;
  const uint32_t heads = min(G, kvh * group + group - head0);
  const uint32_t first = p.tiles[tile], rows = p.tile_count[tile];
  const uint32_t hd = p.head_dim;
  const uint32_t kvd = p.num_kv_heads * hd;
  const uint32_t* pages = p.page_table + p.row_pages[first];
  const T* kv = static_cast<const T*>(p.kv_layer);
  auto live = [&](uint32_t q) { return q / G < rows && q % G < heads; };

  uint32_t pos[RT];
#pragma unroll
  for (uint32_t r = 0; r < RT; ++r) pos[r] = r < rows ? p.positions[first + r] : 0;
  uint32_t len = 0;
#pragma unroll
  for (uint32_t r = 0; r < RT; ++r) len = r < rows ? max(len, pos[r] + 1) : len;
  for (uint32_t q = 0; q < P; ++q)
    for (uint32_t d = t; d < hd; d += chunk)
      q_s[q][d] = live(q) ? p.q[uint64_t{first + q / G} * p.q_stride + (head0 + q % G) * hd + d] : 0.0f;
  __syncthreads();

  float m[P], l[P], acc[P][2];
#pragma unroll
  for (uint32_t q = 0; q < P; ++q) {
    m[q] = -INFINITY;
    l[q] = 0.0f;
    acc[q][0] = acc[q][1] = 0.0f;
  }
  // This block's share of the positions: all of them, or split blockIdx.z's range.
  const uint32_t begin = blockIdx.z * p.split_positions;
  const uint32_t end = p.splits > 1 ? min(len, begin + p.split_positions) : len;
  for (uint32_t c0 = p.splits > 1 ? begin : 0; c0 < end; c0 += chunk) {
    const uint32_t j = c0 + t;
    float s[P];
#pragma unroll
    for (uint32_t q = 0; q < P; ++q) s[q] = 0.0f;
    if (j < end) {
      const uint64_t base = uint64_t{pages[j / p.page_size_tokens]} * p.page_elems +
                            uint64_t{j % p.page_size_tokens} * kvd + uint64_t{kvh} * hd;
      v_off[t] = base + uint64_t{p.page_size_tokens} * kvd;
      // 16-byte loads: each thread walks its own K row (launch_attention checks alignment).
      const uint4* k = reinterpret_cast<const uint4*>(kv + base);
      constexpr uint32_t per = 16 / sizeof(T);
#pragma unroll 4  // four loads in flight before their products
      for (uint32_t d0 = 0; d0 < hd; d0 += per) {
        const uint4 raw = k[d0 / per];
        const T* kd = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (uint32_t i = 0; i < per; ++i) {
          const float kf = to_f(kd[i]);
#pragma unroll
          for (uint32_t q = 0; q < P; ++q) s[q] = fmaf(q_s[q][d0 + i], kf, s[q]);
        }
      }
    }
    // s becomes each pair's scores, then its probabilities; x its chunk max, then its rescale.
    float x[P];
#pragma unroll
    for (uint32_t q = 0; q < P; ++q) {
      s[q] = (j < end && live(q) && j <= pos[q / G]) ? s[q] * p.scale : -INFINITY;
      x[q] = s[q];
    }
    block_reduce<true, P>(x, scratch);
#pragma unroll
    for (uint32_t q = 0; q < P; ++q) {
      const float new_m = fmaxf(m[q], x[q]);  // -inf only while a split has seen none of the row's positions
      x[q] = m[q] == -INFINITY ? 0.0f : expf(m[q] - new_m);
      s[q] = s[q] == -INFINITY ? 0.0f : expf(s[q] - new_m);
      p_s[q][t] = s[q];
      acc[q][0] *= x[q];
      acc[q][1] *= x[q];
      m[q] = new_m;
    }
    block_reduce<false, P>(s, scratch);  // its barriers also publish p_s and v_off
#pragma unroll
    for (uint32_t q = 0; q < P; ++q) l[q] = l[q] * x[q] + s[q];
    // The chunk's V rows in position order, `ahead` loaded before their products: one row at a
    // time left each thread waiting a memory round trip per position (a decode step's attention
    // took 40 % of a batch-1 step on the H200).
    const uint32_t n = min(chunk, end - c0);
    constexpr uint32_t ahead = 16;
    for (uint32_t i0 = 0; i0 < n; i0 += ahead) {
      float v0[ahead], v1[ahead];
#pragma unroll
      for (uint32_t u = 0; u < ahead; ++u) {
        const bool in = i0 + u < n;
        const T* v = kv + v_off[in ? i0 + u : i0];
        v0[u] = in && t < hd ? to_f(v[t]) : 0.0f;
        v1[u] = WIDE && in && t + chunk < hd ? to_f(v[t + chunk]) : 0.0f;
      }
#pragma unroll
      for (uint32_t u = 0; u < ahead; ++u) {
        if (i0 + u >= n) break;
#pragma unroll
        for (uint32_t q = 0; q < P; ++q) {
          const float pq = p_s[q][i0 + u];
          acc[q][0] = fmaf(pq, v0[u], acc[q][0]);
          if (WIDE) acc[q][1] = fmaf(pq, v1[u], acc[q][1]);
        }
      }
    }
    __syncthreads();  // p_s and v_off are rewritten by the next chunk
  }
  const uint32_t qd = p.num_heads * hd;
#pragma unroll
  for (uint32_t q = 0; q < P; ++q) {
    if (!live(q)) continue;
    const uint32_t row = first + q / G, head = head0 + q % G;
    if (p.splits > 1) {  // unnormalised, with the running max and sum, for attention_merge
      float* part = p.partial + ((uint64_t{blockIdx.z} * p.rows + row) * p.num_heads + head) * (hd + 2);
      if (t < hd) part[t] = acc[q][0];
      if (t + chunk < hd) part[t + chunk] = acc[q][1];
      if (t == 0) {
        part[hd] = m[q];
        part[hd + 1] = l[q];
      }
      continue;
    }
    T* out = static_cast<T*>(p.out) + uint64_t{row} * qd + head * hd;
    if (t < hd) put(out + t, acc[q][0] / l[q]);
    if (t + chunk < hd) put(out + t + chunk, acc[q][1] / l[q]);
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
  if (p.head_dim > max_head_dim || p.head_dim % 8 != 0 || (p.tile_rows != R && p.tile_rows != 1) ||
      p.num_heads == 0 || p.num_kv_heads == 0 || p.num_heads % p.num_kv_heads != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (p.splits == 0 || (p.splits > 1 && (!p.partial || p.split_positions == 0 || p.split_positions % chunk != 0)))
    return static_cast<int>(cudaErrorInvalidValue);
  const uint32_t group = p.num_heads / p.num_kv_heads, g = heads_per_block(group);
  const dim3 grid{p.num_tiles, p.num_kv_heads * ((group + g - 1) / g), p.splits};
  auto s = static_cast<cudaStream_t>(stream);
  const bool one = p.tile_rows == 1, wide = p.head_dim > chunk;
  // The variants by (rows per tile, heads per block, wide): 12 per element type.
  auto by_wide = [&]<typename T, uint32_t RT, uint32_t GH>() {
    if (wide)
      attention_kernel<T, RT, GH, true><<<grid, chunk, 0, s>>>(p);
    else
      attention_kernel<T, RT, GH, false><<<grid, chunk, 0, s>>>(p);
  };
  auto by_heads = [&]<typename T, uint32_t RT>() {
    if (g == 1)
      by_wide.template operator()<T, RT, 1>();
    else if (g == 2)
      by_wide.template operator()<T, RT, 2>();
    else
      by_wide.template operator()<T, RT, max_group>();
  };
  auto by_rows = [&]<typename T>() {
    if (one)
      by_heads.template operator()<T, 1>();
    else
      by_heads.template operator()<T, R>();
  };
  if (p.type == dtype::f32)
    by_rows.template operator()<float>();
  else
    by_rows.template operator()<__nv_bfloat16>();
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
