#include "gpu/cpu_executor.hpp"

#include "gpu/hf_model.hpp"

#include <cmath>
#include <mutex>

#include "gpu/cpu_kernels.hpp"
#include "gpu/job_queue.hpp"
#include "gpu/thread_pool.hpp"

namespace baton::gpu {

std::string cpu_executor_config::validate() const {
  if (num_threads == 0) return "num_threads must be >= 1";
  if (num_kv_pages == 0) return "num_kv_pages must be >= 1";
  if (page_size_tokens == 0) return "page_size_tokens must be >= 1";
  return {};
}

std::string check_forward_job(const forward_job& job, const model_config& cfg, const kv_layout& layout) {
  const uint32_t page = layout.page_size_tokens;
  for (const auto& s : job.seqs) {
    const auto tag = "sequence " + std::to_string(s.seq_id) + ": ";
    if (s.tokens.empty()) return tag + "no tokens to run";
    for (auto t : s.tokens)
      if (t < 0 || static_cast<uint32_t>(t) >= cfg.vocab_size)
        return tag + "token id " + std::to_string(t) + " outside the vocabulary [0, " +
               std::to_string(cfg.vocab_size) + ")";
    const uint64_t end = uint64_t{s.start_pos} + s.tokens.size();
    if (end > cfg.max_position_embeddings)
      return tag + "position " + std::to_string(end - 1) + " beyond the context limit " +
             std::to_string(cfg.max_position_embeddings);
    if (uint64_t{s.pages.size()} * page < end)
      return tag + std::to_string(s.pages.size()) + " KV pages cannot hold " + std::to_string(end) + " tokens";
    for (auto p : s.pages)
      if (p >= layout.num_pages) return tag + "KV page " + std::to_string(p) + " does not exist";
  }
  return {};
}

namespace {

/// Scratch buffers for one forward pass, sized by its total number of rows.
struct activations {
  std::vector<float> x, hn, q, k, v, attn, proj, gate, up;
  void resize(const model_config& c, size_t rows) {
    x.resize(rows * c.hidden_size);
    hn.resize(rows * c.hidden_size);
    q.resize(rows * c.q_dim());
    k.resize(rows * c.kv_dim());
    v.resize(rows * c.kv_dim());
    attn.resize(rows * c.q_dim());
    proj.resize(rows * c.hidden_size);
    gate.resize(rows * c.intermediate_size);
    up.resize(rows * c.intermediate_size);
  }
};

/// Where row r of the batch sits: which sequence, which absolute position.
struct row_ref {
  uint32_t seq;
  uint32_t pos;
};

class cpu_executor final : public executor {
public:
  cpu_executor(model_config cfg, std::shared_ptr<const model_weights> weights, cpu_executor_config ecfg)
    : cfg_(std::move(cfg)),
      weights_(std::move(weights)),
      kv_(kv_layout{cfg_.num_hidden_layers, ecfg.num_kv_pages, ecfg.page_size_tokens, cfg_.kv_dim()}),
      pool_(ecfg.num_threads),
      num_threads_(ecfg.num_threads),
      inv_freq_(rope_inv_freq(cfg_)) {
    jobs_.start([this](const forward_job& job) { return check_forward_job(job, cfg_, kv_.layout()); },
                [this](const forward_job& job, executor_sink& sink) { forward(job, sink); });
  }

  ~cpu_executor() override { stop(); }

  void stop() override { jobs_.stop(); }

  const model_config& config() const override { return cfg_; }
  kv_cache& kv() override { return kv_; }
  std::string describe() const override { return "cpu x" + std::to_string(num_threads_) + " threads"; }

  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override { jobs_.submit(std::move(job), std::move(sink)); }

private:
  void forward(const forward_job& job, executor_sink& sink) {
    const auto& c = cfg_;
    const auto& w = *weights_;
    std::vector<row_ref> rows;
    for (uint32_t s = 0; s < job.seqs.size(); ++s)
      for (uint32_t i = 0; i < job.seqs[s].tokens.size(); ++i) rows.push_back({s, job.seqs[s].start_pos + i});
    const size_t n = rows.size();
    const size_t h = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), f = c.intermediate_size;
    act_.resize(c, n);

    for (size_t r = 0; r < n; ++r) {
      const int32_t tok = job.seqs[rows[r].seq].tokens[rows[r].pos - job.seqs[rows[r].seq].start_pos];
      std::copy_n(w.embed.data() + static_cast<size_t>(tok) * h, h, act_.x.data() + r * h);
    }

