#pragma once

// Model shapes the CPU benchmarks share, beside the built-in ones (gpu/model_config.hpp).

#include "gpu/model_config.hpp"

namespace baton::bench {

/// A Llama shape of ~0.47B parameters (Qwen2.5-0.5B's: hidden 1024, 36 layers, GQA 16/4, vocab
/// 32000), with seeded weights: batch-1 decode streams its 1.9 GB of fp32 weights at memory speed.
inline gpu::model_config llama_500m_config() {
  gpu::model_config c = gpu::llama_100m_config();
  c.name = "llama-0.5b-shape";
  c.hidden_size = 1024;
  c.intermediate_size = 2816;
  c.num_hidden_layers = 36;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  return c;
}

}  // namespace baton::bench
