#pragma once

#include <cstdint>
#include <vector>

#include "gpu/model_config.hpp"

namespace baton::gpu {

/// One decoder layer, fp32, every matrix row-major [out_features][in_features] (Hugging Face's
/// nn.Linear layout), so a checkpoint tensor can be copied in without transposing.
struct layer_weights {
  std::vector<float> attn_norm;  ///< [hidden]
  std::vector<float> wq;         ///< [q_dim][hidden]
  std::vector<float> wk;         ///< [kv_dim][hidden]
  std::vector<float> wv;         ///< [kv_dim][hidden]
  std::vector<float> wo;         ///< [hidden][q_dim]
  std::vector<float> mlp_norm;   ///< [hidden]
  std::vector<float> w_gate;     ///< [intermediate][hidden]
  std::vector<float> w_up;       ///< [intermediate][hidden]
  std::vector<float> w_down;     ///< [hidden][intermediate]
  std::vector<float> bq, bk, bv;  ///< [q_dim], [kv_dim], [kv_dim]: empty unless attention_bias
  std::vector<float> q_norm, k_norm;  ///< [head_dim]: empty unless qk_norm
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
model_weights make_seeded_weights(const model_config& cfg, uint64_t seed);

}  // namespace baton::gpu
