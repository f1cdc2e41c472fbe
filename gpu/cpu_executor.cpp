#include "gpu/cpu_executor.hpp"

#include "gpu/hf_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "gpu/cpu_kernels.hpp"
#include "gpu/expert_parallel.hpp"
#include "gpu/job_queue.hpp"
#include "gpu/moe_routing.hpp"
#include "gpu/thread_pool.hpp"

namespace baton::gpu {

std::string cpu_executor_config::validate() const {
  // The flags that set them named too: a user typed the flag, not the field.
  if (num_threads == 0) return "num_threads (--executor-threads) must be >= 1";
  if (num_kv_pages == 0) return "num_kv_pages (--kv-pages) must be >= 1";
  if (page_size_tokens == 0) return "page_size_tokens (--page-tokens) must be >= 1";
  if (experts && peers) return "an executor is in an expert group or a data-parallel group, not both";
  return {};
}

namespace {

/// Scratch buffers for one forward pass, sized by its total number of rows.
struct activations {
  std::vector<float> x, hn, q, qa, k, v, attn, proj, gate, up;
  std::vector<float> router, xe, ye;  ///< MoE: router logits, one expert's gathered rows and output
  std::vector<uint32_t> chosen;       ///< MoE: each row's top-k experts
  std::vector<float> weight, route_scratch;
  std::vector<std::vector<std::pair<uint32_t, float>>> expert_rows;  ///< MoE: (row, weight) per expert
  void resize(const model_config& c, size_t rows) {
    uint32_t f = 0;
    for (uint32_t l = 0; l < c.num_hidden_layers; ++l)
      f = std::max({f, c.mlp_intermediate(l), c.is_moe_layer(l) ? c.moe.moe_intermediate_size : 0u});
    x.resize(rows * c.hidden_size);
    hn.resize(rows * c.hidden_size);
    q.resize(rows * c.q_dim());
    qa.resize(rows * c.mla.q_lora_rank);
    k.resize(rows * c.kv_dim());
    v.resize(rows * c.kv_dim());
    attn.resize(rows * c.attn_out_dim());
    proj.resize(rows * c.hidden_size);
    gate.resize(rows * f);
    up.resize(rows * f);
    router.resize(rows * c.moe.n_routed_experts);
    xe.resize(c.moe.n_routed_experts ? rows * c.hidden_size : 0);
    ye.resize(c.moe.n_routed_experts ? rows * c.hidden_size : 0);
  }
};

/// Where row r of the batch sits: which sequence, which absolute position.
struct row_ref {
  uint32_t seq;
  uint32_t pos;
};

/// Rows [begin, end) of a job (a micro-batch of dual-batch overlap, or all of them).
struct row_range {
  size_t begin, end;
  size_t size() const { return end - begin; }
};

class cpu_executor final : public executor {
public:
  cpu_executor(model_config cfg, std::shared_ptr<const model_weights> weights, cpu_executor_config ecfg)
    : cfg_(std::move(cfg)),
      weights_(std::move(weights)),
      kv_(model_kv_layout(cfg_, ecfg.num_kv_pages, ecfg.page_size_tokens),
          ecfg.kv_memory ? ecfg.kv_memory(model_kv_layout(cfg_, ecfg.num_kv_pages, ecfg.page_size_tokens).total_bytes())
                         : kv_host_memory{}),
      pool_(ecfg.num_threads),
      num_threads_(ecfg.num_threads),
      experts_(std::move(ecfg.experts)),
      peers_(std::move(ecfg.peers)),
      inv_freq_(rope_inv_freq(cfg_)),
      rope_factor_(rope_attention_factor(cfg_)),
      softmax_scale_(attention_softmax_scale(cfg_)) {
    if (peers_) fill_store(*peers_);
    auto check = [this](const forward_job& job) { return check_forward_job(job, cfg_, kv_.layout()); };
    auto run = [this](const forward_job& job, executor_sink& sink) {
      if (experts_) switch_experts();
      forward(job, sink);
      // A forward that failed midway still ends its step with the group; then, as when idle,
      // this member joins a step a peer has started.
      if (peers_) join_peers();
      if (experts_ && !failure_told_ && !experts_->failure().empty()) tell_failure();  // a shard out for good
    };
    if (peers_)  // idle: joins a step a peer starts, woken by its doorbell
      jobs_.start(check, run, {},
                  {.look = [this] { return join_peers(); },
                   .doze = [this](std::chrono::microseconds d, const std::function<bool()>& ready) { peers_->doze(d, ready); },
                   .nudge =
                       [this] {
                         std::lock_guard<std::mutex> lock{failure_mutex_};  // peers_ may be switched meanwhile
                         if (peers_) peers_->nudge();
                       }});
    else if (experts_)  // while idle: a dead shard is noticed, and new shards are taken
      jobs_.start(check, run, {}, {.look = [this] { return idle_experts(), false; }, .every = std::chrono::milliseconds{5}});
    else
      jobs_.start(check, run);
  }

  ~cpu_executor() override { stop(); }

  void stop() override {
    jobs_.stop();
    if (peers_) peers_->leave();
    std::shared_ptr<expert_peers> next;
    std::shared_ptr<expert_group> next_experts;
    {
      std::lock_guard<std::mutex> lock{failure_mutex_};
      stopped_ = true;  // rejoin_group and replace_experts refuse from here on: no thread is left to switch
      next = std::move(next_peers_);
      next_experts = std::move(next_experts_);  // dropped here: its deleter stops its shards
    }
    if (next) next->leave();  // a re-formed group this executor never switched to
  }

  std::string standing_failure() const override {
    std::shared_ptr<expert_peers> peers;
    std::shared_ptr<expert_group> experts;
    {
      std::lock_guard<std::mutex> lock{failure_mutex_};
      peers = peers_;
      experts = experts_;
    }
    if (experts)  // a shard out for good: no MoE layer can run here any more
      if (auto f = experts->failure(); !f.empty()) return "expert parallelism: " + f;
    return peers ? peers->failure() : std::string{};
  }

