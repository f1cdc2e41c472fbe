#pragma once

// The executor interface: the model on one device (or CPU threads), driven asynchronously.
//
// An actor submits a forward job and returns at once; the executor runs it on its own threads
// (or, when modelled, on virtual time) and reports through the job's sink. Nothing here knows
// about CAF, so the same executors serve the runtime, tests, benchmarks and sims.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gpu/kv_cache.hpp"
#include "gpu/model_config.hpp"
#include "gpu/forward_output.hpp"
#include "gpu/sampling.hpp"

namespace baton::gpu {

/// Lets a job compute a layer only once its inputs from elsewhere are in place: the seed's
/// store -> host pipeline (seed 000 §2.3), where the cached prefix's layer l is still arriving
/// while layer l - 1 is computed. wait() is called on the executor's thread before a layer's
/// attention reads the KV; false means the inputs will never come (the job then fails).
class layer_gate {
public:
  virtual ~layer_gate() = default;
  virtual bool wait(uint32_t layer) const = 0;
  /// Without blocking: may layer `layer` run now (open), never (failed), or not yet (pending)?
  /// Executors on virtual time (sims) poll this instead of waiting. The default blocks in wait().
  enum class state { open, pending, failed };
  virtual state peek(uint32_t layer) const { return wait(layer) ? state::open : state::failed; }
  /// Calls `fn` once, the next time the gate opens further or fails (on the thread that opens
  /// it), so such executors need not poll. False: this gate cannot tell (poll it).
  virtual bool notify_once(std::function<void()> /*fn*/) const { return false; }
};

/// The usual gate: layers open in order as their inputs arrive (open_through), or all at once
/// fail (abort). A wait gives up after `timeout` so an owner that vanished without aborting
/// cannot hang the executor.
class streamed_layers_gate final : public layer_gate {
public:
  explicit streamed_layers_gate(std::chrono::milliseconds timeout = std::chrono::seconds{30}) : timeout_(timeout) {}
  bool wait(uint32_t layer) const override {
    std::unique_lock<std::mutex> lock{mutex_};
    cv_.wait_for(lock, timeout_, [&] { return aborted_ || layer < open_; });
    return !aborted_ && layer < open_;
  }
  state peek(uint32_t layer) const override {
    std::lock_guard<std::mutex> lock{mutex_};
    return aborted_ ? state::failed : layer < open_ ? state::open : state::pending;
  }
  bool notify_once(std::function<void()> fn) const override {
    std::lock_guard<std::mutex> lock{mutex_};
    listener_ = std::move(fn);
    return true;
  }
  /// Layers [0, layers) may run.
  void open_through(uint32_t layers) {
    std::function<void()> listener;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      if (layers <= open_) return;
      open_ = layers;
      listener.swap(listener_);
    }
    cv_.notify_all();
    if (listener) listener();
  }
  void abort() {
    std::function<void()> listener;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      aborted_ = true;
      listener.swap(listener_);
    }
    cv_.notify_all();
    if (listener) listener();
  }

private:
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  uint32_t open_ = 0;
  bool aborted_ = false;
  mutable std::function<void()> listener_;
};

