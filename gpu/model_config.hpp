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
  /// RoPE scaling: "llama3" (Llama 3.1) or "yarn" (DeepSeek-V2/V3, Qwen); empty type = none.
  struct rope_scaling_t {
    std::string type;
    float factor = 1.0f;
    float low_freq_factor = 1.0f;   ///< llama3
    float high_freq_factor = 4.0f;  ///< llama3
    uint32_t original_max_position_embeddings = 8192;
    float beta_fast = 32.0f;      ///< yarn: rotations above which dimensions keep their frequency
    float beta_slow = 1.0f;       ///< yarn: rotations below which dimensions are interpolated
    float mscale = 0.0f;          ///< yarn: 0 = absent
    float mscale_all_dim = 0.0f;  ///< yarn: 0 = absent; DeepSeek also scales softmax by its mscale squared
    float attention_factor = 0.0f;  ///< yarn: 0 = derived from factor and the mscales
    bool truncate = true;           ///< yarn: correction range rounded to whole dimensions
  } rope_scaling;

  /// DeepSeek-V2/V3 multi-head latent attention (seed 000 §1.3). kv_lora_rank == 0: not MLA.
  /// With MLA, head_dim is qk_rope_head_dim (as Hugging Face sets it) and the KV cache holds one
  /// latent per token per layer: the normalised compressed KV (kv_lora_rank values) followed by
  /// the rotated shared key (qk_rope_head_dim values) — 576 values for V3, never expanded K/V.
  struct mla_t {
    uint32_t q_lora_rank = 0;  ///< 0: q_proj straight from the hidden state (V2-Lite)
    uint32_t kv_lora_rank = 0;
    uint32_t qk_nope_head_dim = 0;
    uint32_t qk_rope_head_dim = 0;
    uint32_t v_head_dim = 0;
    bool rope_interleave = true;  ///< rotary pairs are (2i, 2i+1), as DeepSeek's weights expect
  } mla;
  /// DeepSeek mixture of experts. n_routed_experts == 0: every layer is a dense MLP.
  struct moe_t {
    uint32_t n_routed_experts = 0;
    uint32_t n_shared_experts = 0;     ///< one always-on MLP of moe_intermediate_size x this
    uint32_t num_experts_per_tok = 0;  ///< top-k
    uint32_t moe_intermediate_size = 0;
    uint32_t first_k_dense_replace = 0;  ///< layers below this are dense (intermediate_size)
    uint32_t n_group = 1;                ///< expert groups for group-limited routing
    uint32_t topk_group = 1;             ///< groups a token may use
    /// "softmax" (V2) or "sigmoid" (V3): how router logits become scores.
    std::string scoring = "softmax";
    /// "greedy": top-k scores; "group_limited_greedy" (V2): groups ranked by their best score;
    /// "noaux_tc" (V3): scores plus the correction bias choose, groups ranked by their top-2 sum.
    std::string topk_method = "greedy";
    bool norm_topk_prob = false;  ///< V3: the chosen weights are renormalised to sum to 1
    float routed_scaling_factor = 1.0f;
  } moe;

  static constexpr uint32_t max_expert_groups = 64;

  bool is_mla() const { return mla.kv_lora_rank > 0; }
  bool is_moe_layer(uint32_t layer) const {
    return moe.n_routed_experts > 0 && layer >= moe.first_k_dense_replace;
  }
  /// Width of the always-on MLP of `layer`: the dense MLP, or a MoE layer's shared experts (0: none).
  uint32_t mlp_intermediate(uint32_t layer) const {
    return is_moe_layer(layer) ? moe.moe_intermediate_size * moe.n_shared_experts : intermediate_size;
  }
  /// Query width per head: nope + rope parts with MLA, else head_dim.
  uint32_t qk_head_dim() const { return is_mla() ? mla.qk_nope_head_dim + mla.qk_rope_head_dim : head_dim; }
  uint32_t q_dim() const { return num_attention_heads * qk_head_dim(); }
  /// Attention output width (the o_proj input).
  uint32_t attn_out_dim() const { return num_attention_heads * (is_mla() ? mla.v_head_dim : head_dim); }
  /// Values per token in one plane of the KV cache: K (and V) of every KV head, or MLA's latent.
  uint32_t kv_dim() const { return is_mla() ? mla.kv_lora_rank + mla.qk_rope_head_dim : num_key_value_heads * head_dim; }
  /// Planes per KV page: 2 (K and V) or 1 (the MLA latent, which serves as both).
  uint32_t kv_planes() const { return is_mla() ? 1 : 2; }
  /// KV values cached per token per layer (all planes).
  uint32_t kv_values_per_token() const { return kv_planes() * kv_dim(); }
  /// Parameters, counting a tied LM head once, and every expert.
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
/// A tiny DeepSeek shape with MLA and MoE on the built-in byte vocabulary, for tests and
/// `baton local --model deepseek-v2-tiny|deepseek-v3-tiny`: V3 routing (sigmoid scores, group-limited
/// top-k with a correction bias) when `v3`, else V2's (softmax, greedy).
model_config deepseek_tiny_config(bool v3);
/// The DeepSeek-V3 shape (61 layers, hidden 7168, 128 heads, latent 512 + 64, 256 routed experts):
/// benchmarks and sims with modelled or random weights.
model_config deepseek_v3_config();
/// A Llama-3-70B-like GQA shape (80 layers, 64 query heads, 8 KV heads of 128).
model_config llama3_70b_config();

}  // namespace baton::gpu