  bool replace_experts(std::shared_ptr<expert_group> group, std::string* why) override {
    if (!group) return *why = "replace_experts: no group given", false;
    std::lock_guard<std::mutex> lock{failure_mutex_};
    if (!experts_) return *why = "this executor has no expert shards", false;
    if (stopped_) return *why = "this executor has stopped", false;
    if (next_experts_) return *why = "it has not yet switched to the shards it was given before", false;
    if (group->size() != experts_->size())
      return *why = "the new group has " + std::to_string(group->size()) + " EP ranks, this executor's has " +
                    std::to_string(experts_->size()),
             false;
    if (experts_->failure().empty()) return *why = "its expert group has not failed; nothing to replace", false;
    next_experts_ = std::move(group);  // switched to by switch_experts, between jobs
    return true;
  }

  bool rejoin_pending() const override {
    std::lock_guard<std::mutex> lock{failure_mutex_};
    return next_peers_ != nullptr || next_experts_ != nullptr;
  }

  void on_health_change(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock{failure_mutex_};
    failure_listener_ = std::move(fn);
  }

  bool rejoin_group(std::shared_ptr<expert_peers> peers, std::string* why) override {
    if (!peers) return *why = "rejoin: no group given", false;
    if (auto no = rejoin_refusal(); !no.empty()) return *why = no, false;
    // Filled outside the lock (the new member is not shared yet): standing_failure() takes it
    // from the rank's and the node's threads, and a store is a copy of many experts' weights.
    if (!fill_store(*peers))  // weights shared without routed experts (as `baton node` keeps them)
      return *why = "the re-formed group's member holds no experts, and this executor's weights have none to give it",
             false;
    std::lock_guard<std::mutex> lock{failure_mutex_};
    if (auto no = rejoin_refusal_locked(); !no.empty()) return *why = no, false;  // stopped meanwhile, say
    next_peers_ = std::move(peers);  // switched to by join_peers, between jobs
    return true;
  }

  const model_config& config() const override { return cfg_; }
  kv_cache& kv() override { return kv_; }
  bool picks_every_row() const override { return true; }
  std::string describe() const override { return "cpu x" + std::to_string(num_threads_) + " threads"; }

  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override { jobs_.submit(std::move(job), std::move(sink)); }

private:
  void forward(const forward_job& job, executor_sink& sink) {
    const auto& c = cfg_;
    const auto& w = *weights_;
    for (const auto& q : job.seqs)
      if (!q.score_targets.empty() && q.score_targets.size() != q.tokens.size())
        return sink.on_failed(job.job_id, "sequence " + std::to_string(q.seq_id) + ": " +
                                              std::to_string(q.score_targets.size()) + " score targets for " +
                                              std::to_string(q.tokens.size()) + " rows");
    std::vector<row_ref> rows;
    for (uint32_t s = 0; s < job.seqs.size(); ++s)
      for (uint32_t i = 0; i < job.seqs[s].tokens.size(); ++i) rows.push_back({s, job.seqs[s].start_pos + i});
    const size_t n = rows.size();
    const size_t h = c.hidden_size;
    act_.resize(c, n);

    for (size_t r = 0; r < n; ++r) {
      const int32_t tok = job.seqs[rows[r].seq].tokens[rows[r].pos - job.seqs[rows[r].seq].start_pos];
      std::copy_n(w.embed.data() + static_cast<size_t>(tok) * h, h, act_.x.data() + r * h);
    }

    const bool overlap = overlaps_attention(job);
    bool a_ahead = false;  // micro-batch A's attention of this layer ran during the last one's
    for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto& lw = w.layers[l];
      if (overlap && c.is_moe_layer(l)) {
        if (std::string why; !overlapped_layer(job, rows, l, (n + 1) / 2, &a_ahead, sink, &why)) {
          sink.on_failed(job.job_id, "layer " + std::to_string(l) + ": " + why);
          return;
        }
        sink.on_layer_computed(job.job_id, l);
        continue;
      }
      rmsnorm(act_.x.data(), lw.attn_norm.data(), n, h, c.rms_norm_eps, act_.hn.data());
      // Each attention writes this layer's KV, waits for the layer's gates, tells the sink the
      // layer's KV is ready, and leaves the o_proj output in act_.proj.
      const bool ok = c.is_mla() ? latent_attention_layer(job, rows, {0, n}, l, sink, true)
                                 : attention_layer(job, rows, {0, n}, l, sink, true);
      if (!ok) return;
      add_inplace(act_.x.data(), act_.proj.data(), n * h);

      rmsnorm(act_.x.data(), lw.mlp_norm.data(), n, h, c.rms_norm_eps, act_.hn.data());
      if (c.is_moe_layer(l)) {
        if (std::string why; !moe_mlp(l, n, &why)) {
          sink.on_failed(job.job_id, "layer " + std::to_string(l) + ": " + why);
          return;
        }
      } else
        dense_mlp(lw.w_gate.data(), lw.w_up.data(), lw.w_down.data(), act_.hn.data(), n, c.mlp_intermediate(l),
                  act_.proj.data());
      add_inplace(act_.x.data(), act_.proj.data(), n * h);
      sink.on_layer_computed(job.job_id, l);
    }

