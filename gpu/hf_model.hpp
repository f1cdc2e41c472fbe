#pragma once

// Loading a Hugging Face model directory: config.json (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V2/V3),
// *.safetensors (single or sharded; bf16, fp16, fp32; converted to fp32 once, at load), and
// generation_config.json defaults. Each malformed input is refused with a sentence naming the file,
// the field or tensor, and what is wrong.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu/model_config.hpp"
#include "gpu/weights.hpp"

namespace baton::gpu {

/// generation_config.json: the model's sampling defaults (absent fields keep these values).
struct generation_defaults {
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint32_t top_k = 0;
  float repetition_penalty = 1.0f;  ///< applied sampling or not (a logits processor, as HF's and vLLM's)
  bool do_sample = false;
  uint32_t max_new_tokens = 0;  ///< 0: not given (then the server's default cap holds)
  std::vector<int32_t> eos_token_ids;
  bool present = false;  ///< the directory has a generation_config.json
};

struct hf_model {
  model_config config;
  std::shared_ptr<const model_weights> weights;
  generation_defaults generation;
  /// config.json and the weights' fingerprint (safetensors_set::fingerprint), 16 hex digits: what
  /// the block store keys KV by, since two checkpoints often share a name (`_name_or_path`).
  std::string weights_id;
};

/// Parses config.json text into `out`; false and a sentence on failure. `source` names the file.
bool parse_hf_config(const std::string& json_text, const std::string& source, model_config* out, std::string* why);

/// Loads config.json, the weights and generation_config.json from `dir`. Routed experts `keep`
/// refuses are left empty (their tensors must still be present with the right shapes, so a
/// broken file is refused whichever process reads it).
bool load_hf_model(const std::string& dir, hf_model* out, std::string* why, const expert_filter& keep = {});

/// RoPE inverse frequencies for every pair of a head (head_dim / 2), with the config's scaling.
std::vector<float> rope_inv_freq(const model_config& cfg);
/// YaRN's attention factor: rotated q and k are scaled by it (transformers scales cos and sin).
/// 1 for every other kind of RoPE.
float rope_attention_factor(const model_config& cfg);
/// The attention softmax scale: 1/sqrt(qk_head_dim), times DeepSeek's mscale(factor,
/// mscale_all_dim) squared under YaRN (as DeepSeek's own code, vLLM and SGLang compute it;
/// transformers' DeepSeek-V2 class leaves the square out).
float attention_softmax_scale(const model_config& cfg);

}  // namespace baton::gpu
