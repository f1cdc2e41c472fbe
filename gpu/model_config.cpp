#include "gpu/model_config.hpp"

namespace baton::gpu {

uint64_t model_config::num_parameters() const {
  const uint64_t h = hidden_size;
  const uint64_t per_layer = h * q_dim() + 2 * h * kv_dim() + q_dim() * h  // attention
                             + 3 * h * intermediate_size                    // SwiGLU MLP
                             + 2 * h;                                       // two RMSNorms
  const uint64_t embed = uint64_t{vocab_size} * h;
  return embed * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + h;
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
  if (max_position_embeddings < 2) return "max_position_embeddings must be >= 2";
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

}  // namespace baton::gpu
