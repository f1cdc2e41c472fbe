#include "gpu/weights.hpp"

#include <cmath>

namespace baton::gpu {

namespace {

/// splitmix64: tiny, portable, good enough to fill weight matrices.
struct seeded_stream {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [-1, 1), from the top 24 bits so the float conversion is exact.
  float uniform() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
};

std::vector<float> uniform_matrix(seeded_stream& rng, uint64_t rows, uint64_t cols, float std_dev) {
  // A uniform variable on [-a, a] has standard deviation a / sqrt(3).
  const float a = std_dev * std::sqrt(3.0f);
  std::vector<float> m(rows * cols);
  for (auto& x : m) x = rng.uniform() * a;
  return m;
}

std::vector<float> norm_weights(seeded_stream& rng, uint64_t n) {
  std::vector<float> w(n);
  for (auto& x : w) x = 1.0f + 0.1f * rng.uniform();
  return w;
}

}  // namespace

model_weights make_seeded_weights(const model_config& cfg, uint64_t seed) {
  seeded_stream rng{seed};
  const uint64_t h = cfg.hidden_size, q = cfg.q_dim(), kv = cfg.kv_dim(), f = cfg.intermediate_size;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
  model_weights w;
  w.embed = uniform_matrix(rng, cfg.vocab_size, h, 0.5f);
  w.layers.resize(cfg.num_hidden_layers);
  for (auto& l : w.layers) {
    l.attn_norm = norm_weights(rng, h);
    l.wq = uniform_matrix(rng, q, h, in_h);
    l.wk = uniform_matrix(rng, kv, h, in_h);
    l.wv = uniform_matrix(rng, kv, h, in_h);
    l.wo = uniform_matrix(rng, h, q, 1.0f / std::sqrt(static_cast<float>(q)));
    l.mlp_norm = norm_weights(rng, h);
    l.w_gate = uniform_matrix(rng, f, h, in_h);
    l.w_up = uniform_matrix(rng, f, h, in_h);
    l.w_down = uniform_matrix(rng, h, f, 1.0f / std::sqrt(static_cast<float>(f)));
  }
  w.final_norm = norm_weights(rng, h);
  if (!cfg.tie_word_embeddings) {
    w.lm_head = uniform_matrix(rng, cfg.vocab_size, h, 4.0f * in_h);
    // A random model emits random bytes; shrinking the LM-head rows of bytes outside printable
    // ASCII keeps the built-in model's (meaningless) output readable in a terminal.
    if (cfg.vocab_size >= 256)
      for (uint32_t t = 0; t < cfg.vocab_size; ++t)
        if (t < 256 && !(t >= 0x20 && t < 0x7f))
          for (uint64_t i = 0; i < h; ++i) w.lm_head[t * h + i] *= 0.25f;
  }
  return w;
}

}  // namespace baton::gpu
