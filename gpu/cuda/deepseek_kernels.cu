// DeepSeek's layers on CUDA cores (gpu/cuda/deepseek_kernels.hpp): MLA's latent bookkeeping and
// attention, the per-head absorbed products, and the mixture of experts' routing, plan, grouped
// products and combine. Like the first kernels of issue 11 they are the correct, simple version:
// every output is summed in one fixed order whatever its batch, so a request's numbers do not
// depend on who shares its step; the tensor-core forms come after their conformance on the H200.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "gpu/cuda/deepseek_kernels.hpp"
#include "gpu/cuda/row_math.cuh"
#include "gpu/moe_topk.hpp"

namespace baton::gpu::cuda {

namespace {

using namespace row_math;

// ---- MLA ------------------------------------------------------------------------------------

/// One block per row: normalise the compressed KV, rotate the shared key and every head's RoPE
/// query part, then store the latent (compressed KV | rotated key) into the row's slot.
template <typename T>
__global__ void mla_finish_kernel(mla_finish_params p) {
  const uint32_t r = blockIdx.x, lat = p.lora + p.rope, qk = p.nope + p.rope, pairs = p.rope / 2;
  float* kva = p.kva + uint64_t{r} * lat;
  const float pos = static_cast<float>(p.positions[r]);
  __shared__ float inv;
  if (threadIdx.x < 32) {
    const float v = inv_rms_warp(kva, p.lora, p.eps);
    if (threadIdx.x == 0) inv = v;
  }
  __syncthreads();
  // [0, lora) is normalised, [lora, lat) rotated: disjoint, so no barrier between the two.
  for (uint32_t i = threadIdx.x; i < p.lora; i += blockDim.x) kva[i] = __fmul_rn(p.kv_a_norm[i], __fmul_rn(kva[i], inv));
  for (uint32_t item = threadIdx.x; item < (p.heads + 1) * pairs; item += blockDim.x) {
    const uint32_t v = item / pairs, i = item % pairs;  // v == heads: the shared key
    const float* src = v == p.heads ? kva + p.lora : p.q + uint64_t{r} * p.heads * qk + uint64_t{v} * qk + p.nope;
    float* dst = v == p.heads ? kva + p.lora : p.q_lat + (uint64_t{r} * p.heads + v) * lat + p.lora;
    const uint32_t a = p.interleave ? 2 * i : i, b = p.interleave ? 2 * i + 1 : i + pairs;
    const float angle = pos * p.inv_freq[i];
    const float c = cosf(angle), s = sinf(angle);
    const float x1 = src[a], x2 = src[b];
    dst[a] = (x1 * c - x2 * s) * p.rope_factor;
    dst[b] = (x2 * c + x1 * s) * p.rope_factor;
  }
  __syncthreads();
  T* slot = static_cast<T*>(p.kv_layer) + p.kv_slot[r];
  for (uint32_t i = threadIdx.x; i < lat; i += blockDim.x) store_from_float(slot, i, kva[i]);
}

constexpr uint32_t gemv_tile_max = 8;  // rows per block of head_gemv
constexpr uint32_t gemv_threads = 256;

/// Grid (row tiles, heads, column groups); one warp per output column at a time, its lanes
/// striding the input (16 bytes of weights a load where rows allow), then a butterfly sum: a
/// row's result is the same in any tile.
template <typename TW, typename TY>
__global__ void __launch_bounds__(gemv_threads) head_gemv_kernel(head_gemv_params p, uint32_t tile) {
  extern __shared__ float xs[];  // [tile][in_dim]
  const uint32_t h = blockIdx.y, r0 = blockIdx.x * tile, nr = min(tile, p.rows - r0);
  for (uint32_t i = threadIdx.x; i < nr * p.in_dim; i += blockDim.x) {
    const uint32_t rr = i / p.in_dim, c = i % p.in_dim;
    xs[i] = p.x[(r0 + rr) * p.x_row_stride + uint64_t{h} * p.x_head_stride + c];
  }
  __syncthreads();
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const TW* w = static_cast<const TW*>(p.w) + uint64_t{h} * p.out_dim * p.in_dim;
  TY* y = static_cast<TY*>(p.y);
  for (uint32_t j = blockIdx.z * warps + warp; j < p.out_dim; j += warps * gridDim.z) {
    const TW* wr = w + uint64_t{j} * p.in_dim;
    float acc[gemv_tile_max] = {};
    constexpr uint32_t V = 16 / sizeof(TW);
    if (p.in_dim % V == 0) {  // 16-byte loads: every weight row starts aligned (cudaMalloc'd, in_dim apart)
      for (uint32_t i = lane * V; i < p.in_dim; i += 32 * V) {
        float wv[V];
        load16(wr + i, wv);
#pragma unroll
        for (uint32_t v = 0; v < V; ++v)
#pragma unroll
          for (uint32_t rr = 0; rr < gemv_tile_max; ++rr)
            if (rr < nr) acc[rr] = fmaf(wv[v], xs[rr * p.in_dim + i + v], acc[rr]);
      }
    } else {
      for (uint32_t i = lane; i < p.in_dim; i += 32) {
        const float wv = load_as_float(wr, i);
#pragma unroll
        for (uint32_t rr = 0; rr < gemv_tile_max; ++rr)
          if (rr < nr) acc[rr] = fmaf(wv, xs[rr * p.in_dim + i], acc[rr]);
      }
    }
#pragma unroll
    for (uint32_t rr = 0; rr < gemv_tile_max; ++rr) {
      const float s = warp_sum(acc[rr]);
      if (lane == 0 && rr < nr) store_from_float(y, (r0 + rr) * p.y_row_stride + uint64_t{h} * p.y_head_stride + j, s);
    }
  }
}

template <typename TW, typename TY>
void head_gemv_as(const head_gemv_params& p, dim3 grid, uint32_t tile, uint32_t smem, cudaStream_t s) {
  row_math::allow_dynamic_smem<head_gemv_kernel<TW, TY>>(96 * 1024);  // room for 96 KiB of staged rows
  head_gemv_kernel<TW, TY><<<grid, gemv_threads, smem, s>>>(p, tile);
}

constexpr uint32_t la_threads = 256;
constexpr uint32_t la_chunk = 32;  // positions per step: one per lane of a head's softmax warp
constexpr uint32_t la_dims = mla_max_lora / la_threads;  // output dims per thread
constexpr uint32_t HPB = mla_heads_per_block;

/// Grid (rows, head groups), 8 warps. Per chunk of 32 positions: the warps score (head,
/// position) pairs (lanes over the latent, then a butterfly sum); warp h folds head h's chunk
/// into its running max and sum; then thread t accumulates dims t, t + 256, ... of every head
/// from each cached latent (read once for all the block's heads, coalesced across threads).
template <typename T>
__global__ void __launch_bounds__(la_threads) latent_attention_kernel(latent_attention_params p) {
  extern __shared__ float q_s[];  // [HPB][lat]
  __shared__ float s_s[HPB][la_chunk];
  __shared__ float m_s[HPB], l_s[HPB], corr_s[HPB];
  __shared__ uint64_t off_s[la_chunk];
  const uint32_t row = blockIdx.x, h0 = blockIdx.y * HPB, lat = p.lora + p.rope;
  const uint32_t nh = min(HPB, p.heads - h0);
  const uint32_t t = threadIdx.x, warp = t / 32, lane = t % 32;
  const float* q = p.q_lat + (uint64_t{row} * p.heads + h0) * lat;
  for (uint32_t i = t; i < nh * lat; i += la_threads) q_s[i] = q[i];
  if (t < HPB) {
    m_s[t] = -INFINITY;
    l_s[t] = 0.0f;
  }
  const uint32_t ps = p.page_size_tokens, z = blockIdx.z;
  // This block's positions: all of [0, pos], or its split's part of them (possibly none).
  const uint32_t len = p.positions[row] + 1;
  const uint32_t begin = p.splits > 1 ? min(len, z * p.split_positions) : 0;
  const uint32_t end = p.splits > 1 ? min(len, begin + p.split_positions) : len;
  const uint32_t* pages = p.page_table + p.row_pages[row];
  const T* kv = static_cast<const T*>(p.kv_layer);
  float acc[HPB][la_dims] = {};
  __syncthreads();
  for (uint32_t c0 = begin; c0 < end; c0 += la_chunk) {
    const uint32_t cn = min(la_chunk, end - c0);
    if (t < cn) {
      const uint32_t pos = c0 + t;
      off_s[t] = uint64_t{pages[pos / ps]} * p.page_elems + uint64_t{pos % ps} * lat;
    }
    __syncthreads();
    for (uint32_t pair = warp; pair < nh * cn; pair += la_threads / 32) {
      const uint32_t hh = pair / cn, j = pair % cn;
      const T* k = kv + off_s[j];
      const float* qh = q_s + hh * lat;
      float d = 0.0f;
      for (uint32_t i = lane; i < lat; i += 32) d = fmaf(qh[i], load_as_float(k, i), d);
      d = warp_sum(d);
      if (lane == 0) s_s[hh][j] = d * p.scale;
    }
    __syncthreads();
    if (warp < nh) {  // HPB == la_threads / 32: one warp per head of the block
      const float v = lane < cn ? s_s[warp][lane] : -INFINITY;
      const float m_old = m_s[warp], m_new = fmaxf(m_old, warp_max(v));
      const float e = lane < cn ? expf(v - m_new) : 0.0f;
      s_s[warp][lane] = e;
      const float sum = warp_sum(e);
      if (lane == 0) {
        const float corr = expf(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
        corr_s[warp] = corr;
        l_s[warp] = l_s[warp] * corr + sum;
        m_s[warp] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (uint32_t hh = 0; hh < HPB; ++hh) {
      const float cr = hh < nh ? corr_s[hh] : 0.0f;
#pragma unroll
      for (uint32_t dd = 0; dd < la_dims; ++dd) acc[hh][dd] *= cr;
    }
    for (uint32_t j = 0; j < cn; ++j) {
      const T* v = kv + off_s[j];
      float vals[la_dims];
#pragma unroll
      for (uint32_t dd = 0; dd < la_dims; ++dd) {
        const uint32_t d = t + dd * la_threads;
        vals[dd] = d < p.lora ? load_as_float(v, d) : 0.0f;
      }
#pragma unroll
      for (uint32_t hh = 0; hh < HPB; ++hh) {
        const float pj = hh < nh ? s_s[hh][j] : 0.0f;
#pragma unroll
        for (uint32_t dd = 0; dd < la_dims; ++dd) acc[hh][dd] = fmaf(pj, vals[dd], acc[hh][dd]);
      }
    }
    __syncthreads();  // the next chunk overwrites off_s and s_s
  }
  if (p.splits > 1) {  // the partial: unnormalised sums, then the running max and sum
#pragma unroll
    for (uint32_t hh = 0; hh < HPB; ++hh) {
      if (hh >= nh) break;
      float* part = p.partial + ((uint64_t{z} * p.rows + row) * p.heads + h0 + hh) * (p.lora + 2);
#pragma unroll
      for (uint32_t dd = 0; dd < la_dims; ++dd) {
        const uint32_t d = t + dd * la_threads;
        if (d < p.lora) part[d] = acc[hh][dd];
      }
      if (t == 0) {
        part[p.lora] = m_s[hh];  // -inf for a range past the row's positions
        part[p.lora + 1] = l_s[hh];
      }
    }
    return;
  }
#pragma unroll
  for (uint32_t hh = 0; hh < HPB; ++hh) {
    if (hh >= nh) break;
    const float inv = 1.0f / l_s[hh];
    float* out = p.out + (uint64_t{row} * p.heads + h0 + hh) * p.lora;
#pragma unroll
    for (uint32_t dd = 0; dd < la_dims; ++dd) {
      const uint32_t d = t + dd * la_threads;
      if (d < p.lora) out[d] = acc[hh][dd] * inv;
    }
  }
}

/// One block per (row, head): the splits' partials rescaled to their common max, summed in z
/// order. A row with one non-empty range gets acc · (1 / l) exactly as unsplit (exp(0) = 1).
__global__ void latent_merge_kernel(latent_attention_params p) {
  const uint32_t row = blockIdx.x, head = blockIdx.y, w = p.lora + 2;
  auto part = [&](uint32_t z) { return p.partial + ((uint64_t{z} * p.rows + row) * p.heads + head) * w; };
  float mx = -INFINITY;
  for (uint32_t z = 0; z < p.splits; ++z) mx = fmaxf(mx, part(z)[p.lora]);
  float l = 0.0f;
  for (uint32_t z = 0; z < p.splits; ++z)
    if (part(z)[p.lora] != -INFINITY) l += expf(part(z)[p.lora] - mx) * part(z)[p.lora + 1];
  const float inv = 1.0f / l;
  float* out = p.out + (uint64_t{row} * p.heads + head) * p.lora;
  for (uint32_t d = threadIdx.x; d < p.lora; d += blockDim.x) {
    float acc = 0.0f;
    for (uint32_t z = 0; z < p.splits; ++z)
      if (part(z)[p.lora] != -INFINITY) acc += expf(part(z)[p.lora] - mx) * part(z)[d];
    out[d] = acc * inv;
  }
}

// ---- MoE ------------------------------------------------------------------------------------

constexpr uint32_t max_top_k = 32;

/// top_k_indices with a whole warp (out in shared memory): each lane takes every 32nd value in the
/// same rule, then a butterfly keeps the larger value, the lower index among equals. Without
/// NaNs that is the sequential pick, so the experts chosen are the same.
__device__ void top_k_warp(const float* v, uint32_t n, uint32_t k, uint32_t* out) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t best = n;
    float bv = 0.0f;
    for (uint32_t i = lane; i < n; i += 32) {
      bool taken = false;
      for (uint32_t q = 0; q < j; ++q) taken = taken || out[q] == i;
      if (!taken && (best == n || v[i] > bv)) {
        best = i;
        bv = v[i];
      }
    }
    for (int o = 16; o; o /= 2) {
      const uint32_t ob = __shfl_xor_sync(0xffffffffu, best, o);
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      if (ob != n && (best == n || ov > bv || (ov == bv && ob < best))) {
        best = ob;
        bv = ov;
      }
    }
    if (lane == 0) out[j] = best;
    __syncwarp();
  }
}

constexpr uint32_t route_rows_per_block = 4;  // one warp per row

/// One warp per row, moe_route's steps in moe_route's order, its arrays in shared memory (a
/// thread's own arrays for 512 experts would be local memory the driver reserves for every
/// resident thread of the GPU, over a gigabyte). Element-wise steps run across the lanes, which
/// rounds each element as one thread would; the sums and selections run on lane 0 in the CPU's
/// order, and the top-k over the experts is top_k_warp's; so the choices are the CPU's wherever
/// the scores are (CUDA's expf may round an ulp apart from glibc's).
__global__ void __launch_bounds__(32 * route_rows_per_block) moe_route_kernel(moe_route_params p) {
  __shared__ float scores_s[route_rows_per_block][moe_max_experts], choice_s[route_rows_per_block][moe_max_experts];
  __shared__ float group_s[route_rows_per_block][64];
  __shared__ uint32_t groups_s[route_rows_per_block][64], ex_s[route_rows_per_block][max_top_k];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t r = blockIdx.x * route_rows_per_block + warp;
  if (r >= p.rows) return;  // whole warps leave; no block barrier follows
  const uint32_t n = p.experts, k = p.top_k;
  const float* logits = p.logits + uint64_t{r} * n;
  float* scores = scores_s[warp];
  float* choice = choice_s[warp];
  if (p.sigmoid) {
    for (uint32_t e = lane; e < n; e += 32) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
  } else {
    float mx = -INFINITY;
    for (uint32_t e = lane; e < n; e += 32) mx = fmaxf(mx, logits[e]);
    mx = warp_max(mx);  // a maximum is the same in any order
    for (uint32_t e = lane; e < n; e += 32) scores[e] = expf(logits[e] - mx);
    __syncwarp();
    if (lane == 0) {
      float sum = 0.0f;
      for (uint32_t e = 0; e < n; ++e) sum += scores[e];
      group_s[warp][0] = sum;
    }
    __syncwarp();
    const float sum = group_s[warp][0];
    for (uint32_t e = lane; e < n; e += 32) scores[e] /= sum;
  }
  const bool noaux = p.method == 2;
  for (uint32_t e = lane; e < n; e += 32) choice[e] = scores[e] + (p.bias && noaux ? p.bias[e] : 0.0f);
  __syncwarp();
  if (p.method != 0 && lane == 0) {  // the group limit: a few dozen groups, on one lane
    const uint32_t per = n / p.n_group;
    float* group_score = group_s[warp];
    for (uint32_t g = 0; g < p.n_group; ++g) {
      const float* c = choice + g * per;
      if (noaux) {
        uint32_t two[2];
        top_k_indices(c, per, 2, two);
        group_score[g] = c[two[0]] + c[two[1]];
      } else {
        float best = c[0];
        for (uint32_t i = 1; i < per; ++i) best = fmaxf(best, c[i]);
        group_score[g] = best;
      }
    }
    uint32_t* chosen_groups = groups_s[warp];
    top_k_indices(group_score, p.n_group, p.topk_group, chosen_groups);
    for (uint32_t g = 0; g < p.n_group; ++g) {
      bool kept = false;
      for (uint32_t i = 0; i < p.topk_group; ++i) kept = kept || chosen_groups[i] == g;
      if (!kept)
        for (uint32_t i = 0; i < per; ++i) choice[g * per + i] = 0.0f;  // 0, not -inf, as the references mask
    }
  }
  __syncwarp();
  uint32_t* ex = ex_s[warp];
  top_k_warp(choice, n, k, ex);
  if (lane != 0) return;
  for (uint32_t i = 1; i < k; ++i)  // ascending ids: a row's experts are always summed in one order
    for (uint32_t j = i; j > 0 && ex[j - 1] > ex[j]; --j) {
      const uint32_t tmp = ex[j];
      ex[j] = ex[j - 1];
      ex[j - 1] = tmp;
    }
  float sum = 0.0f;
  for (uint32_t j = 0; j < k; ++j) sum += scores[ex[j]];
  for (uint32_t j = 0; j < k; ++j) {
    float x = scores[ex[j]];
    if (p.norm_topk_prob) x /= sum + 1e-20f;
    p.chosen[uint64_t{r} * k + j] = ex[j];
    p.weight[uint64_t{r} * k + j] = x * p.routed_scaling_factor;
  }
}

constexpr uint32_t plan_threads = moe_max_experts;
constexpr uint32_t plan_chunk = 4096;

/// Thread e of the block visits, in order, every (row, expert) pair bound for expert e (e <
/// experts): the pairs go through shared memory a chunk at a time, and every thread reads the
/// same element at once (a broadcast). All threads of the block must call it (its barriers).
template <typename Visit>
__device__ void walk_pairs(const moe_plan_params& p, Visit visit) {
  __shared__ uint32_t buf[plan_chunk];
  const uint32_t e = threadIdx.x, pairs = p.rows * p.top_k;
  for (uint32_t base = 0; base < pairs; base += plan_chunk) {
    const uint32_t n = min(plan_chunk, pairs - base);
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) buf[i] = p.chosen[base + i];
    __syncthreads();
    if (e < p.experts)
      for (uint32_t i = 0; i < n; ++i)
        if (buf[i] == e) visit(base + i);
  }
}

/// One block, a thread per expert: counting its expert's pairs, then (moe_slots_kernel)
/// numbering them, so the sorted order is fixed by the rows alone.
__global__ void __launch_bounds__(plan_threads) moe_plan_kernel(moe_plan_params p) {
  __shared__ uint32_t off_s[moe_max_experts + 1], tile_s[moe_max_experts + 1];
  const uint32_t e = threadIdx.x;
  const bool mine = e < p.experts;
  uint32_t count = 0;
  walk_pairs(p, [&](uint32_t) { ++count; });
  if (mine) off_s[e] = count;
  __syncthreads();
  if (threadIdx.x == 0) {  // a few hundred experts: a sequential scan costs less than a barrier tree
    uint32_t at = 0, tiles = 0;
    for (uint32_t x = 0; x < p.experts; ++x) {
      const uint32_t c = off_s[x];
      off_s[x] = at;
      tile_s[x] = tiles;
      at += c;
      tiles += (c + moe_tile_rows - 1) / moe_tile_rows;
    }
    off_s[p.experts] = at;
    p.offsets[p.experts] = at;
    *p.num_tiles = tiles;
  }
  __syncthreads();
  if (!mine) return;  // no barrier follows
  p.offsets[e] = off_s[e];
  for (uint32_t i = 0; i * moe_tile_rows < count; ++i) {
    p.tile_expert[tile_s[e] + i] = e;
    p.tile_first[tile_s[e] + i] = off_s[e] + i * moe_tile_rows;
  }
}

/// The plan's second walk: each pair's place in the sorted order (a second kernel, which starts
/// once the first kernel's offsets are written).
__global__ void __launch_bounds__(plan_threads) moe_slots_kernel(moe_plan_params p) {
  uint32_t next = threadIdx.x < p.experts ? p.offsets[threadIdx.x] : 0;
  walk_pairs(p, [&](uint32_t i) {
    const uint32_t s = next++;
    p.slot[i] = s;
    p.slot_row[s] = i / p.top_k;
  });
}

constexpr uint32_t gg_tn = 64, gg_bk = 16, gg_threads = 256;
constexpr uint32_t gg_skinny_rows = 8, gg_skinny_k = 256;  // a decode step's expert: a few rows
static_assert(2 * gg_threads / gg_tn == gg_skinny_rows, "the skinny path gives each thread two rows of one column");

/// A tile of at most 8 rows (most experts of a decode step): each thread owns one output column
/// for two of the rows and streams that column's weights once, instead of computing a 64-row
/// tile of which one row is real. Each output is the same fmaf chain over k as the tiled path's,
/// zero padding to a multiple of gg_bk included, so a row's bits do not depend on which path
/// its expert's row count picked.
template <typename T>
__device__ void grouped_gemm_skinny(const grouped_gemm_params& p, const T* a, const uint64_t* arow, const T* w,
                                    uint32_t first, uint32_t nrows, uint32_t n0) {
  __shared__ float xs[gg_skinny_rows][gg_skinny_k];
  const uint32_t t = threadIdx.x, c = n0 + t % gg_tn, r0 = 2 * (t / gg_tn);  // rows r0, r0 + 1
  const uint32_t kpad = (p.k + gg_bk - 1) / gg_bk * gg_bk;
  float acc0 = 0.0f, acc1 = 0.0f;
  const T* wr = w + uint64_t{min(c, p.n - 1)} * p.k;
  for (uint32_t k0 = 0; k0 < kpad; k0 += gg_skinny_k) {
    const uint32_t kn = min(gg_skinny_k, kpad - k0);
    __syncthreads();
    for (uint32_t i = t; i < nrows * gg_skinny_k; i += gg_threads) {
      const uint32_t r = i / gg_skinny_k, kk = i % gg_skinny_k, kg = k0 + kk;
      xs[r][kk] = kg < p.k ? load_as_float(a, arow[r] + kg) : 0.0f;
    }
    __syncthreads();
    if (r0 >= nrows) continue;
    const bool two = r0 + 1 < nrows;
    uint32_t kk = 0;
    // 16-byte weight loads while whole vectors remain (a row starts 16-byte aligned when k is a
    // multiple of a vector: cudaMalloc'd, rows and experts k values apart); the same fmaf chain.
    constexpr uint32_t V = 16 / sizeof(T);
    if (p.k % V == 0)
      for (; kk + V <= kn && k0 + kk + V <= p.k; kk += V) {
        float wv[V];
        load16(wr + k0 + kk, wv);
#pragma unroll
        for (uint32_t v = 0; v < V; ++v) {
          acc0 = fmaf(xs[r0][kk + v], wv[v], acc0);
          if (two) acc1 = fmaf(xs[r0 + 1][kk + v], wv[v], acc1);
        }
      }
    for (; kk < kn; ++kk) {  // the tail, and the zero padding to a multiple of gg_bk
      const uint32_t kg = k0 + kk;
      const float wv = kg < p.k ? load_as_float(wr, kg) : 0.0f;
      acc0 = fmaf(xs[r0][kk], wv, acc0);
      if (two) acc1 = fmaf(xs[r0 + 1][kk], wv, acc1);
    }
  }
  if (c >= p.n || r0 >= nrows) return;
  p.y[uint64_t{first + r0} * p.n + c] = acc0;
  if (r0 + 1 < nrows) p.y[uint64_t{first + r0 + 1} * p.n + c] = acc1;
}

/// One block per (plan tile, 64 output columns), 4 x 4 outputs per thread, k in steps of 16
/// through shared memory. Rows past the tile's expert and k past the end are zeros, which add
/// nothing: every output is the plain k-ordered sum whatever the tile holds.
template <typename T>
__global__ void __launch_bounds__(gg_threads) grouped_gemm_kernel(grouped_gemm_params p) {
  const uint32_t tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  constexpr uint32_t TM = moe_tile_rows;
  const uint32_t e = p.tile_expert[tile], first = p.tile_first[tile];
  const uint32_t nrows = min(first + TM, p.offsets[e + 1]) - first;
  const uint32_t n0 = blockIdx.y * gg_tn, t = threadIdx.x;
  __shared__ float as[gg_bk][TM + 4];
  __shared__ float ws[gg_bk][gg_tn + 4];
  __shared__ uint64_t arow[TM];
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w) + uint64_t{e} * p.n * p.k;
  if (t < TM) {
    const uint32_t s = first + min(t, nrows - 1);
    arow[t] = uint64_t{p.a_rows ? p.a_rows[s] : s} * p.a_stride;
  }
  if (nrows <= gg_skinny_rows) {  // the whole block takes one branch: its tile's row count
    __syncthreads();               // arow is read by every thread of the skinny path
    return grouped_gemm_skinny(p, a, arow, w, first, nrows, n0);
  }
  const uint32_t tr = t / 16, tc = t % 16;
  float acc[4][4] = {};
  for (uint32_t k0 = 0; k0 < p.k; k0 += gg_bk) {
    __syncthreads();
    for (uint32_t i = t; i < TM * gg_bk; i += gg_threads) {
      const uint32_t r = i / gg_bk, kk = i % gg_bk, kg = k0 + kk;
      as[kk][r] = r < nrows && kg < p.k ? load_as_float(a, arow[r] + kg) : 0.0f;
    }
    for (uint32_t i = t; i < gg_tn * gg_bk; i += gg_threads) {
      const uint32_t c = i / gg_bk, kk = i % gg_bk, kg = k0 + kk, ng = n0 + c;
      ws[kk][c] = ng < p.n && kg < p.k ? load_as_float(w, uint64_t{ng} * p.k + kg) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (uint32_t kk = 0; kk < gg_bk; ++kk) {
      float av[4], wv[4];
#pragma unroll
      for (uint32_t i = 0; i < 4; ++i) {
        av[i] = as[kk][tr * 4 + i];
        wv[i] = ws[kk][tc * 4 + i];
      }
#pragma unroll
      for (uint32_t i = 0; i < 4; ++i)
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
    }
  }
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i)
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      const uint32_t r = tr * 4 + i, c = n0 + tc * 4 + j;
      if (r < nrows && c < p.n) p.y[uint64_t{first + r} * p.n + c] = acc[i][j];
    }
}

