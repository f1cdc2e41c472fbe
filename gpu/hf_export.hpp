#pragma once

// Writing a model as a Hugging Face directory, the layout load_hf_model reads: config.json,
// model.safetensors and, for the built-in byte vocabulary, a byte-level tokenizer.json (with
// tokenizer_config.json) that encodes prompts exactly as the built-in byte tokenizer does. It
// turns the seeded built-in models into files: `baton export-model` writes them so that a model
// directory's path (loading, expert-filtered loading in expert-parallel nodes) can be run without
// a download, and the loader's tests write their models with it.

#include <string>
#include <vector>

#include "gpu/model_config.hpp"
#include "gpu/safetensors.hpp"
#include "gpu/weights.hpp"

namespace baton::gpu {

struct hf_export_options {
  /// f32 keeps the weights bit for bit (what `--model DIR` then serves equals the built-in model);
  /// bf16 and f16 round them, as real checkpoints are stored.
  st_dtype dtype = st_dtype::f32;
  /// DeepSeek's routed experts fused into mlp.experts.gate_up_proj and down_proj (transformers 5's
  /// in-memory layout) instead of one tensor per expert (the Hub's).
  bool fused_experts = false;
};

/// config.json text for `c`: the Llama-like families (Llama, Mistral, Qwen2, Qwen3, by
/// `c.architecture`) and DeepSeek-V2/V3. Empty and a sentence in `why` for what the loader could
/// not read back the same (RoPE scaling is not written).
std::string hf_config_json(const model_config& c, std::string* why);

/// The weights under transformers' tensor names, in `o.dtype`.
std::vector<st_write_tensor> hf_tensors(const model_config& c, const model_weights& w, const hf_export_options& o);

/// A byte-level BPE tokenizer.json for the built-in byte vocabulary (ids 0..255 the bytes, then
/// <bos>, <eos>, <pad>; no merges). Empty when `c`'s vocabulary is not that one.
std::string byte_vocabulary_tokenizer_json(const model_config& c);

/// Writes the whole directory (created if missing): config.json, model.safetensors and, for the
/// byte vocabulary, tokenizer.json and tokenizer_config.json. Empty, or a sentence naming the
/// file and what went wrong.
std::string save_hf_model(const std::string& dir, const model_config& c, const model_weights& w,
                          const hf_export_options& o = {});

}  // namespace baton::gpu