/// One sequence's part of a forward pass: `tokens` at positions start_pos, start_pos+1, ...
/// Prefill chunks have many tokens; decode steps have one.
struct forward_seq {
  uint64_t seq_id = 0;             ///< the request id, for error messages and logs
  std::vector<int32_t> tokens;
  uint32_t start_pos = 0;          ///< tokens already in this sequence's KV (cached prefix)
  std::vector<uint32_t> pages;     ///< KV pages covering positions [0, start_pos + tokens.size())
  bool want_logits = true;         ///< logits of the last token are returned
  std::shared_ptr<const layer_gate> gate = nullptr;  ///< when set, layer l's attention waits for gate->wait(l)
  /// When set, the executor also picks the token after the last one (on_done's tokens), whether
  /// or not it returns the logits: the CUDA backend then keeps greedy rows' logits on the device.
  std::optional<seq_sampling> sample = std::nullopt;
  /// Prompt scoring (echo with log-probabilities): for each row i whose score_targets[i] >= 0,
  /// the log-probability of that token after row i, under the raw logits (no temperature or
  /// penalty), with the score_top (<= max_top_logprobs) most likely tokens (forward_output::scores).
  /// Empty: no row is scored. Otherwise one entry per row.
  std::vector<int32_t> score_targets = {};
  uint32_t score_top = 0;
  /// Speculative decoding (actors/decode_rank.cpp): the rows after the first are draft tokens,
  /// and the executor also picks the token after each row but the last, entry r by row_samples[r]
  /// (forward_output::row_tokens); the last row's pick is `sample`'s. Empty: only the last row
  /// is picked. Only for executors whose picks_every_row() is true. The entries carry no history
  /// and no grammar: a penalised pick after row r reads `sample`'s history up to and including
  /// row r's token (a step's rows share one copy of a long history).
  std::vector<seq_sampling> row_samples = {};
  /// Whether the job computes this sequence's last-token logits at all.
  bool wants_head() const { return want_logits || sample.has_value(); }
};

/// A batch: rows of all sequences go through each matrix product together.
struct forward_job {
  enum kind_t : uint8_t { prefill, decode };
  uint64_t job_id = 0;
  std::vector<forward_seq> seqs;
  kind_t kind = prefill;  ///< the math is the same; cost models and logs tell them apart
};

/// Where an executor reports. Calls come from the executor's own thread (CPU backend), a CUDA
/// host callback (CUDA backend) or the owner's thread (modelled backend), in this order per job:
/// on_started; for each layer l, on_layer_kv_ready(l) then on_layer_computed(l); then on_done or
/// on_failed. Implementations must be thread-safe and must not block.
class executor_sink {
public:
  virtual ~executor_sink() = default;
  /// The job leaves the queue and starts computing (queueing time ends here).
  virtual void on_started(uint64_t /*job_id*/) {}
  /// Layer `layer` of every sequence in the job has its KV written, and any cached prefix the
  /// job waited for has landed in that layer: a sender may ship it now. The rest of the layer
  /// (attention, MLP) is still to compute, so a send posted here hides under it: the KV a layer
  /// writes is final once its keys are rotated. (vLLM's layer-wise connectors save a layer after
  /// its attention; this is earlier still.)
  virtual void on_layer_kv_ready(uint64_t job_id, uint32_t layer) = 0;
  /// Layer `layer` has finished computing (timelines and logs). The CUDA backend does not
  /// report it: nothing on its host side knows when a kernel ends without a synchronisation.
  virtual void on_layer_computed(uint64_t /*job_id*/, uint32_t /*layer*/) {}
  /// The job's logits, picked tokens and their log-probabilities, by sequence (forward_output).
  virtual void on_done(uint64_t job_id, forward_output out) = 0;
  virtual void on_failed(uint64_t job_id, std::string what) = 0;
};

/// Runs callbacks later on the owner's timeline. The owning actor implements it with timers,
/// so a modelled executor advances virtual time under CAF's test coordinator. Callbacks run on
/// the owner's thread.
class deferred_runner {
public:
  virtual ~deferred_runner() = default;
  virtual void run_after(std::chrono::nanoseconds delay, std::function<void()> fn) = 0;
};

class expert_group;
class expert_peers;

