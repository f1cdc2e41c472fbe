#pragma once

// Request traces for replay (issue 8): the Mooncake JSONL release (with its prefix hash ids), the
// Azure 2023 CSV traces, the measured vLLM request files (traces/README.md describes
// all three), and synthetic arrivals (Poisson, or bursty gamma) over length distributions.
// Pure: no actors, no clock. A malformed line is an error naming file and line, or, when asked,
// skipped and counted.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace baton::sims {

/// The block size of Mooncake's hash ids (its README): id k names prompt tokens [512k, 512k + 512).
inline constexpr uint32_t mooncake_block_tokens = 512;

struct trace_request {
  int64_t arrival_us = 0;          ///< from the first kept arrival (after scaling and windowing)
  uint32_t input_tokens = 0;
  uint32_t output_tokens = 0;
  std::vector<uint64_t> hash_ids;  ///< Mooncake: one chained id per mooncake_block_tokens block; else empty
  std::string id;                  ///< the trace's request id, or "line N"
  /// vLLM files: what the measured engine saw (seconds; negative when the trace has none).
  double measured_ttft_s = -1, measured_tpot_s = -1, measured_e2e_s = -1;
};

enum class trace_format { mooncake_jsonl, azure_csv, vllm_jsonl };

struct trace_options {
  bool skip_malformed = false;  ///< count and skip bad lines instead of failing
  double rate_scale = 1.0;      ///< > 1 compresses time: k times the arrival rate
  double window_start_s = 0;    ///< keep arrivals in [start, start + window) of the original trace
  double window_s = 0;          ///< 0: to the end
  size_t max_requests = 0;      ///< 0: all
  std::string validate() const;
};

struct trace {
  std::vector<trace_request> requests;  ///< in arrival order
  size_t lines = 0;                     ///< data lines read
  size_t skipped = 0;                   ///< malformed lines skipped (skip_malformed)
  std::string first_skipped;            ///< why the first one was
  /// Rows that record 0 output tokens (prefill-only requests), replayed as 1: the first token,
  /// which the prefill samples anyway. A prompt of 0 tokens is malformed (nothing to prefill).
  size_t zero_output_rows = 0;
  double span_s() const;                ///< last arrival minus first
};

/// Reads a trace; false and "source:LINE: what" on the first malformed line (unless skipping).
bool read_trace(std::istream& in, trace_format format, const std::string& source, const trace_options& opt,
                trace* out, std::string* why);
/// Opens `path`, its format from its name (.csv: Azure; *_requests.jsonl: vLLM; .jsonl: Mooncake).
bool load_trace(const std::string& path, const trace_options& opt, trace* out, std::string* why);
std::optional<trace_format> format_of(const std::string& path);

/// A length distribution for synthetic requests: fixed, uniform in [min, max], or lognormal with
/// the given mean and coefficient of variation, clamped to [min, max].
struct length_dist {
  enum kind_t { fixed, uniform, lognormal } kind = fixed;
  double mean = 512, cv = 1.0;
  uint32_t min = 1, max = 131072;
};

struct synthetic_spec {
  double rate_per_s = 1.0;
  double duration_s = 60.0;
  double arrival_cv = 1.0;  ///< 1: Poisson; > 1: bursty (gamma inter-arrivals with this cv)
  length_dist input, output;
  /// A diurnal day (elastic P/D): with period_s > 0, the arrival rate follows
  /// rate_per_s x (1 + rate_swing x sin(2 pi t / period_s)), and the workload drifts from the
  /// input/output distributions at the period's start to alt_input/alt_output half a period
  /// later and back: a request draws from the alternative with probability (1 - cos(2 pi t /
  /// period_s)) / 2.
  double period_s = 0;
  double rate_swing = 0;  ///< in [0, 1)
  length_dist alt_input, alt_output;
  uint64_t seed = 1;
  std::string validate() const;
};

/// Arrivals and lengths drawn from `spec` (deterministic for a seed on a given standard library).
trace synthetic_trace(const synthetic_spec& spec);

}  // namespace baton::sims
