#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "gpu/model_config.hpp"

namespace baton::gpu {

/// Which routed experts a load keeps, asked once per (MoE layer, expert) with the model's config:
/// an expert-parallel process loads or draws its own block and leaves the rest, so it never holds
/// the whole model (DeepSeek-V3's experts are 97% of its weights). Empty: every expert.
using expert_filter = std::function<bool(const model_config& cfg, uint32_t layer, uint32_t expert)>;

/// One decoder layer, fp32, every matrix row-major [out_features][in_features] (Hugging Face's
/// nn.Linear layout), so a checkpoint tensor can be copied in without transposing.
/// One SwiGLU MLP: a routed expert of a MoE layer.
struct expert_weights {
  std::vector<float> gate;  ///< [moe_intermediate][hidden]
  std::vector<float> up;    ///< [moe_intermediate][hidden]
  std::vector<float> down;  ///< [hidden][moe_intermediate]
};

struct layer_weights {
  std::vector<float> attn_norm;  ///< [hidden]
  std::vector<float> wq;         ///< [q_dim][hidden]; with MLA, q_proj when there is no q_lora_rank
  std::vector<float> wk;         ///< [kv_dim][hidden]; empty with MLA
  std::vector<float> wv;         ///< [kv_dim][hidden]; empty with MLA
  std::vector<float> wo;         ///< [hidden][attn_out_dim]
  std::vector<float> mlp_norm;   ///< [hidden]
  /// The always-on MLP, [mlp_intermediate(l)] wide: the dense MLP, or a MoE layer's shared experts
  /// (empty when it has none).
  std::vector<float> w_gate;     ///< [mlp_intermediate][hidden]
  std::vector<float> w_up;       ///< [mlp_intermediate][hidden]
  std::vector<float> w_down;     ///< [hidden][mlp_intermediate]
  std::vector<float> bq, bk, bv;  ///< [q_dim], [kv_dim], [kv_dim]: empty unless attention_bias
  std::vector<float> q_norm, k_norm;  ///< [head_dim]: empty unless qk_norm

  // Multi-head latent attention (model_config::mla); empty otherwise.
  std::vector<float> wq_a;       ///< [q_lora_rank][hidden]: empty without q_lora_rank
  std::vector<float> q_a_norm;   ///< [q_lora_rank]
  std::vector<float> wq_b;       ///< [q_dim][q_lora_rank]
  std::vector<float> wkv_a;      ///< [kv_lora_rank + qk_rope_head_dim][hidden]
  std::vector<float> kv_a_norm;  ///< [kv_lora_rank]
  std::vector<float> wkv_b;      ///< [heads * (qk_nope_head_dim + v_head_dim)][kv_lora_rank], as stored
  /// Absorbed forms of wkv_b (finish_mla_weights): decode attends over the latent directly,
  /// never expanding cached tokens into per-head K and V.
  std::vector<float> w_uk_t;     ///< [heads][kv_lora_rank][qk_nope_head_dim]: q_nope -> latent query
  std::vector<float> w_uv;       ///< [heads][v_head_dim][kv_lora_rank]: latent output -> value head

  // Mixture of experts (model_config::is_moe_layer); empty on dense layers.
  std::vector<float> router;       ///< [n_routed_experts][hidden]
  std::vector<float> router_bias;  ///< [n_routed_experts]: V3's score correction bias (noaux_tc)
  std::vector<expert_weights> experts;
};

struct model_weights {
  std::vector<float> embed;       ///< [vocab][hidden]
  std::vector<layer_weights> layers;
  std::vector<float> final_norm;  ///< [hidden]
  std::vector<float> lm_head;     ///< [vocab][hidden]; empty when tied to `embed`

  const float* lm_head_data() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};

/// Deterministic weights for the built-in model: the same seed gives the same bits on every
/// machine (own generator, no std:: distributions, whose output is implementation-defined).
/// Scales keep activations O(1) through many layers, so different prompts continue differently.
/// Routed experts `keep` refuses are left empty, and drawing them costs nothing (the generator
/// skips ahead): the kept ones are the whole draw's, bit for bit.
model_weights make_seeded_weights(const model_config& cfg, uint64_t seed, const expert_filter& keep = {});

/// Derives the absorbed MLA matrices (w_uk_t, w_uv) of every layer from its wkv_b. Loaders and
/// make_seeded_weights call it once; without MLA it does nothing.
void finish_mla_weights(const model_config& cfg, model_weights& w);

/// The weights themselves: moved out when `w` is their only owner, else copied. Moving is sound
/// where every model_weights is created non-const (by a loader or from the seed) and only later
/// shared as const, as in `baton node`, which hands the routed experts to data-parallel members.
inline model_weights take_or_copy(std::shared_ptr<const model_weights> w) {
  if (w.use_count() == 1) return std::move(*std::const_pointer_cast<model_weights>(w));
  return *w;
}

}  // namespace baton::gpu
