#pragma once

// Log-probabilities on the wire: what executors report with a picked token (gpu::token_logprobs,
// inside gpu::forward_output) and what clients get (token_logprob, with texts). Included by
// messages.hpp.

#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>

#include "actors/wire_float.hpp"
#include "gpu/forward_output.hpp"

namespace baton::gpu {
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_logprobs& x) {
  return f(caf::meta::type_name("token_logprobs"), wire::f32{&x.logprob}, x.top_tokens, wire::f32s{&x.top_logprobs},
           x.rank);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, forward_output& x) {
  return f(caf::meta::type_name("forward_output"), wire::f32_rows{&x.logits}, x.tokens, x.logprobs, x.scores);
}
}  // namespace baton::gpu

namespace baton {

/// One generated token's log-probability and the most likely tokens' at its step
/// (generate_request::logprobs), with their texts, as clients get them.
struct token_logprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::string text;  ///< the token decoded alone: may hold part of a UTF-8 character
  std::vector<int32_t> top_tokens;
  std::vector<float> top_logprobs;
  std::vector<std::string> top_texts;
  uint32_t rank = 0;  ///< 1 + the tokens more likely at its step (gpu::token_logprobs::rank)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_logprob& x) {
  return f(caf::meta::type_name("token_logprob"), x.token, wire::f32{&x.logprob}, x.text, x.top_tokens,
           wire::f32s{&x.top_logprobs}, x.top_texts, x.rank);
}

}  // namespace baton