    // LM head: one matrix product over the rows that want logits or a token -- every sequence's
    // last, and each earlier row of a speculating one (row_samples) -- so the (large) head matrix
    // is streamed once per step, not once per sequence. A row's logits are the same whichever
    // rows share the product (batch-invariant), so a draft row's pick is the one a step of its
    // own would make.
    struct head_row {
      size_t seq;
      size_t row;  ///< within its sequence
    };
    std::vector<head_row> wanting;
    bool rows_picked = false;
    size_t first_row = 0;
    for (size_t s = 0; s < job.seqs.size(); first_row += job.seqs[s].tokens.size(), ++s) {
      const auto& q = job.seqs[s];
      if (!q.wants_head()) continue;
      rows_picked |= !q.row_samples.empty();
      for (size_t r = q.row_samples.empty() ? q.tokens.size() - 1 : 0; r < q.tokens.size(); ++r) {
        rmsnorm(act_.x.data() + (first_row + r) * h, w.final_norm.data(), 1, h, c.rms_norm_eps,
                act_.hn.data() + wanting.size() * h);
        wanting.push_back({s, r});
      }
    }
    std::vector<float> all_logits(wanting.size() * c.vocab_size);
    matmul_nt(act_.hn.data(), wanting.size(), h, w.lm_head_data(), c.vocab_size, all_logits.data(), &pool_);
    forward_output out{std::vector<std::vector<float>>(job.seqs.size()), std::vector<int32_t>(job.seqs.size(), -1), {}};
    if (rows_picked) {
      out.row_tokens.resize(job.seqs.size());
      out.row_logprobs.resize(job.seqs.size());
    }
    for (size_t i = 0; i < wanting.size(); ++i) {
      const auto [si, r] = wanting[i];
      const auto& s = job.seqs[si];
      const std::span<const float> row(all_logits.data() + i * c.vocab_size, c.vocab_size);
      if (r + 1 < s.tokens.size()) {  // a draft's row (row_samples)
        const auto& pick = s.row_samples[r];
        // Its history: the last pick's, without the rows after this one.
        const size_t later = s.tokens.size() - 1 - r;
        const auto& all = s.sample->history;
        const auto history = pick.cfg.penalised() && all.size() >= later
                                 ? std::span<const int32_t>(all.data(), all.size() - later)
                                 : std::span<const int32_t>{};
        out.row_tokens[si].push_back(sample_token(row, pick.cfg, pick.position, history, &scratch_));
        out.row_logprobs[si].push_back(pick.want_logprobs ? logprobs_of(row, out.row_tokens[si].back(), pick.top_logprobs)
                                                          : token_logprobs{});
        continue;
      }
      if (s.sample) out.tokens[si] = sample_token(row, *s.sample, &scratch_);
      if (s.sample && s.sample->want_logprobs) {
        out.logprobs.resize(job.seqs.size());
        out.logprobs[si] = logprobs_of(row, out.tokens[si], s.sample->top_logprobs);
      }
      if (s.want_logits) out.logits[si].assign(row.begin(), row.end());
    }
    score_rows(job, &out);
    sink.on_done(job.job_id, std::move(out));
  }

  /// Prompt scoring (forward_seq::score_targets): the head over every scored row, a slice of
  /// rows at a time so that the logits held stay small (a slice times the vocabulary), and each
  /// row's log-probabilities read from its logits as a pick's are.
  void score_rows(const forward_job& job, forward_output* out) {
    if (std::none_of(job.seqs.begin(), job.seqs.end(), [](const forward_seq& q) { return !q.score_targets.empty(); }))
      return;
    const auto& c = cfg_;
    const auto& w = *weights_;
    const size_t h = c.hidden_size;
    constexpr size_t slice = 32;
    std::vector<float> normed(slice * h), logits(slice * c.vocab_size);
    size_t first_row = 0;
    for (size_t s = 0; s < job.seqs.size(); first_row += job.seqs[s].tokens.size(), ++s) {
      const auto& q = job.seqs[s];
      if (q.score_targets.empty()) continue;
      out->scores.resize(job.seqs.size());
      std::vector<size_t> rows;
      for (size_t i = 0; i < q.score_targets.size(); ++i)
        if (q.score_targets[i] >= 0) rows.push_back(i);
      for (size_t from = 0; from < rows.size(); from += slice) {
        const size_t m = std::min(slice, rows.size() - from);
        for (size_t k = 0; k < m; ++k)
          rmsnorm(act_.x.data() + (first_row + rows[from + k]) * h, w.final_norm.data(), 1, h, c.rms_norm_eps,
                  normed.data() + k * h);
        matmul_nt(normed.data(), m, h, w.lm_head_data(), c.vocab_size, logits.data(), &pool_);
        for (size_t k = 0; k < m; ++k)
          out->scores[s].push_back(logprobs_of(std::span<const float>(logits.data() + k * c.vocab_size, c.vocab_size),
                                               q.score_targets[rows[from + k]], q.score_top));
      }
    }
  }

  /// The pipeline's consumer end: a sequence whose cached prefix is still arriving waits here for
  /// layer `l` of it, after this layer's projections were computed and its new KV written. Then
  /// the whole layer's KV is in the pool and the sink may ship it while attention and the MLP
  /// compute: its pages are still in the cache, and the send no longer waits for the layer's end.
  bool kv_ready(const forward_job& job, uint32_t l, executor_sink& sink) {
    for (const auto& s : job.seqs)
      if (s.gate && !s.gate->wait(l)) {
        sink.on_failed(job.job_id, "sequence " + std::to_string(s.seq_id) + ": layer " + std::to_string(l) +
                                       " of its cached prefix will not arrive");
        return false;
      }
    sink.on_layer_kv_ready(job.job_id, l);
    return true;
  }

  /// Where row r's token lives in the KV pool.
  std::pair<uint32_t, uint32_t> page_slot(const forward_job& job, const row_ref& row) const {
    const uint32_t ps = kv_.layout().page_size_tokens;
    return {job.seqs[row.seq].pages[row.pos / ps], row.pos % ps};
  }

