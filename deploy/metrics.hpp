#pragma once

// The gateway's numbers in the Prometheus text exposition format (version 0.0.4): counters and
// histograms it records itself from every completion, plus the cluster's gauges (queues per
// rank, store occupancy) that the router reports at scrape time. Thread-safe: every
// connection of the gateway records into one registry.

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "deploy/api_keys.hpp"

namespace baton {
struct completion;
struct cluster_stats;
}  // namespace baton

namespace baton::deploy {

/// A Prometheus histogram with fixed upper bounds (seconds).
struct histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  ///< per bound, not cumulative; one more for +Inf
  double sum = 0;
  uint64_t count = 0;
  explicit histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double x);
};

class gateway_metrics {
 public:
  gateway_metrics();
  /// One HTTP answer: its route (e.g. "/v1/completions") and status code; and the API key's
  /// that asked, if any.
  void count_response(const std::string& route, int status, api_key_state* key = nullptr);
  /// The gateway's API keys, whose numbers render() shows by key (at start, and at each reload
  /// of its keys file: both on the I/O thread, as render() is, so no lock).
  void set_keys(std::vector<api_key_ptr> keys) { keys_ = std::move(keys); }
  /// One finished generation.
  void record(const completion& c);
  /// A call's first token came, `seconds` after the call arrived: observed then, so that a TTFT
  /// spike shows while it lasts, and for calls that fail afterwards too (a trial's p99 counted
  /// only the calls that finished, each once its whole generation had).
  void first_token(double seconds);
  /// Tokens a call generated before it failed (finished calls count theirs in record()).
  void count_generated(uint64_t tokens);
  /// One call that failed, by the cluster's reason (kv_capacity, ...) or its HTTP status.
  void count_failure(const std::string& reason);
  /// One call that failed `seconds` after it arrived (after count_failure with the same reason).
  void failed_after(const std::string& reason, double seconds);
  /// Everything, rendered; `cluster` may be null when the router did not answer.
  std::string render(const cluster_stats* cluster) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;
  histogram ttft_, tbt_, e2e_, kv_send_;
  std::map<std::string, histogram> rank_tbt_;  ///< tbt_ by decode rank
  /// Where a first token's time went, stage by stage (completion's *_us fields): the router's
  /// round trips, the wait for a prefill rank, the prefill, the decode rank's wait for KV.
  histogram routing_, prefill_queue_, prefill_, decode_queue_;
  histogram prompt_len_, generated_len_;  ///< tokens per request
  std::map<std::string, uint64_t> finished_;  ///< by finish_reason
  std::map<std::string, uint64_t> failures_;  ///< by reason (count_failure)
  std::map<std::string, histogram> failed_after_;  ///< by reason (failed_after)
  uint64_t prompt_tokens_ = 0, cached_tokens_ = 0, generated_tokens_ = 0, kv_bytes_ = 0, completions_ = 0;
  uint64_t migrations_ = 0, recomputed_blocks_ = 0;
  std::vector<api_key_ptr> keys_;
};

}  // namespace baton::deploy