constexpr uint32_t tc_k = 64, tc_threads = 128;  // k per stage; 4 warps of 16 rows

/// The grouped product on the tensor cores (bf16, k and a's stride multiples of 8): one block per
/// (plan tile, 64 columns), warp w computes rows 16w .. 16w + 15 of the tile (warps past the
/// tile's rows only stage). A and W go through shared memory 64 k at a time in 16-byte pieces
/// (zeros past the rows, the columns and k); m16n8k16: A row-major from the staged rows, B
/// column-major, i.e. W's rows (k contiguous) as they are. A row's outputs come from its own
/// products in one k order, whatever shares its tile.
__global__ void __launch_bounds__(tc_threads) grouped_gemm_tc_kernel(grouped_gemm_params p) {
  const uint32_t tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  constexpr uint32_t TM = moe_tile_rows, pieces = tc_k / 8;
  const uint32_t e = p.tile_expert[tile], first = p.tile_first[tile];
  const uint32_t nrows = min(first + TM, p.offsets[e + 1]) - first;
  const uint32_t n0 = blockIdx.y * gg_tn;
  __shared__ __align__(16) __nv_bfloat16 a_s[TM][tc_k + 8];  // padded rows: fewer bank conflicts
  __shared__ __align__(16) __nv_bfloat16 w_s[gg_tn][tc_k + 8];
  __shared__ uint64_t arow[TM];
  const auto* a = static_cast<const __nv_bfloat16*>(p.a);
  const auto* w = static_cast<const __nv_bfloat16*>(p.w) + uint64_t{e} * p.n * p.k;
  const uint32_t t = threadIdx.x, warp = t / 32, lane = t % 32, quad = lane / 4, in_quad = lane % 4;
  if (t < TM) {
    const uint32_t s = first + min(t, nrows - 1);
    arow[t] = uint64_t{p.a_rows ? p.a_rows[s] : s} * p.a_stride;
  }
  const bool busy = warp * 16 < nrows;
  float c[gg_tn / 8][4] = {};
  for (uint32_t k0 = 0; k0 < p.k; k0 += tc_k) {
    __syncthreads();  // the previous stage is read; arow is written (first pass)
    for (uint32_t i = t; i < TM * pieces; i += tc_threads) {
      const uint32_t r = i / pieces, part = i % pieces, kg = k0 + part * 8;
      uint4 av{0, 0, 0, 0}, wv{0, 0, 0, 0};
      if (r < nrows && kg < p.k) av = *reinterpret_cast<const uint4*>(a + arow[r] + kg);
      if (n0 + r < p.n && kg < p.k) wv = *reinterpret_cast<const uint4*>(w + uint64_t{n0 + r} * p.k + kg);
      *reinterpret_cast<uint4*>(&a_s[r][part * 8]) = av;  // TM == gg_tn: row r of both tiles
      *reinterpret_cast<uint4*>(&w_s[r][part * 8]) = wv;
    }
    __syncthreads();
    if (!busy) continue;
#pragma unroll
    for (uint32_t kk = 0; kk < tc_k; kk += 16) {
      const uint32_t r_lo = warp * 16 + quad, col = kk + in_quad * 2;
      const uint32_t af[4] = {*reinterpret_cast<const uint32_t*>(&a_s[r_lo][col]),
                              *reinterpret_cast<const uint32_t*>(&a_s[r_lo + 8][col]),
                              *reinterpret_cast<const uint32_t*>(&a_s[r_lo][col + 8]),
                              *reinterpret_cast<const uint32_t*>(&a_s[r_lo + 8][col + 8])};
#pragma unroll
      for (uint32_t nt = 0; nt < gg_tn / 8; ++nt) {
        const uint32_t cc = nt * 8 + quad;  // B's column: this lane's W row
        mma_bf16(c[nt], af, *reinterpret_cast<const uint32_t*>(&w_s[cc][col]),
                 *reinterpret_cast<const uint32_t*>(&w_s[cc][col + 8]));
      }
    }
  }
  if (!busy) return;
#pragma unroll
  for (uint32_t nt = 0; nt < gg_tn / 8; ++nt)
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {  // c[0..1]: row quad, c[2..3]: row quad + 8
      const uint32_t r = warp * 16 + quad + 8 * half, col = n0 + nt * 8 + in_quad * 2;
      if (r >= nrows) continue;
      float* y = p.y + uint64_t{first + r} * p.n;
      if (col < p.n) y[col] = c[nt][2 * half];
      if (col + 1 < p.n) y[col + 1] = c[nt][2 * half + 1];
    }
}
static_assert(moe_tile_rows == gg_tn, "the tensor-core kernel stages A and W rows with one index");
static_assert(moe_tile_rows == 16 * (tc_threads / 32), "a warp per 16 rows of a tile");

