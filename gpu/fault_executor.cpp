#include "gpu/fault_executor.hpp"

#include <chrono>
#include <functional>
#include <thread>

namespace baton::gpu {

namespace {

/// Passes every report to `inner`; the fault sinks below override the ones they change.
class forwarding_sink : public executor_sink {
public:
  explicit forwarding_sink(std::shared_ptr<executor_sink> inner) : inner_(std::move(inner)) {}
  void on_started(uint64_t job_id) override { inner_->on_started(job_id); }
  void on_layer_kv_ready(uint64_t job_id, uint32_t layer) override { inner_->on_layer_kv_ready(job_id, layer); }
  void on_layer_computed(uint64_t job_id, uint32_t layer) override { inner_->on_layer_computed(job_id, layer); }
  void on_done(uint64_t job_id, forward_output out) override { inner_->on_done(job_id, std::move(out)); }
  void on_failed(uint64_t job_id, std::string what) override { inner_->on_failed(job_id, std::move(what)); }

protected:
  std::shared_ptr<executor_sink> inner_;
};

/// Delays the job where the inner executor reports that it starts: on the executor's thread,
/// before any compute, so the delay is the device's, not the owner's.
class slow_sink final : public forwarding_sink {
public:
  slow_sink(std::shared_ptr<executor_sink> inner, uint32_t delay_ms) : forwarding_sink(std::move(inner)), delay_ms_(delay_ms) {}
  void on_started(uint64_t job_id) override {
    std::this_thread::sleep_for(std::chrono::milliseconds{delay_ms_});
    inner_->on_started(job_id);
  }

private:
  uint32_t delay_ms_;
};

/// Announces layers up to `layer`, then fails the job at its end.
class failing_sink final : public forwarding_sink {
public:
  failing_sink(std::shared_ptr<executor_sink> inner, uint32_t layer) : forwarding_sink(std::move(inner)), layer_(layer) {}
  void on_layer_kv_ready(uint64_t job_id, uint32_t layer) override {
    if (layer <= layer_) inner_->on_layer_kv_ready(job_id, layer);
  }
  void on_layer_computed(uint64_t job_id, uint32_t layer) override {
    if (layer < layer_) inner_->on_layer_computed(job_id, layer);
  }
  void on_done(uint64_t job_id, forward_output) override {
    inner_->on_failed(job_id, "fault: the job failed in layer " + std::to_string(layer_) + " after its KV was announced");
  }

private:
  uint32_t layer_;
};

/// Finishes the job with no token and no logits.
class tokenless_sink final : public forwarding_sink {
public:
  using forwarding_sink::forwarding_sink;
  void on_done(uint64_t job_id, forward_output) override {
    inner_->on_done(job_id, {});
  }
};

/// Passes everything to `inner`, wrapping each job's sink (the fault executors below).
class wrapping_executor : public executor {
public:
  explicit wrapping_executor(std::shared_ptr<executor> inner) : inner_(std::move(inner)) {}
  const model_config& config() const override { return inner_->config(); }
  kv_cache& kv() override { return inner_->kv(); }
  void bind_runner(deferred_runner* r) override { inner_->bind_runner(r); }
  bool on_virtual_time() const override { return inner_->on_virtual_time(); }
  bool picks_every_row() const override { return inner_->picks_every_row(); }
  void stop() override { inner_->stop(); }
  std::string standing_failure() const override { return inner_->standing_failure(); }
  void on_health_change(std::function<void()> fn) override { inner_->on_health_change(std::move(fn)); }
  bool rejoin_group(std::shared_ptr<expert_peers> peers, std::string* why) override {
    return inner_->rejoin_group(std::move(peers), why);
  }
  bool rejoin_pending() const override { return inner_->rejoin_pending(); }
  bool replace_experts(std::shared_ptr<expert_group> group, std::string* why) override {
    return inner_->replace_experts(std::move(group), why);
  }

protected:
  std::shared_ptr<executor> inner_;
};

/// Wraps the sink of every prefill job (more than one row, of kind prefill) with `wrap`; decode steps pass.
class fault_prefill_executor final : public wrapping_executor {
public:
  using wrap_fn = std::function<std::shared_ptr<executor_sink>(std::shared_ptr<executor_sink>)>;
  fault_prefill_executor(std::shared_ptr<executor> inner, std::string fault, wrap_fn wrap)
    : wrapping_executor(std::move(inner)), fault_(std::move(fault)), wrap_(std::move(wrap)) {}
  std::string describe() const override { return inner_->describe() + " (fault: " + fault_ + ")"; }
  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override {
    // A prompt's rows: a job of more than one row that is no decode step (a decode step may hold
    // several sequences, or one with speculative drafts).
    size_t rows = 0;
    for (const auto& s : job.seqs) rows += s.tokens.size();
    if (rows > 1 && job.kind == forward_job::prefill) sink = wrap_(std::move(sink));
    inner_->submit(std::move(job), std::move(sink));
  }

private:
  std::string fault_;
  wrap_fn wrap_;
};

class fault_slow_executor final : public wrapping_executor {
public:
  fault_slow_executor(std::shared_ptr<executor> inner, uint32_t delay_ms)
    : wrapping_executor(std::move(inner)), delay_ms_(delay_ms) {}
  std::string describe() const override {
    return inner_->describe() + " (fault: +" + std::to_string(delay_ms_) + " ms per job)";
  }
  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override {
    inner_->submit(std::move(job), std::make_shared<slow_sink>(std::move(sink), delay_ms_));
  }

private:
  uint32_t delay_ms_;
};

}  // namespace

std::shared_ptr<executor> make_fault_slow_executor(std::shared_ptr<executor> inner, uint32_t delay_ms) {
  return std::make_shared<fault_slow_executor>(std::move(inner), delay_ms);
}

std::shared_ptr<executor> make_fault_failing_prefill_executor(std::shared_ptr<executor> inner, uint32_t layer) {
  return std::make_shared<fault_prefill_executor>(
      std::move(inner), "prefill jobs fail in layer " + std::to_string(layer),
      [layer](std::shared_ptr<executor_sink> s) { return std::make_shared<failing_sink>(std::move(s), layer); });
}

std::shared_ptr<executor> make_fault_tokenless_prefill_executor(std::shared_ptr<executor> inner) {
  return std::make_shared<fault_prefill_executor>(std::move(inner), "prefill jobs bring no token",
                                                  [](std::shared_ptr<executor_sink> s) {
                                                    return std::make_shared<tokenless_sink>(std::move(s));
                                                  });
}

}  // namespace baton::gpu
