#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/config.hpp"
#include "actors/messages.hpp"
#include "actors/text_stream.hpp"
#include "actors/store_access.hpp"
#include "gpu/tokenizer.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// What the router counts that only its requests see (cluster_stats::num_admitted,
/// num_failovers and failed_codes): requests admitted, counted as each passes, so that the count
/// never goes back (a Prometheus counter); re-placements as each starts -- a failed request's too, which a count summed
/// over finished requests never saw -- and requests that failed, by their error's code, whatever
/// client sent them (the gateway counts only its own calls).
struct request_counters {
  std::atomic<uint64_t> admitted{0};  ///< requests that passed admission (request_plan::admission)
  std::atomic<uint64_t> failovers{0};
  std::array<std::atomic<uint64_t>, 32> failed{};  ///< by errc's value
};

/// Everything a request actor is born with: its validated tokens (or what it needs to make them)
/// and whom to ask for placement.
struct request_plan {
  uint64_t request_id = 0;
  std::vector<int32_t> prompt_tokens;
  generate_request params;
  prefill_balancer_actor prefill_balancer;
  decode_balancer_actor decode_balancer;
  int32_t eos_token_id = -1;
  request_config cfg;
  store_access store;  ///< off by default: no CHECK, no prefix loading, no write-back
  std::shared_ptr<const gpu::tokenizer> tokenizer;  ///< decodes the completion's text (null: bytes)
  std::vector<int32_t> extra_eos_token_ids;         ///< also end the sequence (unless ignore_eos)
  client_sink_actor sink;  ///< streaming: receives stream_chunks (null: the completion only)
  uint8_t prompt_thinking = 0;  ///< completion::prompt_thinking, as the router rendered the chat
  /// Set: `prompt_tokens` is empty and `params` not yet checked; the request actor tokenizes and
  /// checks it first (tokenize_and_validate), on its own, and answers a bad one with
  /// errc::bad_request (also its exit reason, which the router counts). The router's one thread
  /// did this for every request, and a 640 KB prompt (90 ms of tokenizing) held every other
  /// request's admission that long.
  struct admission {
    std::shared_ptr<const gpu::model_config> model;
    uint32_t max_new_tokens_limit = 0;
    uint32_t default_max_tokens = 0;
  };
  std::optional<admission> admit;
  /// The router's counts, kept by its requests as things happen (cluster_stats): null in tests
  /// that make plans by hand.
  std::shared_ptr<request_counters> counters;
};

/// The request's sampling settings and log-probability asks, as both order kinds carry them.
template <class Order>
void copy_sampling(const request_plan& p, Order& order) {
  order.top_k = p.params.top_k;
  order.top_p = p.params.top_p;
  order.repetition_penalty = p.params.repetition_penalty;
  order.presence_penalty = p.params.presence_penalty;
  order.frequency_penalty = p.params.frequency_penalty;
  order.output_from = static_cast<uint32_t>(p.prompt_tokens.size());
  order.logprobs = p.params.logprobs;
  order.top_logprobs = p.params.top_logprobs;
  order.logit_bias_tokens = p.params.logit_bias_tokens;
  order.logit_bias_values = p.params.logit_bias_values;
  order.min_p = p.params.min_p;
  order.min_tokens = p.params.min_tokens;
  if (p.params.min_tokens > 0) {
    order.end_tokens = p.params.stop_token_ids;
    if (!p.params.ignore_eos) {  // then <eos> and the model's other end tokens end nothing
      order.end_tokens.insert(order.end_tokens.end(), p.extra_eos_token_ids.begin(), p.extra_eos_token_ids.end());
      order.end_tokens.push_back(p.eos_token_id);
    }
  }
  // The router checked the constraint and compiled it with the same options.
  const auto& q = p.params;
  if (q.output_format != 0) {
    order.grammar = {q.output_format, q.output_spec, p.prompt_thinking == 1, q.json_compact, p.extra_eos_token_ids};
    order.grammar.end_tokens.insert(order.grammar.end_tokens.begin(), p.eos_token_id);
  }
}

/// One request's state machine. With a sink it streams chunks as tokens come; cancel_atom, or
/// the sink going down, ends it with errc::cancelled. It answers `run` exactly once: with the completion, or with an
/// error naming the request, the rank and the stage that failed. Every hop has a deadline; it
/// releases any KV lease it holds on every failure path.
request_actor spawn_request(caf::actor_system& sys, request_plan plan);

}  // namespace baton
