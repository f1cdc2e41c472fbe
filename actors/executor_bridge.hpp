#pragma once

// Glue between CAF-free executors and the rank actors that own them: a sink that turns
// executor callbacks into messages, a deferred_runner built on actor timers, and a
// thread-safe event log. Included only by rank .cpp files.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <memory>
#include <optional>
#include <span>
#include <string>

#include <caf/actor_addr.hpp>
#include <caf/expected.hpp>
#include <caf/fwd.hpp>
#include <caf/result.hpp>

#include "actors/kv_wire_staging.hpp"
#include "actors/messages.hpp"
#include "gpu/executor.hpp"
#include "gpu/grammar.hpp"
#include "transport/transport.hpp"

namespace baton {

/// An order's sampling settings (decode and prefill orders carry the same fields).
template <class Order>
gpu::sampling_config sampling_of(const Order& o) {
  // Designated: a field added to sampling_config out of this order fails to compile rather than
  // taking its neighbour's value.
  return {.temperature = o.temperature,
          .seed = o.seed,
          .top_k = o.top_k,
          .top_p = o.top_p,
          .repetition_penalty = o.repetition_penalty,
          .presence_penalty = o.presence_penalty,
          .frequency_penalty = o.frequency_penalty,
          .output_from = o.output_from,
          .bias_tokens = o.logit_bias_tokens,
          .bias_values = o.logit_bias_values,
          .min_p = o.min_p};
}

/// The order's sampling settings for the token at `position`: min_tokens holds the end tokens
/// back only while the output is shorter, so that later steps are plain picks again (on the
/// device, for the CUDA backend).
template <class Order>
gpu::seq_sampling sampling_at(const Order& o, uint32_t position, std::shared_ptr<const gpu::grammar_matcher> grammar) {
  gpu::seq_sampling s{sampling_of(o), position, {}, o.logprobs, o.top_logprobs, std::move(grammar)};
  if (position >= o.output_from && position - o.output_from < o.min_tokens) s.cfg.banned_tokens = o.end_tokens;
  return s;
}

/// forward_seq::sample for the token at `position`: the executor picks it (on the device, for
/// greedy rows of the CUDA backend). `history` (every token before it) is copied only when
/// penalties read it.
template <class Order>
gpu::seq_sampling sample_next(const Order& o, uint32_t position, const std::vector<int32_t>& history,
                              std::shared_ptr<const gpu::grammar_matcher> grammar = nullptr) {
  auto s = sampling_at(o, position, std::move(grammar));
  if (s.cfg.penalised()) s.history = history;
  return s;
}

/// The answer's tokens a prefill order carries: after a failover, its tokens hold the output so
/// far after the request's own prompt.
inline std::span<const int32_t> answer_so_far(const prefill_order& o) {
  const size_t from = std::min<size_t>(o.output_from, o.tokens.size());
  return std::span<const int32_t>(o.tokens).subspan(from);
}

/// The most recent events in the order they happened, across threads (seq is global to the
/// log, so a gap shows where older events were dropped). Bounded: a rank serving for days keeps
/// its last `capacity` events, not all of them.
class event_log {
public:
  void set_capacity(size_t n) {
    std::lock_guard<std::mutex> lock{mutex_};
    capacity_ = std::max<size_t>(1, n);
    while (events_.size() > capacity_) events_.pop_front();
  }
  void add(rank_event ev) {
    ev.wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now().time_since_epoch())
                     .count();
    std::lock_guard<std::mutex> lock{mutex_};
    ev.seq = ++seq_;
    if (events_.size() == capacity_) events_.pop_front();
    events_.push_back(std::move(ev));
  }
  std::vector<rank_event> snapshot() const {
    std::lock_guard<std::mutex> lock{mutex_};
    return {events_.begin(), events_.end()};
  }

private:
  mutable std::mutex mutex_;
  uint64_t seq_ = 0;
  size_t capacity_ = 65536;
  std::deque<rank_event> events_;
};

/// Elastic P/D: a rank's side of role(active). Active: it takes work again (`report` tells its
/// balancer). Standby: only when `busy` is empty (else the error names the rank and the work),
/// after `release` has given back what it holds.
template <class Report, class Release>
caf::result<bool> change_role(bool active, const std::string& rank, const std::string& busy, bool* standby,
                              event_log& log, Report report, Release release) {
  if (active) {
    *standby = false;
    log.add({0, "role_active", 0, 0, 0, {}, {}});
    report();
    return true;
  }
  if (!busy.empty())
    return make_error(errc::rank_unavailable, where(0, rank, "role") + ": still busy (" + busy + "): drain it first");
  release();
  *standby = true;
  log.add({0, "role_standby", 0, 0, 0, {}, {}});
  return true;
}

