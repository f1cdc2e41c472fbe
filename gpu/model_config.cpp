#include "gpu/model_config.hpp"

#include <cmath>

namespace baton::gpu {

namespace {

/// Parameters of every layer, every routed expert included.
uint64_t layer_parameters(const model_config& c) {
  const uint64_t h = c.hidden_size;
  uint64_t attention = 0;
  if (c.is_mla()) {
    const auto& m = c.mla;
    const uint64_t q = c.q_dim();
    attention = (m.q_lora_rank ? h * m.q_lora_rank + m.q_lora_rank + uint64_t{m.q_lora_rank} * q : h * q) +
                h * c.kv_dim() + m.kv_lora_rank +
                uint64_t{m.kv_lora_rank} * c.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim) +
                uint64_t{c.attn_out_dim()} * h;
  } else {
    attention = h * c.q_dim() + 2 * h * c.kv_dim() + uint64_t{c.q_dim()} * h;
  }
  uint64_t total = 0;
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    total += attention + 2 * h + 3 * h * c.mlp_intermediate(l);  // two RMSNorms, always-on MLP
    if (c.is_moe_layer(l))
      total += uint64_t{c.moe.n_routed_experts} * (h + 3 * h * c.moe.moe_intermediate_size);  // router + experts
  }
  return total;
}

}  // namespace

uint64_t model_config::num_parameters() const {
  const uint64_t embed = uint64_t{vocab_size} * hidden_size;
  return embed * (tie_word_embeddings ? 1 : 2) + layer_parameters(*this) + hidden_size;
}

std::string model_config::validate() const {
  if (vocab_size == 0) return "vocab_size must be > 0";
  if (hidden_size == 0 || num_hidden_layers == 0 || intermediate_size == 0)
    return "hidden_size, intermediate_size and num_hidden_layers must be > 0";
  if (num_attention_heads == 0 || num_key_value_heads == 0 || head_dim == 0)
    return "num_attention_heads, num_key_value_heads and head_dim must be > 0";
  if (num_attention_heads % num_key_value_heads != 0)
    return "num_attention_heads (" + std::to_string(num_attention_heads) +
           ") must be a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) + ")";
  if (head_dim % 2 != 0) return "head_dim must be even for rotary embeddings";
  // Bounds far above any real model: the widths below are uint32 products, and a config.json
  // typo that overflowed them would size buffers smaller than the loops that fill them.
  constexpr uint64_t max_width = uint64_t{1} << 24;
  const struct { const char* name; uint64_t value; uint64_t limit; } bounds[] = {
      {"vocab_size", vocab_size, max_width},
      {"hidden_size", hidden_size, max_width},
      {"intermediate_size", intermediate_size, max_width},
      {"num_hidden_layers", num_hidden_layers, 4096},
      {"num_attention_heads", num_attention_heads, 65536},
      {"head_dim", head_dim, 65536},
      {"kv_lora_rank", mla.kv_lora_rank, 65536},
      {"q_lora_rank", mla.q_lora_rank, 65536},
      {"qk_nope_head_dim", mla.qk_nope_head_dim, 65536},
      {"qk_rope_head_dim", mla.qk_rope_head_dim, 65536},
      {"v_head_dim", mla.v_head_dim, 65536},
      {"n_routed_experts", moe.n_routed_experts, 65536},
      {"n_shared_experts", moe.n_shared_experts, 65536},
      {"moe_intermediate_size", moe.moe_intermediate_size, max_width},
      {"num_attention_heads x query head width",
       uint64_t{num_attention_heads} * (is_mla() ? uint64_t{mla.qk_nope_head_dim} + mla.qk_rope_head_dim : head_dim),
       max_width},
      {"num_attention_heads x value head width", uint64_t{num_attention_heads} * (is_mla() ? mla.v_head_dim : head_dim),
       max_width},
      {"the KV width per token", is_mla() ? uint64_t{mla.kv_lora_rank} + mla.qk_rope_head_dim
                                          : uint64_t{num_key_value_heads} * head_dim, max_width},
      {"moe_intermediate_size x n_shared_experts", uint64_t{moe.moe_intermediate_size} * moe.n_shared_experts,
       max_width},
  };
  for (const auto& b : bounds)
    if (b.value > b.limit)
      return std::string{b.name} + " is " + std::to_string(b.value) + ", more than the most Baton supports (" +
             std::to_string(b.limit) + ")";
  if (is_mla()) {
    if (mla.qk_rope_head_dim != head_dim) return "with MLA, head_dim must equal qk_rope_head_dim";
    if (mla.qk_nope_head_dim == 0 || mla.v_head_dim == 0)
      return "MLA needs qk_nope_head_dim and v_head_dim > 0";
  }
  if (moe.n_routed_experts > 0) {
    const auto& m = moe;
    if (m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.n_routed_experts)
      return "num_experts_per_tok must be in [1, n_routed_experts (" + std::to_string(m.n_routed_experts) + ")]";
    if (m.moe_intermediate_size == 0) return "moe_intermediate_size must be > 0";
    if (!std::isfinite(m.routed_scaling_factor) || m.routed_scaling_factor <= 0.0f || m.routed_scaling_factor > 1000.0f)
      return "routed_scaling_factor must be in (0, 1000], got " + std::to_string(m.routed_scaling_factor);
    if (m.scoring != "softmax" && m.scoring != "sigmoid")
      return "MoE scoring must be softmax or sigmoid, not " + m.scoring;
    if (m.topk_method != "greedy" && m.topk_method != "group_limited_greedy" && m.topk_method != "noaux_tc")
      return "topk_method must be greedy, group_limited_greedy or noaux_tc, not " + m.topk_method;
    if (m.topk_method != "greedy") {
      if (m.n_group == 0 || m.n_group > max_expert_groups || m.n_routed_experts % m.n_group != 0)
        return "n_group (" + std::to_string(m.n_group) + ") must divide n_routed_experts (" +
               std::to_string(m.n_routed_experts) + ") and be at most " + std::to_string(max_expert_groups);
      if (m.topk_group == 0 || m.topk_group > m.n_group) return "topk_group must be in [1, n_group]";
      if (uint64_t{m.topk_group} * (m.n_routed_experts / m.n_group) < m.num_experts_per_tok)
        return "topk_group groups hold fewer experts than num_experts_per_tok";
      if (m.topk_method == "noaux_tc" && m.n_routed_experts / m.n_group < 2)
        return "noaux_tc ranks groups by their top two experts: each group needs at least 2";
    }
  }
  if (max_position_embeddings < 2) return "max_position_embeddings must be >= 2";
  // Values that would make every logit NaN or garbage without an error (a config.json typo).
  auto positive = [](float x) { return std::isfinite(x) && x > 0.0f; };
  if (!positive(rms_norm_eps)) return "rms_norm_eps must be a finite number > 0, got " + std::to_string(rms_norm_eps);
  if (!positive(rope_theta)) return "rope_theta must be a finite number > 0, got " + std::to_string(rope_theta);
  if (!rope_scaling.type.empty()) {
    const auto& r = rope_scaling;
    if (!positive(r.factor)) return "rope_scaling factor must be a finite number > 0, got " + std::to_string(r.factor);
    if (r.type == "llama3" && (!positive(r.low_freq_factor) || !positive(r.high_freq_factor) ||
                               r.high_freq_factor <= r.low_freq_factor || r.original_max_position_embeddings == 0))
      return "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0";
    if (r.type == "yarn" && (!positive(r.beta_fast) || !positive(r.beta_slow) || r.original_max_position_embeddings == 0))
      return "yarn rope_scaling needs beta_fast, beta_slow and original_max_position_embeddings > 0";
    // 0: not given (derived from factor). Scales of attention's logits past 1000 only overflow.
    auto scale = [](float x) { return std::isfinite(x) && x >= 0.0f && x <= 1000.0f; };
    if (r.type == "yarn" && (!scale(r.attention_factor) || !scale(r.mscale) || !scale(r.mscale_all_dim)))
      return "yarn rope_scaling's attention_factor, mscale and mscale_all_dim must be in [0, 1000], got " +
             std::to_string(r.attention_factor) + ", " + std::to_string(r.mscale) + " and " +
             std::to_string(r.mscale_all_dim);
  }
  if (bos_token_id >= static_cast<int32_t>(vocab_size) || eos_token_id >= static_cast<int32_t>(vocab_size))
    return "bos_token_id and eos_token_id must be < vocab_size";
  return {};
}

