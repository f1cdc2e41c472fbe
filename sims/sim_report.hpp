#pragma once

// What a simulation run reports (issue 8): per-request outcomes in, percentiles, SLO attainment
// and a deterministic JSON document out. Pure: no actors, no clock, no wall time in the JSON (two
// runs of the same trace and configuration give byte-identical reports).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace baton::sims {

struct request_outcome {
  std::string id;
  int64_t arrival_us = 0;
  uint32_t input_tokens = 0, output_tokens = 0;
  bool ok = false;
  std::string error;           ///< why it failed (empty when ok)
  int64_t ttft_us = 0;
  int64_t e2e_us = 0;          ///< arrival -> last token
  double tpot_us = 0;          ///< (e2e - ttft) / (tokens - 1); 0 for one token
  double tbt_mean_us = 0;      ///< mean interval between tokens
  double tbt_slow10_us = 0;    ///< Mooncake's TBT: mean of the slowest 10% of intervals (at least one)
  int64_t tbt_max_us = 0;
  uint32_t cached_tokens = 0;  ///< prompt tokens loaded instead of computed
  uint32_t failovers = 0;
  std::string prefill_rank, decode_rank;
};

/// Fills the TBT summaries of `o` from a request's intervals.
void summarize_intervals(const std::vector<int64_t>& tbt_us, request_outcome* o);

struct percentiles {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  size_t count = 0;
};
/// Linear interpolation between closest ranks (as traces/README.md computes them).
percentiles percentiles_of(std::vector<double> values);

struct slo {
  double ttft_ms = 2000;
  double tbt_ms = 100;  ///< on Mooncake's TBT (slowest 10% of a request's intervals)
};

struct sim_summary {
  size_t requests = 0, completed = 0, failed = 0;
  percentiles ttft_ms, tbt_ms, tpot_ms, e2e_ms;  ///< over completed requests; tbt: Mooncake's
  double slo_attainment = 0;   ///< fraction of all requests that completed within both SLOs
  double cache_hit_ratio = 0;  ///< cached prompt tokens / prompt tokens, of completed requests
  double span_s = 0;           ///< first arrival -> last completion (virtual)
  double output_tokens_per_s = 0, requests_per_s = 0;
  uint64_t failovers = 0;
  std::map<std::string, uint64_t> prefill_requests, decode_requests;  ///< per rank
  std::map<std::string, uint64_t> errors;                              ///< first words of each failure
};

sim_summary summarize(const std::vector<request_outcome>& outcomes, const slo& s);

/// One rank over virtual time, sampled every interval: how much of the interval its (modelled)
/// GPU was occupied, and its queues at the end of the interval.
struct rank_timeline {
  std::string rank;
  std::vector<double> busy;     ///< fraction of each interval (gate waits count: the device is held)
  std::vector<double> running;  ///< decode: sequences in the batch; prefill: prompts in progress
  std::vector<double> waiting;  ///< decode: leases not yet decoding; prefill: queued chunks
  std::vector<double> kv_used;  ///< fraction of the KV pages in use
};

struct timeline {
  double interval_s = 10;
  std::vector<rank_timeline> ranks;  ///< prefill ranks, then decode ranks
};

/// A number as a person types it (2000, 0.05; "%g"), not std::to_string's 2000.000000: for the
/// report's config and the sims' messages.
std::string as_typed(double x);

/// The report as JSON: `config` (whatever the caller records: key -> value), the summary,
/// `extra` numbers (events processed, ...) and, if given, the ranks' timeline. Fixed key order
/// and number formatting; a non-finite number is null.
std::string report_json(const std::map<std::string, std::string>& config, const sim_summary& s,
                        const std::map<std::string, double>& extra, const timeline* tl = nullptr);

}  // namespace baton::sims
