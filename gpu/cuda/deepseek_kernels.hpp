#pragma once

// The C-like GPU boundary of DeepSeek's layers (issue 14, part 3): multi-head latent attention
// and the mixture of experts, in the style of gpu/cuda/kernels.hpp (flat parameter structs,
// units per field, `launch_<kernel>(params, stream)`, 0 or the cudaError_t of the launch). No
// CUDA headers here. CPU references: latent_attention_ref, rope_apply_interleaved and rmsnorm in
// gpu/cpu_kernels.hpp, moe_route in gpu/moe_routing.hpp, matmul_nt for the products; conformance
// cases in tests/gpu/cuda_deepseek.test.cpp.
//
// Nothing here waits for the host: a MoE layer's routing, its per-expert row counts and the tile
// list of its grouped products stay on the device, so a decode step remains one CUDA graph.

#include <cstdint>

#include "gpu/cuda/kernels.hpp"

namespace baton::gpu::cuda {

/// After the latent projection (kv_a_proj_with_mqa) and the query's: the compressed KV
/// RMS-normalised, the shared key's RoPE part rotated, both written into the row's KV slot as the
/// layer's one plane (the latent); and every head's RoPE query part rotated into the tail of that
/// head's latent query (the absorbed no-RoPE head is written by launch_head_gemv). Rotation:
/// adjacent pairs (2i, 2i + 1) when `interleave`, else halves; then times rope_factor (YaRN).
struct mla_finish_params {
  float* kva;                 ///< device, [rows][lora + rope] fp32, normalised and rotated in place
  const float* kv_a_norm;     ///< device, [lora] fp32
  const float* q;             ///< device, [rows][heads · (nope + rope)] fp32 (the query projection)
  float* q_lat;               ///< device, [rows][heads][lora + rope] fp32: this kernel writes each head's [lora, lora + rope)
  const float* inv_freq;      ///< device, [rope / 2]
  const uint32_t* positions;  ///< device, [rows]
  const uint64_t* kv_slot;    ///< device, [rows] element offset of the row's latent in the layer
  void* kv_layer;             ///< device, this layer's KV base, `type` elements
  uint32_t rows, heads;
  uint32_t lora;              ///< kv_lora_rank
  uint32_t nope, rope;        ///< qk_nope_head_dim, qk_rope_head_dim
  float eps;                  ///< of kv_a_layernorm (1e-6 in DeepSeek's checkpoints)
  float rope_factor;          ///< YaRN's attention factor on rotated values; 1 otherwise
  bool interleave;
  dtype type;
};
int launch_mla_finish(const mla_finish_params& p, void* stream);

/// A product per head for a few rows at a time: y[r][h][j] = Σ_i w[h][j][i] · x[r][h][i],
/// j < out_dim, i < in_dim, the x rows of a block staged in shared memory so each weight row is
/// read once per tile of rows. Absorbs W_UK into the query (x = q_nope, w = w_uk_t, y = the
/// latent query) and applies W_UV after attention (x = the latent output, w = w_uv, y = the
/// o-projection's input); with heads = 1 it is also the fp32 router product.
struct head_gemv_params {
  const float* x;           ///< device, fp32
  uint64_t x_row_stride;    ///< floats between rows of x
  uint32_t x_head_stride;   ///< floats between heads of one row
  const void* w;            ///< device, [heads][out_dim][in_dim] of w_type
  dtype w_type;
  void* y;                  ///< device, of y_type
  uint64_t y_row_stride;    ///< elements between rows of y
  uint32_t y_head_stride;   ///< elements between heads of one row
  dtype y_type;
  uint32_t rows, heads, in_dim, out_dim;
};
/// The largest in_dim (its fp32 x rows are staged in shared memory).
constexpr uint32_t head_gemv_max_in = 8192;
int launch_head_gemv(const head_gemv_params& p, void* stream);

/// Attention of every head of a row over the row's own sequence's latents, positions [0, pos]:
/// scores are the latent query (lora + rope values) against each cached latent times `scale`,
/// the output the softmax-weighted sum of the latents' first `lora` values (before W_UV).
/// Heads of a row are taken mla_heads_per_block at a time, so the weighted sum reads each cached
/// latent once per block, not once per head (the scores still read it per head, from cache). A row's result does not depend on its batch.
/// Long decodes split their positions (splits > 1): block z takes positions [z·split_positions,
/// (z + 1)·split_positions) and leaves a partial softmax that a second kernel merges in z order.
/// The ranges depend on positions alone, and a row within the first range gets the bits it gets
/// unsplit.
struct latent_attention_params {
  const float* q_lat;          ///< device, [rows][heads][lora + rope] fp32
  const void* kv_layer;        ///< device, this layer's KV base, `type` elements (one plane)
  const uint32_t* positions;   ///< device, [rows]
  const uint32_t* page_table;  ///< device, flat page ids of all sequences
  const uint32_t* row_pages;   ///< device, [rows] offset of the row's sequence in page_table
  float* out;                  ///< device, [rows][heads][lora] fp32
  uint32_t rows, heads;
  uint32_t lora, rope;
  uint32_t page_size_tokens;
  uint64_t page_elems;         ///< elements per page (page_size_tokens · (lora + rope))
  float scale;                 ///< the softmax scale (attention_softmax_scale)
  dtype type;
  uint32_t splits = 1;            ///< position ranges per row (1: none)
  uint32_t split_positions = 0;   ///< positions per range, a multiple of 32 (splits > 1)
  float* partial = nullptr;       ///< device, splits > 1: [splits][rows][heads][lora + 2] scratch
};
constexpr uint32_t mla_heads_per_block = 8;
constexpr uint32_t mla_max_lora = 1024;    ///< kv_lora_rank at most this (4 output values per thread)
constexpr uint32_t mla_max_latent = 1408;  ///< lora + rope at most this (8 heads' queries in 48 KiB of shared memory)
int launch_latent_attention(const latent_attention_params& p, void* stream);

/// DeepSeek's routing (moe_route, one warp per row, the same steps in the same order): scores
/// from the router logits (softmax or sigmoid), the method's group limit, top-k with ties to the
/// lower id, experts written in ascending order with their weights.
struct moe_route_params {
  const float* logits;  ///< device, [rows][experts] fp32
  const float* bias;    ///< device, [experts] V3's correction bias, or null
  uint32_t* chosen;     ///< device, [rows][top_k] expert ids, ascending
  float* weight;        ///< device, [rows][top_k]
  uint32_t rows, experts, top_k;
  uint32_t n_group, topk_group;
  bool sigmoid;         ///< scoring "sigmoid" (V3), else "softmax"
  uint32_t method;      ///< 0 greedy, 1 group_limited_greedy (V2), 2 noaux_tc (V3)
  bool norm_topk_prob;
  float routed_scaling_factor;
};
constexpr uint32_t moe_max_experts = 512;
int launch_moe_route(const moe_route_params& p, void* stream);

/// The grouped products' plan, on the device: the rows·top_k (row, expert) pairs sorted by
/// expert (within an expert by row, so the order is the CPU executor's and does not depend on
/// scheduling), and the list of tiles of moe_tile_rows sorted rows of one expert that the
/// grouped product's blocks take.
struct moe_plan_params {
  const uint32_t* chosen;  ///< device, [rows][top_k]
  uint32_t rows, top_k, experts;
  uint32_t* slot;          ///< device, [rows][top_k]: where each pair sits in the sorted order
  uint32_t* slot_row;      ///< device, [rows · top_k]: the row of each sorted pair
  uint32_t* offsets;       ///< device, [experts + 1]: expert e's pairs are [offsets[e], offsets[e + 1])
  uint32_t* tile_expert;   ///< device, [moe_max_tiles(rows · top_k, experts)]
  uint32_t* tile_first;    ///< device, same size: the tile's first sorted pair
  uint32_t* num_tiles;     ///< device, one value
};
constexpr uint32_t moe_tile_rows = 64;
constexpr uint32_t moe_max_tiles(uint32_t pairs, uint32_t experts) {
  return (pairs + moe_tile_rows - 1) / moe_tile_rows + experts;
}
int launch_moe_plan(const moe_plan_params& p, void* stream);

/// y[s][n] (fp32) = Σ_k a[row(s)][k] · w[e(s)][n][k] for every sorted pair s, each tile of the
/// plan in one block; row(s) = a_rows[s] (null: s itself). Each output sums over k in one fixed
/// order, so a row's result does not depend on how many rows share its expert.
struct grouped_gemm_params {
  const void* a;               ///< device, rows of k values, `type`
  uint64_t a_stride;           ///< elements between rows of a
  const uint32_t* a_rows;      ///< device, [pairs] which row of a each sorted pair reads, or null
  const void* w;               ///< device, [experts][n][k] of `type`
  float* y;                    ///< device, [pairs][n] fp32
  const uint32_t* offsets;     ///< device, [experts + 1] (moe_plan)
  const uint32_t* tile_expert; ///< device (moe_plan)
  const uint32_t* tile_first;  ///< device (moe_plan)
  const uint32_t* num_tiles;   ///< device, one value (moe_plan)
  uint32_t max_tiles;          ///< moe_max_tiles(pairs, experts): the grid's size
  uint32_t n, k;
  dtype type;
  /// bf16 with k and a_stride multiples of 8: every tile on the tensor cores (mma.sync m16n8k16,
  /// fp32 accumulation; each row's products independent of the tile's other rows, so still
  /// batch-invariant). Otherwise, or false: CUDA cores. Written without a GPU: off by default
  /// (cuda_executor_config::moe_tensor_cores) until its conformance cases pass.
  bool tensor_cores = false;
};
/// Whether launch_grouped_gemm takes the tensor-core path for these parameters.
bool grouped_gemm_on_tensor_cores(const grouped_gemm_params& p);
int launch_grouped_gemm(const grouped_gemm_params& p, void* stream);

/// x[r] += (Σ_j weight[r][j] · y[slot[r][j]]) + shared[r], j ascending (the experts' order),
/// the sum formed first and added once, as the CPU executor adds its MoE output to the residual.
struct moe_combine_params {
  float* x;               ///< device, [rows][hidden] fp32 residual
  const float* y;         ///< device, [pairs][hidden] fp32 expert outputs in sorted order
  const uint32_t* slot;   ///< device, [rows][top_k] (moe_plan)
  const float* weight;    ///< device, [rows][top_k] (moe_route)
  const float* shared;    ///< device, [rows][hidden] fp32 shared experts' output, or null
  uint32_t rows, top_k, hidden;
};
int launch_moe_combine(const moe_combine_params& p, void* stream);

}  // namespace baton::gpu::cuda