/// One block per row; rounding as the CPU executor's (no fused multiply-adds).
__global__ void moe_combine_kernel(moe_combine_params p) {
  const uint32_t r = blockIdx.x;
  const uint32_t* slot = p.slot + uint64_t{r} * p.top_k;
  const float* weight = p.weight + uint64_t{r} * p.top_k;
  for (uint32_t d = threadIdx.x; d < p.hidden; d += blockDim.x) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < p.top_k; ++j) acc = __fadd_rn(acc, __fmul_rn(weight[j], p.y[uint64_t{slot[j]} * p.hidden + d]));
    if (p.shared) acc = __fadd_rn(acc, p.shared[uint64_t{r} * p.hidden + d]);
    p.x[uint64_t{r} * p.hidden + d] = __fadd_rn(p.x[uint64_t{r} * p.hidden + d], acc);
  }
}

}  // namespace

int launch_mla_finish(const mla_finish_params& p, void* stream) {
  if (p.rows == 0) return 0;
  if (p.rope % 2 || p.lora == 0) return static_cast<int>(cudaErrorInvalidValue);
  if (p.type == dtype::f32)
    mla_finish_kernel<float><<<p.rows, 128, 0, as_stream(stream)>>>(p);
  else
    mla_finish_kernel<__nv_bfloat16><<<p.rows, 128, 0, as_stream(stream)>>>(p);
  return last_error();
}

