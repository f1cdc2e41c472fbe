#pragma once

#include <cstdint>
#include <string>

namespace baton::gpu {

/// Shape of a Llama-architecture decoder. Field names follow Hugging Face's config.json so that
/// loading real checkpoints (CPU model issue) fills the same struct.
struct model_config {
  std::string name = "baton-tiny";   ///< model identity: salts store keys, shown in logs
  uint32_t vocab_size = 259;         ///< 256 bytes + <bos> + <eos> + <pad>
  uint32_t hidden_size = 256;
  uint32_t intermediate_size = 512;
  uint32_t num_hidden_layers = 4;
  uint32_t num_attention_heads = 4;
  uint32_t num_key_value_heads = 2;  ///< GQA: each KV head serves num_attention_heads / this
  uint32_t head_dim = 64;
  uint32_t max_position_embeddings = 2048;  ///< context limit in tokens (prompt + output)
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  bool tie_word_embeddings = false;  ///< the built-in model has its own LM head
  int32_t bos_token_id = 256;
  int32_t eos_token_id = 257;
  // Family features (Hugging Face config.json): all off for the built-in model.
  std::string architecture = "LlamaForCausalLM";
  bool attention_bias = false;  ///< Qwen2: the q, k and v projections add a bias
  bool qk_norm = false;         ///< Qwen3: RMSNorm over each head of q and k, before RoPE
  /// Llama 3 RoPE scaling ("rope_type": "llama3"); empty type = none.
  struct rope_scaling_t {
    std::string type;
    float factor = 1.0f;
    float low_freq_factor = 1.0f;
    float high_freq_factor = 4.0f;
    uint32_t original_max_position_embeddings = 8192;
  } rope_scaling;

  uint32_t q_dim() const { return num_attention_heads * head_dim; }
  uint32_t kv_dim() const { return num_key_value_heads * head_dim; }
  /// Parameters, counting a tied LM head once.
  uint64_t num_parameters() const;
  /// Empty when the shape is usable, else a sentence naming the first bad field.
  std::string validate() const;
};

/// The built-in model's shape: tiny, so `baton local` answers in milliseconds on a laptop core.
model_config builtin_tiny_config();
/// A ~100M-parameter Llama shape used by the benchmarks.
model_config llama_100m_config();
/// The Llama-3-8B shape (GQA 32/8, vocab 128,256) for GPU benchmarks with random weights.
model_config llama3_8b_config(uint32_t max_position_embeddings = 8192);

}  // namespace baton::gpu