    for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto& lw = w.layers[l];
      rmsnorm(act_.x.data(), lw.attn_norm.data(), n, h, c.rms_norm_eps, act_.hn.data());
      matmul_nt(act_.hn.data(), n, h, lw.wq.data(), qd, act_.q.data(), &pool_);
      matmul_nt(act_.hn.data(), n, h, lw.wk.data(), kvd, act_.k.data(), &pool_);
      matmul_nt(act_.hn.data(), n, h, lw.wv.data(), kvd, act_.v.data(), &pool_);
      if (!lw.bq.empty())  // Qwen2: biased q, k, v projections
        for (size_t r = 0; r < n; ++r) {
          add_inplace(act_.q.data() + r * qd, lw.bq.data(), qd);
          add_inplace(act_.k.data() + r * kvd, lw.bk.data(), kvd);
          add_inplace(act_.v.data() + r * kvd, lw.bv.data(), kvd);
        }
      if (!lw.q_norm.empty()) {  // Qwen3: each head of q and k RMS-normalised before RoPE
        rmsnorm(act_.q.data(), lw.q_norm.data(), n * c.num_attention_heads, c.head_dim, c.rms_norm_eps, act_.q.data());
        rmsnorm(act_.k.data(), lw.k_norm.data(), n * c.num_key_value_heads, c.head_dim, c.rms_norm_eps, act_.k.data());
      }
      for (size_t r = 0; r < n; ++r) {
        rope_apply(act_.q.data() + r * qd, c.num_attention_heads, c.head_dim, rows[r].pos, inv_freq_.data());
        rope_apply(act_.k.data() + r * kvd, c.num_key_value_heads, c.head_dim, rows[r].pos, inv_freq_.data());
        const auto& pages = job.seqs[rows[r].seq].pages;
        const uint32_t ps = kv_.layout().page_size_tokens;
        const uint32_t page = pages[rows[r].pos / ps], slot = rows[r].pos % ps;
        std::copy_n(act_.k.data() + r * kvd, kvd, kv_.k_at(l, page, slot));
        std::copy_n(act_.v.data() + r * kvd, kvd, kv_.v_at(l, page, slot));
      }
      // The pipeline's consumer end: a sequence whose cached prefix is still arriving waits here
      // for this layer of it, while its Q, K and V were computed above.
      for (const auto& s : job.seqs)
        if (s.gate && !s.gate->wait(l)) {
          sink.on_failed(job.job_id, "sequence " + std::to_string(s.seq_id) + ": layer " + std::to_string(l) +
                                         " of its cached prefix will not arrive");
          return;
        }
      attention(job, rows, l);
      matmul_nt(act_.attn.data(), n, qd, lw.wo.data(), h, act_.proj.data(), &pool_);
      add_inplace(act_.x.data(), act_.proj.data(), n * h);

      rmsnorm(act_.x.data(), lw.mlp_norm.data(), n, h, c.rms_norm_eps, act_.hn.data());
      matmul_nt(act_.hn.data(), n, h, lw.w_gate.data(), f, act_.gate.data(), &pool_);
      matmul_nt(act_.hn.data(), n, h, lw.w_up.data(), f, act_.up.data(), &pool_);
      swiglu(act_.gate.data(), act_.up.data(), n * f, act_.gate.data());
      matmul_nt(act_.gate.data(), n, f, lw.w_down.data(), h, act_.proj.data(), &pool_);
      add_inplace(act_.x.data(), act_.proj.data(), n * h);
      sink.on_layer_done(job.job_id, l);
    }

    // LM head: one matrix product over the last row of every sequence that wants logits, so the
    // (large) head matrix is streamed once per step, not once per sequence.
    std::vector<size_t> wanting;
    size_t last_row = 0;
    for (size_t s = 0; s < job.seqs.size(); ++s) {
      last_row += job.seqs[s].tokens.size();
      if (!job.seqs[s].want_logits) continue;
      rmsnorm(act_.x.data() + (last_row - 1) * h, w.final_norm.data(), 1, h, c.rms_norm_eps,
              act_.hn.data() + wanting.size() * h);
      wanting.push_back(s);
    }
    std::vector<float> all_logits(wanting.size() * c.vocab_size);
    matmul_nt(act_.hn.data(), wanting.size(), h, w.lm_head_data(), c.vocab_size, all_logits.data(), &pool_);
    std::vector<std::vector<float>> logits(job.seqs.size());
    for (size_t i = 0; i < wanting.size(); ++i)
      logits[wanting[i]].assign(all_logits.begin() + i * c.vocab_size, all_logits.begin() + (i + 1) * c.vocab_size);
    sink.on_done(job.job_id, std::move(logits));
  }

  /// Causal attention of every row over its own sequence's KV pages, positions [0, pos].
  /// Each (row, head) is computed alone in a fixed order, so batching cannot change it.
  void attention(const forward_job& job, const std::vector<row_ref>& rows, uint32_t layer) {
    const auto& c = cfg_;
    const uint32_t hd = c.head_dim, group = c.num_attention_heads / c.num_key_value_heads;
    const uint32_t ps = kv_.layout().page_size_tokens;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const size_t work = rows.size() * c.num_attention_heads;
    pool_.parallel_for(work, 1, [&](size_t begin, size_t end) {
      std::vector<float> scores;
      for (size_t item = begin; item < end; ++item) {
        const size_t r = item / c.num_attention_heads;
        const uint32_t head = static_cast<uint32_t>(item % c.num_attention_heads), kvh = head / group;
        const auto& pages = job.seqs[rows[r].seq].pages;
        const uint32_t len = rows[r].pos + 1;
        scores.resize(len);
        attention_ref(act_.q.data() + r * c.q_dim() + head * hd, len, kv_.k_at(layer, 0, 0), pages.data(), ps,
                      c.kv_dim(), kv_.layout().page_bytes() / sizeof(float), kvh * hd, hd, scale, scores.data(),
                      act_.attn.data() + r * c.q_dim() + head * hd);
      }
    });
  }

  model_config cfg_;
  std::shared_ptr<const model_weights> weights_;
  kv_cache kv_;
  thread_pool pool_;
  unsigned num_threads_;
  std::vector<float> inv_freq_;  ///< RoPE inverse frequencies (scaled per the config), once
  activations act_;  ///< touched only by the queue thread (and the pool inside a job)

  job_queue jobs_;  ///< last: its thread stops before the rest goes
};

}  // namespace

std::unique_ptr<executor> make_cpu_executor(model_config cfg, std::shared_ptr<const model_weights> weights,
                                            cpu_executor_config exec_cfg) {
  return std::make_unique<cpu_executor>(std::move(cfg), std::move(weights), exec_cfg);
}

}  // namespace baton::gpu