  /// Grouped-query attention (Llama, Mistral, Qwen): K and V per KV head in two planes.
  /// Rows `rr` of the job's rows; `notify`: this call writes the layer's last KV (then the
  /// layer's gates are awaited and the sink told), as a whole batch's call does.
  bool attention_layer(const forward_job& job, const std::vector<row_ref>& all_rows, row_range rr, uint32_t l,
                       executor_sink& sink, bool notify) {
    const auto& c = cfg_;
    const auto& lw = weights_->layers[l];
    const size_t n = rr.size(), h = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim();
    const row_ref* rows = all_rows.data() + rr.begin;
    const float* hn = act_.hn.data() + rr.begin * h;
    float *q = act_.q.data() + rr.begin * qd, *k = act_.k.data() + rr.begin * kvd, *v = act_.v.data() + rr.begin * kvd;
    float* attn = act_.attn.data() + rr.begin * qd;
    matmul_nt(hn, n, h, lw.wq.data(), qd, q, &pool_);
    matmul_nt(hn, n, h, lw.wk.data(), kvd, k, &pool_);
    matmul_nt(hn, n, h, lw.wv.data(), kvd, v, &pool_);
    if (!lw.bq.empty())  // Qwen2: biased q, k, v projections
      for (size_t r = 0; r < n; ++r) {
        add_inplace(q + r * qd, lw.bq.data(), qd);
        add_inplace(k + r * kvd, lw.bk.data(), kvd);
        add_inplace(v + r * kvd, lw.bv.data(), kvd);
      }
    if (!lw.q_norm.empty()) {  // Qwen3: each head of q and k RMS-normalised before RoPE
      rmsnorm(q, lw.q_norm.data(), n * c.num_attention_heads, c.head_dim, c.rms_norm_eps, q);
      rmsnorm(k, lw.k_norm.data(), n * c.num_key_value_heads, c.head_dim, c.rms_norm_eps, k);
    }
    for (size_t r = 0; r < n; ++r) {
      rope_apply(q + r * qd, c.num_attention_heads, c.head_dim, rows[r].pos, inv_freq_.data());
      rope_apply(k + r * kvd, c.num_key_value_heads, c.head_dim, rows[r].pos, inv_freq_.data());
      if (rope_factor_ != 1.0f) {
        for (size_t i = 0; i < qd; ++i) q[r * qd + i] *= rope_factor_;
        for (size_t i = 0; i < kvd; ++i) k[r * kvd + i] *= rope_factor_;
      }
      const auto [page, slot] = page_slot(job, rows[r]);
      std::copy_n(k + r * kvd, kvd, kv_.k_at(l, page, slot));
      std::copy_n(v + r * kvd, kvd, kv_.v_at(l, page, slot));
    }
    if (notify && !kv_ready(job, l, sink)) return false;

    // Causal attention of every row over its own sequence's KV pages, positions [0, pos].
    // Each (row, head) is computed in a fixed order, so batching cannot change it; the heads
    // that share a KV head go together, reading its keys and values once
    // (attention_group_ref, equal to attention_ref per head).
    const uint32_t hd = c.head_dim, group = c.num_attention_heads / c.num_key_value_heads;
    const uint32_t ps = kv_.layout().page_size_tokens;
    const float scale = softmax_scale_;
    pool_.parallel_for(n * c.num_key_value_heads, 1, [&](size_t begin, size_t end) {
      std::vector<float> scores;
      for (size_t item = begin; item < end; ++item) {
        const size_t r = item / c.num_key_value_heads;
        const uint32_t kvh = static_cast<uint32_t>(item % c.num_key_value_heads);
        const auto& pages = job.seqs[rows[r].seq].pages;
        const uint32_t len = rows[r].pos + 1;
        scores.resize(size_t{group} * len);
        attention_group_ref(q + r * qd + kvh * group * hd, group, len, kv_.k_at(l, 0, 0), pages.data(), ps, c.kv_dim(),
                            kv_.layout().page_bytes() / sizeof(float), kvh * hd, hd, scale, scores.data(),
                            attn + r * qd + kvh * group * hd);
      }
    });
    matmul_nt(attn, n, qd, lw.wo.data(), h, act_.proj.data() + rr.begin * h, &pool_);
    return true;
  }

