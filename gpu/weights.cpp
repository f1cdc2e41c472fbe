#include "gpu/weights.hpp"

#include <algorithm>
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
  /// As if `n` values were drawn (the state advances by a constant per draw).
  void skip(uint64_t n) { state += n * 0x9E3779B97F4A7C15ull; }
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

model_weights make_seeded_weights(const model_config& cfg, uint64_t seed, const expert_filter& keep) {
  seeded_stream rng{seed};
  const uint64_t h = cfg.hidden_size, q = cfg.q_dim(), kv = cfg.kv_dim();
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
  model_weights w;
  w.embed = uniform_matrix(rng, cfg.vocab_size, h, 0.5f);
  w.layers.resize(cfg.num_hidden_layers);
  auto inv_sqrt = [](uint64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); };
  for (uint32_t li = 0; li < cfg.num_hidden_layers; ++li) {
    auto& l = w.layers[li];
    l.attn_norm = norm_weights(rng, h);
    if (cfg.is_mla()) {
      const auto& m = cfg.mla;
      if (m.q_lora_rank) {
        l.wq_a = uniform_matrix(rng, m.q_lora_rank, h, in_h);
        l.q_a_norm = norm_weights(rng, m.q_lora_rank);
        l.wq_b = uniform_matrix(rng, q, m.q_lora_rank, inv_sqrt(m.q_lora_rank));
      } else {
        l.wq = uniform_matrix(rng, q, h, in_h);
      }
      l.wkv_a = uniform_matrix(rng, kv, h, in_h);
      l.kv_a_norm = norm_weights(rng, m.kv_lora_rank);
      l.wkv_b = uniform_matrix(rng, uint64_t{cfg.num_attention_heads} * (m.qk_nope_head_dim + m.v_head_dim),
                               m.kv_lora_rank, inv_sqrt(m.kv_lora_rank));
    } else {
      l.wq = uniform_matrix(rng, q, h, in_h);
      l.wk = uniform_matrix(rng, kv, h, in_h);
      l.wv = uniform_matrix(rng, kv, h, in_h);
    }
    l.wo = uniform_matrix(rng, h, cfg.attn_out_dim(), inv_sqrt(cfg.attn_out_dim()));
    l.mlp_norm = norm_weights(rng, h);
    if (const uint64_t f = cfg.mlp_intermediate(li)) {
      l.w_gate = uniform_matrix(rng, f, h, in_h);
      l.w_up = uniform_matrix(rng, f, h, in_h);
      l.w_down = uniform_matrix(rng, h, f, inv_sqrt(f));
    }
    if (cfg.is_moe_layer(li)) {
      const uint64_t e = cfg.moe.n_routed_experts, mf = cfg.moe.moe_intermediate_size;
      // Router rows several times larger than the other weights: distinct tokens pick distinct
      // experts, so tests exercise the routing rather than one favourite expert.
      l.router = uniform_matrix(rng, e, h, 4.0f * in_h);
      if (cfg.moe.topk_method == "noaux_tc") l.router_bias = uniform_matrix(rng, e, 1, 0.05f);
      l.experts.resize(e);
      for (uint32_t xi = 0; xi < e; ++xi) {
        auto& x = l.experts[xi];
        if (keep && !keep(cfg, li, xi)) {
          rng.skip(3 * mf * h);  // gate, up and down
          continue;
        }
        x.gate = uniform_matrix(rng, mf, h, in_h);
        x.up = uniform_matrix(rng, mf, h, in_h);
        x.down = uniform_matrix(rng, h, mf, inv_sqrt(mf));
      }
    }
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
  finish_mla_weights(cfg, w);
  return w;
}

void finish_mla_weights(const model_config& cfg, model_weights& w) {
  if (!cfg.is_mla()) return;
  const auto& m = cfg.mla;
  const uint64_t lora = m.kv_lora_rank, nope = m.qk_nope_head_dim, vd = m.v_head_dim, heads = cfg.num_attention_heads;
  for (auto& l : w.layers) {
    // wkv_b rows, per head: nope rows of W_UK (latent -> key), then vd rows of W_UV (latent -> value).
    l.w_uk_t.assign(heads * lora * nope, 0.0f);
    l.w_uv.assign(heads * vd * lora, 0.0f);
    for (uint64_t hd = 0; hd < heads; ++hd) {
      const float* base = l.wkv_b.data() + hd * (nope + vd) * lora;
      for (uint64_t i = 0; i < nope; ++i)
        for (uint64_t j = 0; j < lora; ++j) l.w_uk_t[(hd * lora + j) * nope + i] = base[i * lora + j];
      std::copy_n(base + nope * lora, vd * lora, l.w_uv.data() + hd * vd * lora);
    }
  }
}

}  // namespace baton::gpu