model_config builtin_tiny_config() { return model_config{}; }

model_config llama_100m_config() {
  model_config c;
  c.name = "llama-100m-shape";
  c.vocab_size = 32000;
  c.hidden_size = 768;
  c.intermediate_size = 2048;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  return c;
}

model_config llama3_8b_config(uint32_t max_position_embeddings) {
  model_config c;
  c.name = "llama-3-8b-shape";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = max_position_embeddings;
  c.rope_theta = 500000.0f;
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  return c;
}

model_config deepseek_tiny_config(bool v3) {
  model_config c;  // the built-in byte vocabulary and special tokens
  c.name = v3 ? "deepseek-v3-tiny" : "deepseek-v2-tiny";
  c.architecture = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.rms_norm_eps = 1e-6f;
  c.mla = {v3 ? 48u : 0u, 64, 32, 16, 32, true};
  c.head_dim = c.mla.qk_rope_head_dim;
  c.moe.n_routed_experts = 8;
  c.moe.n_shared_experts = 1;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 64;
  c.moe.first_k_dense_replace = 1;
  if (v3) {
    c.moe.scoring = "sigmoid";
    c.moe.topk_method = "noaux_tc";
    c.moe.n_group = 4;
    c.moe.topk_group = 2;
    c.moe.norm_topk_prob = true;
    c.moe.routed_scaling_factor = 2.5f;
  }
  return c;
}

model_config deepseek_v3_config() {
  model_config c;
  c.name = "deepseek-v3-shape";
  c.architecture = "DeepseekV3ForCausalLM";
  c.vocab_size = 129280;
  c.hidden_size = 7168;
  c.intermediate_size = 18432;
  c.num_hidden_layers = 61;
  c.num_attention_heads = 128;
  c.num_key_value_heads = 128;
  c.max_position_embeddings = 163840;
  c.rms_norm_eps = 1e-6f;
  c.mla = {1536, 512, 128, 64, 128, true};
  c.head_dim = 64;
  c.moe = {256, 1, 8, 2048, 3, 8, 4, "sigmoid", "noaux_tc", true, 2.5f};
  c.bos_token_id = 0;
  c.eos_token_id = 1;
  return c;
}

model_config llama3_70b_config() {
  model_config c = llama3_8b_config(131072);
  c.name = "llama-3-70b-shape";
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_hidden_layers = 80;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 8;
  return c;
}

}  // namespace baton::gpu