  /// DeepSeek's multi-head latent attention. The cache holds, per token, the normalised
  /// compressed KV and the rotated shared key: [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)].
  /// Every row (prefill or decode) attends over that latent directly: W_UK is absorbed into the
  /// query and W_UV applied after the weighted sum, so cached tokens are never expanded into
  /// per-head K and V. One path for both kinds of row keeps chunked prefill equal to
  /// token-by-token decoding, bit for bit.
  /// Rows `rr`, and `notify`, as attention_layer's.
  bool latent_attention_layer(const forward_job& job, const std::vector<row_ref>& all_rows, row_range rr, uint32_t l,
                              executor_sink& sink, bool notify) {
    const auto& c = cfg_;
    const auto& m = c.mla;
    const auto& lw = weights_->layers[l];
    const size_t n = rr.size(), h = c.hidden_size, qd = c.q_dim(), qk = c.qk_head_dim(), lat = c.kv_dim();
    const row_ref* rows = all_rows.data() + rr.begin;
    const float* hn = act_.hn.data() + rr.begin * h;
    float *qa = act_.qa.data() + rr.begin * m.q_lora_rank, *q = act_.q.data() + rr.begin * qd;
    float *k = act_.k.data() + rr.begin * lat, *attn = act_.attn.data() + rr.begin * c.attn_out_dim();
    const uint32_t lora = m.kv_lora_rank, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, vd = m.v_head_dim;
    // The low-rank norms are built with transformers' default epsilon, not rms_norm_eps.
    constexpr float lora_norm_eps = 1e-6f;
    if (m.q_lora_rank) {
      matmul_nt(hn, n, h, lw.wq_a.data(), m.q_lora_rank, qa, &pool_);
      rmsnorm(qa, lw.q_a_norm.data(), n, m.q_lora_rank, lora_norm_eps, qa);
      matmul_nt(qa, n, m.q_lora_rank, lw.wq_b.data(), qd, q, &pool_);
    } else {
      matmul_nt(hn, n, h, lw.wq.data(), qd, q, &pool_);
    }
    matmul_nt(hn, n, h, lw.wkv_a.data(), lat, k, &pool_);
    auto rotate = [&](float* x, uint32_t pos) {
      if (m.rope_interleave)
        rope_apply_interleaved(x, rope, pos, inv_freq_.data());
      else
        rope_apply(x, 1, rope, pos, inv_freq_.data());
      if (rope_factor_ != 1.0f)
        for (uint32_t i = 0; i < rope; ++i) x[i] *= rope_factor_;
    };
    for (size_t r = 0; r < n; ++r) {
      float* latent = k + r * lat;
      rmsnorm(latent, lw.kv_a_norm.data(), 1, lora, lora_norm_eps, latent);
      rotate(latent + lora, rows[r].pos);
      for (uint32_t head = 0; head < c.num_attention_heads; ++head)
        rotate(q + r * qd + head * qk + nope, rows[r].pos);
      const auto [page, slot] = page_slot(job, rows[r]);
      std::copy_n(latent, lat, kv_.k_at(l, page, slot));
    }
    if (notify && !kv_ready(job, l, sink)) return false;

    const uint32_t ps = kv_.layout().page_size_tokens;
    const float scale = softmax_scale_;
    // Heads go in bunches of up to `bunch`, which read each token's latent once
    // (latent_attention_group_ref, equal to latent_attention_ref per head); bunches of a row
    // still spread over the threads.
    constexpr uint32_t bunch = 16;
    const uint32_t bunches = (c.num_attention_heads + bunch - 1) / bunch;
    pool_.parallel_for(n * bunches, 1, [&](size_t begin, size_t end) {
      std::vector<float> scores, query(size_t{bunch} * lat), out(size_t{bunch} * lora);
      for (size_t item = begin; item < end; ++item) {
        const size_t r = item / bunches;
        const uint32_t first = static_cast<uint32_t>(item % bunches) * bunch;
        const uint32_t heads = std::min(bunch, c.num_attention_heads - first);
        for (uint32_t k = 0; k < heads; ++k) {
          // The latent query: W_UK_h^T q_nope, then the rotated part as is.
          const uint32_t head = first + k;
          const float* qh = q + r * qd + head * qk;
          float* qk_latent = query.data() + size_t{k} * lat;
          for (uint32_t j = 0; j < lora; ++j)
            qk_latent[j] = dot_fixed(lw.w_uk_t.data() + (uint64_t{head} * lora + j) * nope, qh, nope);
          std::copy_n(qh + nope, rope, qk_latent + lora);
        }
        const auto& pages = job.seqs[rows[r].seq].pages;
        const uint32_t len = rows[r].pos + 1;
        scores.resize(size_t{heads} * len);
        latent_attention_group_ref(query.data(), heads, len, kv_.k_at(l, 0, 0), pages.data(), ps, lat,
                                   kv_.layout().page_bytes() / sizeof(float), lora, scale, scores.data(), out.data());
        for (uint32_t k = 0; k < heads; ++k) {
          const uint32_t head = first + k;
          float* o = attn + r * c.attn_out_dim() + head * vd;
          for (uint32_t d = 0; d < vd; ++d)
            o[d] = dot_fixed(lw.w_uv.data() + (uint64_t{head} * vd + d) * lora, out.data() + size_t{k} * lora, lora);
        }
      }
    });
    matmul_nt(attn, n, c.attn_out_dim(), lw.wo.data(), h, act_.proj.data() + rr.begin * h, &pool_);
    return true;
  }

  /// out[n][hidden] = SwiGLU MLP of `f` intermediate values over x[n][hidden].
  void dense_mlp(const float* gate, const float* up, const float* down, const float* x, size_t n, size_t f, float* out) {
    swiglu_mlp(x, n, cfg_.hidden_size, gate, up, down, f, act_.gate.data(), act_.up.data(), out, &pool_);
  }

  /// A MoE layer: each row routed to its top-k experts, rows bound for one expert run through it
  /// together (as expert-parallel dispatch packs them), their outputs summed per row in expert
  /// order with the routing weights, then the shared experts added. Rows never see each other's
  /// numbers, so a token's result does not depend on who shares its batch.
  bool moe_mlp(uint32_t l, size_t n, std::string* why) {
    route_rows(l, {0, n});
    std::fill_n(act_.proj.data(), n * cfg_.hidden_size, 0.0f);
    if (experts_ || peers_) {
      if (!routed_elsewhere(l, n, why)) return false;
    } else {
      routed_here(l, n, act_.chosen, act_.weight);
    }
    shared_experts(l, {0, n});
    return true;
  }

  /// Router logits of rows `rr` of MoE layer `l`, then each row's top-k experts and weights
  /// (act_.chosen and act_.weight at the rows' offsets; sized for the job by size_routing).
  void route_rows(uint32_t l, row_range rr) {
    const auto& c = cfg_;
    const auto& lw = weights_->layers[l];
    const size_t h = c.hidden_size, e_count = c.moe.n_routed_experts, k = c.moe.num_experts_per_tok;
    size_routing(rr.end);
    float* logits = act_.router.data() + rr.begin * e_count;
    matmul_nt(act_.hn.data() + rr.begin * h, rr.size(), h, lw.router.data(), e_count, logits, &pool_);
    for (size_t r = 0; r < rr.size(); ++r)
      moe_route(c.moe, logits + r * e_count, lw.router_bias.empty() ? nullptr : lw.router_bias.data(),
                act_.chosen.data() + (rr.begin + r) * k, act_.weight.data() + (rr.begin + r) * k,
                act_.route_scratch.data());
  }
  void size_routing(size_t rows) {
    const size_t k = cfg_.moe.num_experts_per_tok;
    if (act_.chosen.size() < rows * k) act_.chosen.resize(rows * k);
    if (act_.weight.size() < rows * k) act_.weight.resize(rows * k);
    act_.route_scratch.resize(2 * cfg_.moe.n_routed_experts + cfg_.moe.n_group);
  }