/// Sends exec_done / exec_fail to the owning rank. Holds only the rank's address, so an
/// executor finishing after its rank stopped sends nothing. The layer callbacks run on the
/// executor's thread (stream order) and must be thread-safe.
class forwarding_sink : public gpu::executor_sink {
public:
  using layer_fn = std::function<void(uint64_t job_id, uint32_t layer)>;
  forwarding_sink(caf::actor_addr owner, layer_fn on_kv_ready = {}, layer_fn on_computed = {}, bool report_start = false)
    : owner_(std::move(owner)),
      on_kv_ready_(std::move(on_kv_ready)),
      on_computed_(std::move(on_computed)),
      report_start_(report_start) {}
  /// Sends exec_start only when asked (report_start): most owners do not need it.
  void on_started(uint64_t job_id) override;
  void on_layer_kv_ready(uint64_t job_id, uint32_t layer) override;
  void on_layer_computed(uint64_t job_id, uint32_t layer) override;
  void on_done(uint64_t job_id, gpu::forward_output out) override;
  void on_failed(uint64_t job_id, std::string what) override;

private:
  caf::actor_addr owner_;
  layer_fn on_kv_ready_;
  layer_fn on_computed_;
  bool report_start_;
};

/// deferred_runner on the owning actor's timers (virtual time under the test coordinator).
/// run_after and fire are called on the owner's thread only.
class timer_runner : public gpu::deferred_runner {
public:
  explicit timer_runner(caf::actor_addr owner) : owner_(std::move(owner)) {}
  void run_after(std::chrono::nanoseconds delay, std::function<void()> fn) override;
  /// Runs the callback of a timer_atom message.
  void fire(uint64_t id);

private:
  caf::actor_addr owner_;
  uint64_t last_id_ = 0;
  std::unordered_map<uint64_t, std::function<void()>> pending_;
};

/// What every rank owns: its executor, its transport endpoint with the KV pool registered, the
/// timers a modelled executor runs on, and its event log.
struct rank_core {
  std::shared_ptr<transport::transport> xport;  // declared before exec: outlives the executor thread
  std::shared_ptr<gpu::executor> exec;
  std::unique_ptr<timer_runner> runner;
  std::shared_ptr<event_log> log = std::make_shared<event_log>();
  std::optional<transport::region_key> pool_key;  ///< how peers address this rank's KV pool
  std::string setup_error;                        ///< non-empty: the rank refuses work, saying why

  /// Why the rank takes no work now: its setup failed (for good), or its executor can run
  /// nothing (a broken expert or data-parallel group); empty when it can. Reported to its
  /// balancer as rank_load::unavailable, so that nothing is placed here and what was is placed
  /// again elsewhere (rank_unavailable): a rank whose pool the transport refused registered
  /// as idle, drew the least-loaded placements, and failed each of them for good.
  std::string unavailable() const {
    if (!setup_error.empty()) return setup_error;
    return exec ? exec->standing_failure() : std::string{};
  }
  /// Buffers registered with the transport besides the pool (a decode rank's write-back
  /// staging): kept until the transport is gone, since the actor's state is destroyed first.
  std::shared_ptr<std::vector<std::shared_ptr<void>>> outlive_transport =
      std::make_shared<std::vector<std::shared_ptr<void>>>();

  /// Wire-form staging for KV handoffs, made by wire_staging() when first asked for.
  std::shared_ptr<const kv_wire_staging> wire;
  std::string wire_error;  ///< why staging could not be made (said once, not tried again)

  /// The rank's wire-form staging: made and registered with the transport on the first call;
  /// null, and `why`, when there is no memory or registration for it (the caller sends f32).
  const kv_wire_staging* wire_staging(std::string* why);

  /// Constrained decoding: the vocabulary grammars are walked over (the rank's config; null: the
  /// built-in byte model's, made at the first use).
  std::shared_ptr<const gpu::token_vocabulary> vocabulary;
  /// A matcher of the order's grammar that has followed `output` (the answer's tokens so far);
  /// null when the order has no grammar. An error (bad_request, naming `stage`) when the grammar
  /// does not compile or the output strays from it.
  caf::expected<std::shared_ptr<gpu::grammar_matcher>> follow_grammar(const output_grammar& g,
                                                                      std::span<const int32_t> output,
                                                                      const std::string& stage);

  /// Binds the executor to the actor's timers and registers the KV pool with the transport; the
  /// pool is deregistered when the actor terminates.
  void start(caf::local_actor* self, std::shared_ptr<gpu::executor> executor,
             std::shared_ptr<transport::transport> transport);
};

}  // namespace baton
