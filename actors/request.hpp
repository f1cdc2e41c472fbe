#pragma once

#include <memory>
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

/// Everything a request actor is born with: its validated tokens and whom to ask for placement.
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
};

/// One request's state machine. With a sink it streams chunks as tokens come; cancel_atom, or
/// the sink going down, ends it with errc::cancelled. It answers `run` exactly once: with the completion, or with an
/// error naming the request, the rank and the stage that failed. Every hop has a deadline; it
/// releases any KV lease it holds on every failure path.
request_actor spawn_request(caf::actor_system& sys, request_plan plan);

}  // namespace baton