  /// proj[rr] += the shared experts of MoE layer `l` over hn[rr] (none in some families).
  void shared_experts(uint32_t l, row_range rr) {
    const auto& lw = weights_->layers[l];
    const size_t h = cfg_.hidden_size;
    if (const size_t f = cfg_.mlp_intermediate(l)) {
      float* out = act_.ye.data() + rr.begin * h;
      dense_mlp(lw.w_gate.data(), lw.w_up.data(), lw.w_down.data(), act_.hn.data() + rr.begin * h, rr.size(), f, out);
      add_inplace(act_.proj.data() + rr.begin * h, out, rr.size() * h);
    }
  }

  /// The routed experts in this process: rows bound for one expert run through it together.
  void routed_here(uint32_t l, size_t n, const std::vector<uint32_t>& chosen, const std::vector<float>& weight) {
    const auto& c = cfg_;
    const auto& lw = weights_->layers[l];
    const size_t h = c.hidden_size, e_count = c.moe.n_routed_experts, k = c.moe.num_experts_per_tok;
    const size_t mf = c.moe.moe_intermediate_size;
    // Rows per expert, ascending: expert e's batch.
    auto& batch = act_.expert_rows;  // kept across layers: clear() keeps each list's capacity
    batch.resize(e_count);
    for (auto& b : batch) b.clear();
    for (size_t r = 0; r < n; ++r)
      for (size_t j = 0; j < k; ++j) batch[chosen[r * k + j]].push_back({static_cast<uint32_t>(r), weight[r * k + j]});
    for (size_t e = 0; e < e_count; ++e) {
      const auto& b = batch[e];
      if (b.empty()) continue;
      for (size_t i = 0; i < b.size(); ++i) std::copy_n(act_.hn.data() + b[i].first * h, h, act_.xe.data() + i * h);
      const auto& x = lw.experts[e];
      dense_mlp(x.gate.data(), x.up.data(), x.down.data(), act_.xe.data(), b.size(), mf, act_.ye.data());
      for (size_t i = 0; i < b.size(); ++i) {
        float* dst = act_.proj.data() + b[i].first * h;
        const float* src = act_.ye.data() + i * h;
        for (size_t d = 0; d < h; ++d) dst[d] += b[i].second * src[d];
      }
    }
  }

  /// One micro-batch's copies of its rows packed per owning EP rank (`{expert, x[hidden]}`
  /// entries), and where each row's j-th copy went: its rank and entry.
  struct packed_rows {
    std::vector<std::vector<std::byte>> entries;
    std::vector<std::pair<uint32_t, size_t>> where;  ///< [(row - rr.begin) * k + j]
  };
  packed_rows pack_rows(uint32_t l, row_range rr) {
    const auto& c = cfg_;
    const size_t h = c.hidden_size, k = c.moe.num_experts_per_tok, row_bytes = h * sizeof(float);
    packed_rows p;
    p.entries.resize(experts_ ? experts_->size() : peers_->size());
    p.where.resize(rr.size() * k);
    for (size_t r = rr.begin; r < rr.end; ++r)
      for (size_t j = 0; j < k; ++j) {
        const uint32_t e = act_.chosen[r * k + j];
        const uint64_t copy_hash = (uint64_t{rounds_} << 32) ^ (r * k + j);
        const uint32_t d = experts_ ? experts_->route(l, e, c.moe.n_routed_experts, copy_hash)
                                    : peers_->route(l, e, c.moe.n_routed_experts, copy_hash);
        auto& v = p.entries[d];
        p.where[(r - rr.begin) * k + j] = {d, v.size() / (sizeof(uint32_t) + row_bytes)};
        const size_t at = v.size();
        v.resize(at + sizeof(uint32_t) + row_bytes);
        std::memcpy(v.data() + at, &e, sizeof e);
        std::memcpy(v.data() + at + sizeof e, act_.hn.data() + r * h, row_bytes);
      }
    return p;
  }

  /// proj[rr] += each row's expert outputs weighted, in the order of its chosen experts (the
  /// ascending order routed_here adds in).
  void add_outputs(row_range rr, const packed_rows& p, const std::vector<std::vector<std::byte>>& outputs) {
    const size_t h = cfg_.hidden_size, k = cfg_.moe.num_experts_per_tok, row_bytes = h * sizeof(float);
    for (size_t r = rr.begin; r < rr.end; ++r) {
      float* dst = act_.proj.data() + r * h;
      for (size_t j = 0; j < k; ++j) {
        const auto [rank, entry] = p.where[(r - rr.begin) * k + j];
        const float* src = reinterpret_cast<const float*>(outputs[rank].data() + entry * row_bytes);
        const float w = act_.weight[r * k + j];
        for (size_t x = 0; x < h; ++x) dst[x] += w * src[x];
      }
    }
  }