int launch_head_gemv(const head_gemv_params& p, void* stream) {
  if (p.rows == 0 || p.heads == 0 || p.out_dim == 0) return 0;
  if (p.in_dim == 0 || p.in_dim > head_gemv_max_in) return static_cast<int>(cudaErrorInvalidValue);
  // As many rows per block as fit in 96 KiB of shared memory, at most 8.
  const uint32_t tile = std::clamp<uint32_t>(96 * 1024 / (p.in_dim * 4), 1, gemv_tile_max);
  const uint32_t smem = tile * p.in_dim * 4;
  const uint32_t warps = gemv_threads / 32;
  // Few blocks (a decode step's router): one column per warp, so more of the chip streams the
  // weights; else four per warp, so each block's staged rows serve more columns.
  const uint32_t tiles = (p.rows + tile - 1) / tile, per_warp = tiles * p.heads < 132 ? 1 : 4;
  const uint32_t groups = std::clamp<uint32_t>((p.out_dim + per_warp * warps - 1) / (per_warp * warps), 1, 1024);
  const dim3 grid{tiles, p.heads, groups};
  auto s = as_stream(stream);
  const bool wb = p.w_type == dtype::bf16, yb = p.y_type == dtype::bf16;
  if (!wb && !yb) head_gemv_as<float, float>(p, grid, tile, smem, s);
  if (!wb && yb) head_gemv_as<float, __nv_bfloat16>(p, grid, tile, smem, s);
  if (wb && !yb) head_gemv_as<__nv_bfloat16, float>(p, grid, tile, smem, s);
  if (wb && yb) head_gemv_as<__nv_bfloat16, __nv_bfloat16>(p, grid, tile, smem, s);
  return last_error();
}

