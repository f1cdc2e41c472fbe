#pragma once

// Step time from per-layer profile tables measured inside a real engine (issue 8): the
// `traces/vllm_measured/profiles/` format, three CSV files per GPU and model:
//   <prefix>_dense.csv         layer,tokens,time_us        one decoder layer's dense ops by token count
//   <prefix>_attention.csv     prefill_chunk,kv_prefill,n_decode,kv_decode,time_us
//                                                          one attention layer over a mixed batch
//   <prefix>_per_sequence.csv  layer,sequences,time_us     lm_head and sampler by sequence count
// A step is num_layers x (every per-layer dense op at the step's token count + the attention
// row) + embedding + final_layernorm + lm_head + sampler, as the traces' README sums them.
// Between measured points the tables are interpolated linearly (axis by axis for attention),
// beyond the last point extrapolated from the last two. Pure: numbers in, microseconds out.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "sims/roofline.hpp"

namespace baton::sims {

/// A piecewise-linear curve through measured (x, y) points, x ascending.
struct measured_curve {
  std::vector<double> x, y;
  double at(double v) const;
};

class profile_table {
public:
  /// Reads `<prefix>_dense.csv`, `<prefix>_attention.csv` and `<prefix>_per_sequence.csv`.
  /// Empty and "file:LINE: what" on a missing file, a malformed line or a table without the
  /// rows a step needs.
  static std::optional<profile_table> load(const std::string& prefix, std::string* why);

  /// One step's time in microseconds over `num_layers` decoder layers. Sequences with one new
  /// token are decodes; longer ones are prefill chunks (their tokens are summed into the
  /// table's one prefill chunk, over their token-weighted mean prior context).
  double step_us(const std::vector<step_seq>& seqs, uint32_t num_layers) const;

  /// One attention layer (the table's axes), interpolated.
  double attention_us(double prefill_chunk, double kv_prefill, double n_decode, double kv_decode) const;

  const std::string& source() const { return source_; }

private:
  std::string source_;
  std::map<std::string, measured_curve> dense_;    ///< per op, by token count
  std::map<std::string, measured_curve> per_seq_;  ///< lm_head, sampler by sequences
  /// Attention by prefill chunk, its prior context, decode count, then a curve over decode context.
  std::map<double, std::map<double, std::map<double, measured_curve>>> attention_;
};

}  // namespace baton::sims