  /// Expert parallelism: each row's copies packed per owning EP rank, one dispatch and one
  /// combine round, then the weighted sum per row in ascending expert order, as routed_here adds.
  /// With dual-batch overlap the rows are two micro-batches (first half, second half) whose
  /// rounds interleave; each row's numbers are the same either way.
  bool routed_elsewhere(uint32_t l, size_t n, std::string* why) {
    const auto& c = cfg_;
    const bool dual = experts_ ? experts_->dual_batch() : peers_->dual_batch();
    const size_t split = dual ? (n + 1) / 2 : n;  // rows of micro-batch A
    const row_range a{0, split}, b{split, n};
    const auto pa = pack_rows(l, a);
    const auto pb = dual ? pack_rows(l, b) : packed_rows{};
    ++rounds_;
    std::vector<std::vector<std::byte>> out_a, out_b;
    const bool ok = peers_ ? (dual ? peers_->round_dual(c, l, pa.entries, pb.entries, &out_a, &out_b, why)
                                   : peers_->round(c, l, pa.entries, &out_a, why))
                    : dual ? experts_->round_dual(c, *weights_, l, pa.entries, pb.entries, &out_a, &out_b, why)
                           : experts_->round(c, *weights_, l, pa.entries, &out_a, why);
    if (!ok) return false;
    add_outputs(a, pa, out_a);
    if (dual) add_outputs(b, pb, out_b);
    return true;
  }

  /// Whether `job` runs DeepSeek's schedule of dual-batch overlap, attention included: at least
  /// two rows, no sequence whose prefix is still arriving (a gate could fail micro-batch B's
  /// attention after A's dispatch went out), and a group with a second channel. Decode batches
  /// and prefill chunks alike: a prefill chunk split in two keeps causality, since a row attends
  /// only to positions at or before its own, which are in its micro-batch or in A, written
  /// first. See overlapped_layer.
  bool overlaps_attention(const forward_job& job) const {
    const bool dual = experts_ ? experts_->dual_batch() : peers_ && peers_->dual_batch();
    if (!dual) return false;
    size_t rows = 0;
    for (const auto& s : job.seqs) {
      if (s.gate) return false;
      rows += s.tokens.size();
    }
    return rows >= 2;
  }

  /// A layer's rows `rr` up to its MLP: attention norm, attention (KV written; `notify`: the
  /// layer's last), the residual, the MLP norm into act_.hn.
  bool attention_part(const forward_job& job, const std::vector<row_ref>& rows, row_range rr, uint32_t l,
                      executor_sink& sink, bool notify) {
    const auto& c = cfg_;
    const auto& lw = weights_->layers[l];
    const size_t h = c.hidden_size;
    float* x = act_.x.data() + rr.begin * h;
    float* hn = act_.hn.data() + rr.begin * h;
    rmsnorm(x, lw.attn_norm.data(), rr.size(), h, c.rms_norm_eps, hn);
    const bool ok = c.is_mla() ? latent_attention_layer(job, rows, rr, l, sink, notify)
                               : attention_layer(job, rows, rr, l, sink, notify);
    if (!ok) return false;
    add_inplace(x, act_.proj.data() + rr.begin * h, rr.size() * h);
    rmsnorm(x, lw.mlp_norm.data(), rr.size(), h, c.rms_norm_eps, hn);
    return true;
  }

  /// MoE rows `rr` once their experts' outputs are back: the weighted sum, the shared experts,
  /// the residual.
  void finish_moe(uint32_t l, row_range rr, const packed_rows& p, const std::vector<std::vector<std::byte>>& outputs) {
    const size_t h = cfg_.hidden_size;
    std::fill_n(act_.proj.data() + rr.begin * h, rr.size() * h, 0.0f);
    add_outputs(rr, p, outputs);
    shared_experts(l, rr);
    add_inplace(act_.x.data() + rr.begin * h, act_.proj.data() + rr.begin * h, rr.size() * h);
  }

  /// One MoE layer in DeepSeek's schedule of dual-batch overlap (decode steps and prefill chunks):
  /// the rows are two micro-batches, A (the first half) and B, and each one's all-to-all travels
  /// while the other computes, attention included:
  ///   A's attention (unless the previous layer ran it already); A's dispatch starts;
  ///   B's attention while it travels; B's dispatch starts; both micro-batches' experts run
  ///   (here and on every rank, each while the other's chunks travel); A's outputs come back;
  ///   A finishes the layer, and runs the next layer's attention while B's outputs travel;
  ///   B finishes the layer.
  /// Every row's numbers are those of the one-batch path (each product is row by row, and a row
  /// reads only KV written before its attention), and the exchanges are the same on every rank,
  /// so peers and shards need not know.
  bool overlapped_layer(const forward_job& job, const std::vector<row_ref>& rows, uint32_t l, size_t split,
                        bool* a_ahead, executor_sink& sink, std::string* why) {
    const auto& c = cfg_;
    const row_range a{0, split}, b{split, rows.size()};
    if (!*a_ahead && !attention_part(job, rows, a, l, sink, false)) return *why = "attention (micro-batch A)", false;
    route_rows(l, a);
    const auto pa = pack_rows(l, a);
    const bool posted = peers_ ? peers_->post_dual_a(c, l, pa.entries, why) : experts_->post_dual_a(c, l, pa.entries, why);
    if (!posted) return false;
    // No gates in such a job (overlaps_attention), so B's attention cannot fail: the round goes on.
    (void)attention_part(job, rows, b, l, sink, true);
    route_rows(l, b);
    const auto pb = pack_rows(l, b);
    ++rounds_;
    std::vector<std::vector<std::byte>> out_a, out_b;
    if (!(peers_ ? peers_->exchange_dual(c, pb.entries, &out_a, why)
                 : experts_->exchange_dual(c, *weights_, pb.entries, &out_a, why)))
      return false;
    finish_moe(l, a, pa, out_a);
    *a_ahead = l + 1 < c.num_hidden_layers && c.is_moe_layer(l + 1);
    if (*a_ahead) (void)attention_part(job, rows, a, l + 1, sink, false);
    if (!(peers_ ? peers_->finish_dual(c, &out_b, why) : experts_->finish_dual(c, *weights_, &out_b, why))) return false;
    finish_moe(l, b, pb, out_b);
    return true;
  }