int launch_latent_attention(const latent_attention_params& p, void* stream) {
  if (p.rows == 0) return 0;
  const uint32_t lat = p.lora + p.rope;
  if (p.lora == 0 || p.lora > mla_max_lora || lat > mla_max_latent) return static_cast<int>(cudaErrorInvalidValue);
  if (p.splits == 0 || (p.splits > 1 && (!p.partial || p.split_positions == 0 || p.split_positions % la_chunk != 0)))
    return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid{p.rows, (p.heads + HPB - 1) / HPB, p.splits};
  const uint32_t smem = HPB * lat * 4;
  auto s = as_stream(stream);
  if (p.type == dtype::f32)
    latent_attention_kernel<float><<<grid, la_threads, smem, s>>>(p);
  else
    latent_attention_kernel<__nv_bfloat16><<<grid, la_threads, smem, s>>>(p);
  if (p.splits > 1) latent_merge_kernel<<<dim3{p.rows, p.heads}, 128, 0, s>>>(p);
  return last_error();
}

int launch_moe_route(const moe_route_params& p, void* stream) {
  if (p.rows == 0) return 0;
  if (p.experts == 0 || p.experts > moe_max_experts || p.top_k == 0 || p.top_k > max_top_k || p.top_k > p.experts ||
      p.method > 2 || (p.method != 0 && (p.n_group == 0 || p.n_group > 64 || p.experts % p.n_group ||
                                         p.topk_group == 0 || p.topk_group > p.n_group)) ||
      (p.method == 2 && p.experts / p.n_group < 2))  // noaux_tc scores a group by its best two
    return static_cast<int>(cudaErrorInvalidValue);
  moe_route_kernel<<<(p.rows + route_rows_per_block - 1) / route_rows_per_block, 32 * route_rows_per_block, 0,
                     as_stream(stream)>>>(p);
  return last_error();
}

