#pragma once

#include <cstdint>
#include <vector>

namespace baton::gpu {

struct sampling_config {
  float temperature = 0.0f;  ///< 0 = greedy (argmax, lowest id on ties)
  uint64_t seed = 0;         ///< with temperature > 0: same seed, same tokens, on any rank
};

/// Picks the token for position `position` of a sequence. The random draw depends only on
/// (seed, position), never on which rank samples or what shares the batch, so a request sampled
/// partly on a prefill rank and partly on a decode rank gets the same tokens as on one rank.
int32_t sample_token(const std::vector<float>& logits, const sampling_config& cfg, uint32_t position);

}  // namespace baton::gpu