  /// Data-parallel attention: ends this member's step, or joins one a peer started (then true).
  /// A failure leaves the group out of step; the next forward's MoE round reports it to its
  /// requests.
  bool join_peers() {
    switch_peers();
    const uint64_t joined = peers_->steps_joined();
    std::string why;
    if (!peers_->join(cfg_, &why) && why != last_peer_error_) {
      std::fprintf(stderr, "baton: %s\n", why.c_str());
      last_peer_error_ = why;
    }
    // A group that broke, here or through a peer's abort word, is told to the rank once.
    if (!failure_told_ && !peers_->failure().empty()) tell_failure();
    return peers_->steps_joined() != joined;
  }

  /// The rank's listener hears of a standing failure once (executor thread, between jobs).
  void tell_failure() {
    std::function<void()> tell;
    {
      std::lock_guard<std::mutex> lock{failure_mutex_};
      tell = failure_listener_;
    }
    if (tell) {
      failure_told_ = true;
      tell();
    }
  }

  /// Why rejoin_group cannot take a group now (empty: it can).
  std::string rejoin_refusal() const {
    std::lock_guard<std::mutex> lock{failure_mutex_};
    return rejoin_refusal_locked();
  }
  std::string rejoin_refusal_locked() const {
    if (!peers_) return "this executor is in no data-parallel group";
    if (stopped_) return "this executor has stopped";
    if (next_peers_) return "it has not yet switched to the group it was given before";
    // Its old group must be over: its members would otherwise wait for this one in a step.
    if (peers_->failure().empty()) return "its data-parallel group has not broken; nothing to rejoin";
    return {};
  }

  /// A data-parallel member serves routed experts from its own store: its block of this
  /// executor's weights, unless its creator filled the store already. False when it holds none
  /// after (this executor's weights keep no routed experts). A model without MoE layers needs none.
  bool fill_store(expert_peers& peers) const {
    const uint32_t first = cfg_.moe.first_k_dense_replace;
    if (first >= cfg_.num_hidden_layers || !peers.held(first).empty()) return true;
    peers.hold_block(cfg_, *weights_);
    return !peers.held(first).empty();
  }

  /// Expert parallelism with shards, while idle: a shard whose process ended is noticed before a
  /// request finds out (the rank steps aside), and new shards replace_experts gave are taken.
  void idle_experts() {
    switch_experts();
    if (!failure_told_ && experts_->check_shards()) tell_failure();
  }

  /// Takes the shards replace_experts gave, if any (executor thread, between jobs): the old group
  /// goes (its deleter stops what is left of its shards), and the rank hears that its standing
  /// failure cleared.
  void switch_experts() {
    std::shared_ptr<expert_group> old;
    std::function<void()> tell;
    {
      std::lock_guard<std::mutex> lock{failure_mutex_};
      if (!next_experts_) return;
      old = std::move(experts_);
      experts_ = std::move(next_experts_);
      tell = failure_listener_;
    }
    old.reset();
    rounds_ = 0;
    failure_told_ = false;
    if (tell) tell();
  }

  /// Takes the group rejoin_group gave, if any (executor thread, between jobs): from here on this
  /// executor runs that group's steps; the rank hears that its standing failure cleared.
  void switch_peers() {
    std::shared_ptr<expert_peers> old;  // left outside the lock: leaving may wait on puts (submit's nudge takes it)
    std::function<void()> tell;
    {
      std::lock_guard<std::mutex> lock{failure_mutex_};
      if (!next_peers_) return;
      old = std::move(peers_);
      peers_ = std::move(next_peers_);
      tell = failure_listener_;
    }
    old.reset();
    rounds_ = 0;
    last_peer_error_.clear();
    failure_told_ = false;
    if (tell) tell();
  }

  model_config cfg_;
  std::shared_ptr<const model_weights> weights_;
  kv_cache kv_;
  thread_pool pool_;
  unsigned num_threads_;
  sampling_scratch scratch_;  ///< the sampler's buffers (sampling runs on the executor's thread)
  /// Expert parallelism with shards; null: every expert here. Replaced (switch_experts) only on
  /// the executor's thread and under failure_mutex_, as peers_ is.
  std::shared_ptr<expert_group> experts_;
  std::shared_ptr<expert_group> next_experts_;  ///< the new shards replace_experts gave, not yet taken
  /// Data-parallel attention; null: not in a group. Replaced (by switch_peers) only on the
  /// executor's thread and under failure_mutex_, so that thread reads it freely; others lock.
  std::shared_ptr<expert_peers> peers_;
  std::shared_ptr<expert_peers> next_peers_;  ///< the re-formed group rejoin_group gave, not yet taken
  bool stopped_ = false;                      ///< stop() ran (under failure_mutex_)
  std::string last_peer_error_;            ///< said once on stderr
  mutable std::mutex failure_mutex_;
  std::function<void()> failure_listener_;  ///< on_health_change
  bool failure_told_ = false;               ///< the listener ran (queue thread only)
  uint32_t rounds_ = 0;                     ///< MoE rounds dispatched: spreads copies over replicas
  std::vector<float> inv_freq_;  ///< RoPE inverse frequencies (scaled per the config), once
  float rope_factor_;            ///< YaRN's attention factor on rotated values (1 otherwise)
  float softmax_scale_;
  activations act_;  ///< touched only by the queue thread (and the pool inside a job)

  job_queue jobs_;  ///< last: its thread stops before the rest goes
};

}  // namespace

std::unique_ptr<executor> make_cpu_executor(model_config cfg, std::shared_ptr<const model_weights> weights,
                                            cpu_executor_config exec_cfg) {
  return std::make_unique<cpu_executor>(std::move(cfg), std::move(weights), exec_cfg);
}

}  // namespace baton::gpu
