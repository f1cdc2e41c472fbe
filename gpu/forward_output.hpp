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
};

}  // namespace baton::gpu
