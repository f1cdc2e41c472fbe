#include "sims/modelled_executor.hpp"

#include <algorithm>
#include <cmath>
#include <deque>

namespace baton::sims {

int64_t modelled_layer_ns(const gpu::forward_job& job, const gpu::model_config& model,
                          const modelled_executor_config& cfg) {
  double us = 0.0;
  if (cfg.job_us) {
    us = cfg.job_us(job);
  } else if (job.kind == gpu::forward_job::decode) {
    uint64_t context = 0;
    for (const auto& s : job.seqs) context += s.start_pos + 1;
    us = cfg.decode.step_us(job.seqs.size(), context);
  } else {
    // Prompt chunks, and in a colocated step the running sequences' one-token rows riding along
    // (the decode rank marks such a step a prefill): the rows are timed as a decode step's, the
    // chunks by the prefill model, and the pass's fixed cost (its weights read once) is charged
    // once -- the prefill model's delta per chunk and per row made a step of 64 rows and one
    // chunk cost 65 passes.
    const auto& p = cfg.prefill;
    uint64_t rows = 0, row_context = 0, chunks = 0;
    for (const auto& s : job.seqs) {
      const uint64_t q = s.tokens.size(), c = s.start_pos;
      if (q == 0) continue;
      if (q == 1 && c > 0) {  // a decode row (a one-token chunk after a prefix costs the same)
        ++rows;
        row_context += c + 1;
        continue;
      }
      ++chunks;
      us += p.prefill_us(q, c) - p.delta_us;
    }
    const auto& d = cfg.decode;
    if (rows > 0) us += d.per_seq_us * static_cast<double>(rows) + d.per_context_token_us * static_cast<double>(row_context);
    us += std::max(chunks > 0 ? p.delta_us : 0.0, rows > 0 ? d.step_base_us : 0.0);
  }
  return std::llround(us * 1000.0 / model.num_hidden_layers);
}

namespace {

class modelled_executor final : public gpu::executor {
public:
  modelled_executor(gpu::model_config model, modelled_executor_config cfg)
    : model_(std::move(model)),
      cfg_(cfg),
      kv_(gpu::model_kv_layout(model_, cfg.num_kv_pages, cfg.page_size_tokens)) {}

  const gpu::model_config& config() const override { return model_; }
  gpu::kv_cache& kv() override { return kv_; }
  std::string describe() const override { return "modelled"; }
  void bind_runner(gpu::deferred_runner* runner) override { runner_ = runner; }
  bool on_virtual_time() const override { return true; }

  void submit(gpu::forward_job job, std::shared_ptr<gpu::executor_sink> sink) override {
    queue_.emplace_back(std::move(job), std::move(sink));
    if (!busy_) start_next();
  }

private:
  /// Runs queued jobs one at a time: layer l of a job ends (l + 1) · layer_ns after it starts.
  void start_next() {
    if (queue_.empty() || !runner_ || (cfg_.hang_after_jobs && num_started_ >= *cfg_.hang_after_jobs)) {
      busy_ = !queue_.empty();  // a hung device stays busy with its queue forever
      return;
    }
    ++num_started_;
    busy_ = true;
    if (cfg_.usage) cfg_.usage->running_since_ns = cfg_.usage->now_ns();
    auto [job, sink] = std::move(queue_.front());
    queue_.pop_front();
    const int64_t layer_ns = modelled_layer_ns(job, model_, cfg_);
    sink->on_started(job.job_id);
    const bool coarse = cfg_.coarse_decode && job.kind == gpu::forward_job::decode;
    auto shared_job = std::make_shared<gpu::forward_job>(std::move(job));
    if (coarse)
      step_layer(shared_job, sink, 0, layer_ns * model_.num_hidden_layers, model_.num_hidden_layers);
    else
      step_layer(shared_job, sink, 0, layer_ns, 1);
  }

