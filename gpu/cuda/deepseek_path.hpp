#pragma once

// DeepSeek's layers inside the CUDA executor (issue 14, part 3): multi-head latent attention over
// the latent KV and the mixture of experts, with the same math and the same order of routed
// experts as the CPU executor (gpu/cpu_executor.cpp). The executor owns the streams, the KV pool
// and the dense parts (norms, the o-projection's residual, the shared experts' weights); this
// class owns the MLA and MoE weights and scratch and enqueues their kernels on the executor's
// compute stream. Host code against the CUDA runtime: only the CUDA executor includes it.
//
// Everything stays on the device between a layer's kernels (routing, per-expert counts, the
// grouped products' tile list), so a decode step of a DeepSeek model is still one CUDA graph.

#include <functional>
#include <string>
#include <vector>

#include "gpu/cuda/deepseek_kernels.hpp"
#include "gpu/cuda/device_buffer.hpp"
#include "gpu/model_config.hpp"
#include "gpu/weights.hpp"

namespace baton::gpu::cuda {

/// What the layers borrow from their executor.
struct layer_services {
  /// y[m][n] (fp32) = beta·y + a[m][k] · w[n][k]ᵀ on the compute stream, a and w of the
  /// executor's type: its batch-invariant product. False once a failure is recorded.
  std::function<bool(const void* a, const void* w, float* y, uint32_t m, uint32_t n, uint32_t k, float beta)> gemm;
  /// Records a launcher's return code under `what` (the job's first failure); false on failure.
  std::function<bool(int rc, const char* what)> check;
  /// Uploads fp32 host tensors, concatenated, as one device tensor: of the executor's type when
  /// `matrix`, else fp32. Empty or why not.
  std::function<std::string(device_buffer& dst, const std::vector<const std::vector<float>*>& parts, bool matrix)> upload;
  void* stream = nullptr;       ///< the compute stream
  const float* inv_freq = nullptr;  ///< device, the RoPE table (qk_rope_head_dim / 2)
};

/// A job's per-row arrays, on the device, as the executor planned them.
struct row_args {
  uint32_t rows;
  const uint32_t* positions;
  const uint32_t* page_table;
  const uint32_t* row_pages;
  const uint64_t* kv_slot;
  uint32_t page_size_tokens;
  uint64_t page_elems;       ///< elements per page of a layer
  uint32_t splits;           ///< a long decode's position ranges per row (latent_attention_params)
  uint32_t split_positions;
  float* partial;            ///< splits > 1: [splits][rows][heads][kv_lora_rank + 2]
};

class deepseek_path {
public:
  deepseek_path(const model_config& cfg, dtype type, layer_services services);

  /// Empty when the kernels take this shape, else a sentence naming the field that they do not.
  static std::string supports(const model_config& cfg);

  /// Every MLA and MoE tensor of `w`; routers, their biases and norms stay fp32. Refuses weights
  /// missing a routed expert (an expert-parallel load keeps only its members').
  std::string upload(const model_weights& w);
  /// Benchmarks: every MLA and MoE tensor drawn on the device by `fill(buffer, elements, matrix,
  /// scale, offset)` (the executor's random_weights), scaled so activations stay O(1).
  void draw(const std::function<void(device_buffer&, uint64_t, bool, float, float)>& fill);
  /// The routed experts' products on the tensor cores where they can be (grouped_gemm_params).
  void set_tensor_cores(bool on) { tensor_cores_ = on; }
  /// Scratch for jobs of up to `rows` rows. Empty or why not.
  std::string reserve(uint32_t rows);

  /// MLA, first half: the query and the latent from `hn` (rows of hidden, the executor's type);
  /// the latent, normalised and rotated, into the rows' KV slots of `kv_layer`.
  void write_latent(uint32_t layer, const void* hn, const row_args& rows, void* kv_layer);
  /// MLA, second half: W_UK into the query, attention over the cached latents, W_UV, then the
  /// o-projection `wo` added into the residual x. `attn_out` holds rows · heads · v_head_dim
  /// values of the executor's type.
  void attend(uint32_t layer, const row_args& rows, const void* kv_layer, const void* wo, float* x, void* attn_out);

  /// The shared experts' weights of a MoE layer and the executor's buffers for them.
  struct shared_mlp {
    const void* gate_up;  ///< [2f][hidden] of the executor's type, or null when f == 0
    const void* down;     ///< [hidden][f]
    uint32_t f;           ///< their width (mlp_intermediate), 0: none
    float* gu;            ///< rows · 2f fp32 scratch
    void* act;            ///< rows · f of the executor's type
  };
  /// A MoE layer's MLP over `hn` (the normed residual, the executor's type; `x` and `mlp_norm`
  /// give the router its fp32 input): x += Σ weighted routed experts + the shared experts.
  void moe(uint32_t layer, uint32_t rows, float* x, const float* mlp_norm, const void* hn, const shared_mlp& shared);

private:
  struct layer {
    device_buffer wq_a, q_a_norm, wq_b, wq, wkv_a, kv_a_norm, w_uk_t, w_uv;  // MLA
    device_buffer router, router_bias, experts_gu, experts_down;             // MoE
  };

  model_config cfg_;
  dtype type_;
  layer_services s_;
  float rope_factor_, scale_;
  std::vector<layer> layers_;
  bool tensor_cores_ = false;
  // Scratch. MLA: the low-rank query and its normed copy, the query, the latent, the latent
  // query and output per head. MoE: the router's fp32 input and logits, the routing, the plan,
  // the routed experts' products, the shared experts' output.
  device_buffer qa_, qa_t_, q_, kva_, q_lat_, o_lat_;
  device_buffer hn32_, logits_, chosen_, weight_, slot_, slot_row_, offsets_, tile_expert_, tile_first_, num_tiles_;
  device_buffer gu2_, act2_, ye_, shared_out_;
};

}  // namespace baton::gpu::cuda