int launch_moe_plan(const moe_plan_params& p, void* stream) {
  if (p.experts == 0 || p.experts > moe_max_experts) return static_cast<int>(cudaErrorInvalidValue);
  moe_plan_kernel<<<1, plan_threads, 0, as_stream(stream)>>>(p);
  moe_slots_kernel<<<1, plan_threads, 0, as_stream(stream)>>>(p);
  return last_error();
}

bool grouped_gemm_on_tensor_cores(const grouped_gemm_params& p) {
  const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };  // 16-byte loads
  return p.tensor_cores && p.type == dtype::bf16 && p.k % 8 == 0 && p.a_stride % 8 == 0 && aligned(p.a) && aligned(p.w);
}

int launch_grouped_gemm(const grouped_gemm_params& p, void* stream) {
  if (p.max_tiles == 0 || p.n == 0) return 0;
  const dim3 grid{p.max_tiles, (p.n + gg_tn - 1) / gg_tn};
  if (grouped_gemm_on_tensor_cores(p))
    grouped_gemm_tc_kernel<<<grid, tc_threads, 0, as_stream(stream)>>>(p);
  else if (p.type == dtype::f32)
    grouped_gemm_kernel<float><<<grid, gg_threads, 0, as_stream(stream)>>>(p);
  else
    grouped_gemm_kernel<__nv_bfloat16><<<grid, gg_threads, 0, as_stream(stream)>>>(p);
  return last_error();
}

int launch_moe_combine(const moe_combine_params& p, void* stream) {
  if (p.rows == 0) return 0;
  moe_combine_kernel<<<p.rows, 256, 0, as_stream(stream)>>>(p);
  return last_error();
}

}  // namespace baton::gpu::cuda