class executor {
public:
  virtual ~executor() = default;
  virtual const model_config& config() const = 0;
  /// The KV pool this executor computes into. Its allocator belongs to the owning actor.
  virtual kv_cache& kv() = 0;
  /// A short description for logs ("cpu x2 threads", "modelled").
  virtual std::string describe() const = 0;
  /// Queues the job; jobs run in submission order. Never blocks on compute.
  virtual void submit(forward_job job, std::shared_ptr<executor_sink> sink) = 0;
  /// Whether jobs may carry forward_seq::row_samples (a pick after every row, for speculative
  /// decoding). Executors that cannot refuse such a job.
  virtual bool picks_every_row() const { return false; }
  /// Gives a modelled executor its timeline; real executors ignore it.
  virtual void bind_runner(deferred_runner*) {}
  /// A modelled executor on virtual time (sims): work its owner would hand to a thread of its own
  /// runs inline instead, as no real thread takes part in virtual time.
  virtual bool on_virtual_time() const { return false; }
  /// Ends the executor's threads (idempotent): no job runs and no callback fires afterwards,
  /// while the KV pool stays valid until the executor is destroyed. Owners call it before they
  /// take the pool away from a transport (actors/executor_bridge.cpp).
  virtual void stop() {}
  /// Non-empty while this executor can run no job at all, saying why (a data-parallel group out
  /// of step, or one of its members gone): its rank then refuses new work, and what it was running
  /// fails over, so that requests go to other ranks. Thread-safe.
  virtual std::string standing_failure() const { return {}; }
  /// Calls `fn` on the executor's own thread when standing_failure() changes while it is idle or
  /// between jobs: once when it turns non-empty, so its rank can step aside before a request
  /// finds out, and once when it clears (the executor rejoined a re-formed group), so the rank
  /// takes work again. One listener: a later registration replaces the earlier. Executors that
  /// cannot fail so ignore it.
  virtual void on_health_change(std::function<void()> /*fn*/) {}
  /// Data-parallel attention: this executor's group broke (standing_failure() says how) and met
  /// afresh as `peers`, whose store already holds its experts, or is filled here from this
  /// executor's weights. The executor switches between jobs, on its own thread, and its standing
  /// failure clears then. False and a sentence when it is in no group, its group has not broken,
  /// it has stopped, or an earlier rejoin is still pending.
  virtual bool rejoin_group(std::shared_ptr<expert_peers> /*peers*/, std::string* why) {
    *why = "this executor is in no data-parallel group";
    return false;
  }
  /// Whether a group rejoin_group or replace_experts gave is not yet switched to (the executor
  /// is mid-job).
  virtual bool rejoin_pending() const { return false; }
  /// Expert parallelism with shards (the attention-lead form): a shard of this executor's group
  /// is out for good (standing_failure() says so), and `group` is a new one with live shards,
  /// started by the owner (deploy::expert_group_keeper). The executor switches to it on its own
  /// thread, between jobs or while idle; its standing failure then clears and the rank takes
  /// work again. The old group is dropped there (its deleter stops its shards). False and a
  /// sentence when it has no shards, its group has not failed, it has stopped, or an earlier
  /// replacement is still pending.
  virtual bool replace_experts(std::shared_ptr<expert_group> /*group*/, std::string* why) {
    *why = "this executor has no expert shards";
    return false;
  }
};

/// Jobs come from actors that validated requests, but a wrong page table would scribble over
/// another request's KV: every executor refuses such a job with this message naming the
/// sequence (empty when the job is sound).
std::string check_forward_job(const forward_job& job, const model_config& cfg, const kv_layout& layout);

/// How the CPU executor is built.
struct cpu_executor_config {
  unsigned num_threads = 1;      ///< threads doing math (one of them also runs the job queue)
  uint32_t num_kv_pages = 512;
  uint32_t page_size_tokens = 16;
  /// Expert parallelism (gpu/expert_parallel.hpp): MoE layers dispatch to this group's expert
  /// shards; null runs every expert here. One group per executor.
  std::shared_ptr<expert_group> experts{};
  /// Data-parallel attention (expert_peers): this executor is one member of a group that serves
  /// each other's MoE layers in lockstep; null: not in one. Not with `experts`.
  std::shared_ptr<expert_peers> peers{};
  /// Where the KV pool's pages come from; empty: the heap. A rank behind UCX takes them from its
  /// transport, so peers store incoming KV into them directly (actors/executor_bridge.hpp).
  kv_memory_source kv_memory{};

  std::string validate() const;
};

}  // namespace baton::gpu
