#pragma once

#include <cstdint>
#include <vector>

#include "gpu/sampling.hpp"

namespace baton::gpu {

/// What a finished forward job gives back (executor_sink::on_done), by sequence: index i is the
/// job's sequence i.
struct forward_output {
  std::vector<std::vector<float>> logits;  ///< last-token logits (empty where not wanted)
  std::vector<int32_t> tokens;             ///< the token picked (forward_seq::sample), or -1
  /// The pick's log-probabilities where seq_sampling::want_logprobs (empty entries elsewhere);
  /// empty as a whole when no sequence wanted them.
  std::vector<token_logprobs> logprobs;
  /// Prompt scoring (forward_seq::score_targets): scores[s] has one entry per scored row of
  /// sequence s, in row order; empty as a whole when no sequence asked.
  std::vector<std::vector<token_logprobs>> scores{};
  /// Speculative decoding (forward_seq::row_samples): row_tokens[s][r] is the pick after row r of
  /// sequence s, and row_logprobs[s][r] its log-probabilities where asked; both empty as a whole
  /// when no sequence had row_samples.
  std::vector<std::vector<int32_t>> row_tokens{};
  std::vector<std::vector<token_logprobs>> row_logprobs{};
};

/// The rows of `targets` that are scored (target >= 0), counted.
inline size_t scored_rows(const std::vector<int32_t>& targets) {
  size_t n = 0;
  for (auto t : targets) n += t >= 0;
  return n;
}

}  // namespace baton::gpu