  /// After `layer_ns`, layers [layer, layer + span) are done. A sequence whose inputs stream in
  /// (a gate: a cached prefix still loading) holds its layer back until the gate opens, as a GPU
  /// stream waits on an event: the gate wakes the executor when it changes (or, if it cannot,
  /// is polled every `gate_poll` of virtual time); a gate that fails, or stays shut past
  /// `gate_timeout`, fails the job, as the CPU executor's does.
  void step_layer(std::shared_ptr<gpu::forward_job> job, std::shared_ptr<gpu::executor_sink> sink, uint32_t layer,
                  int64_t layer_ns, uint32_t span, int64_t waited_ns = 0) {
    for (const auto& s : job->seqs) {
      if (!s.gate) continue;
      const auto g = s.gate->peek(layer);
      if (g == gpu::layer_gate::state::open) continue;
      if (g == gpu::layer_gate::state::failed || waited_ns >= gate_timeout.count()) {
        sink->on_failed(job->job_id, "sequence " + std::to_string(s.seq_id) + ": layer " + std::to_string(layer) +
                                         " of its cached prefix will not arrive");
        job_ended();
        return start_next();
      }
      // Whichever comes first -- the gate's change or a timeout with no change -- resumes it.
      auto resumed = std::make_shared<bool>(false);
      auto gate = s.gate;
      auto resume = [this, job, sink, layer, layer_ns, span, resumed, gate](bool timeout) {
        if (*resumed) return;
        *resumed = true;
        if (timeout) gate->notify_once({});  // drop the listener: it holds this job
        step_layer(job, sink, layer, layer_ns, span, timeout ? gate_timeout.count() : 0);
      };
      if (s.gate->notify_once([this, resume] { runner_->run_after(std::chrono::nanoseconds{0}, [resume] { resume(false); }); }))
        return runner_->run_after(gate_timeout, [resume] { resume(true); });
      return runner_->run_after(gate_poll, [this, job, sink, layer, layer_ns, span, waited_ns] {
        step_layer(job, sink, layer, layer_ns, span, waited_ns + gate_poll.count());
      });
    }
    runner_->run_after(std::chrono::nanoseconds{layer_ns}, [this, job, sink, layer, layer_ns, span] {
      // The model has one cost per layer, so a layer's KV is ready when the layer ends: the
      // sims' send starts at most one layer later than a real backend's.
      for (uint32_t l = layer; l < layer + span; ++l) {
        sink->on_layer_kv_ready(job->job_id, l);
        sink->on_layer_computed(job->job_id, l);
      }
      if (layer + span < model_.num_hidden_layers) return step_layer(job, sink, layer + span, layer_ns, span);
      std::vector<std::vector<float>> logits(job->seqs.size());
      std::vector<int32_t> tokens(job->seqs.size(), -1);
      for (size_t i = 0; i < job->seqs.size(); ++i) {
        const auto& s = job->seqs[i];
        if (!s.wants_head()) continue;
        logits[i].assign(model_.vocab_size, 0.0f);
        logits[i][static_cast<size_t>(cfg_.emitted_token) % model_.vocab_size] = 1.0f;
        if (s.sample) tokens[i] = gpu::sample_token(logits[i], *s.sample);
        if (!s.want_logits) logits[i].clear();
      }
      sink->on_done(job->job_id, {std::move(logits), std::move(tokens), {}});
      job_ended();
      start_next();
    });
  }

  void job_ended() {
    if (!cfg_.usage || cfg_.usage->running_since_ns < 0) return;
    cfg_.usage->busy_ns += cfg_.usage->now_ns() - cfg_.usage->running_since_ns;
    cfg_.usage->running_since_ns = -1;
  }

  static constexpr std::chrono::nanoseconds gate_poll{1'000'000};          // 1 ms
  static constexpr std::chrono::nanoseconds gate_timeout{30'000'000'000};  // as streamed_layers_gate's
  gpu::model_config model_;
  modelled_executor_config cfg_;
  gpu::kv_cache kv_;
  gpu::deferred_runner* runner_ = nullptr;
  std::deque<std::pair<gpu::forward_job, std::shared_ptr<gpu::executor_sink>>> queue_;
  bool busy_ = false;
  uint32_t num_started_ = 0;
};

}  // namespace

std::unique_ptr<gpu::executor> make_modelled_executor(gpu::model_config model, modelled_executor_config cfg) {
  return std::make_unique<modelled_executor>(std::move(model), cfg);
}

}  // namespace baton::sims
