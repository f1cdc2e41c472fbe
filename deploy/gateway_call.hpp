#pragma once

// A gateway call's go-between: the actor between one HTTP call and the router, which parses the
// body, asks for each choice, and renders chunks and answers as OpenAI's JSON for the connection
// (deploy/gateway.cpp) to frame and write. Included by gateway.cpp and gateway_call.cpp only.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <caf/actor.hpp>

#include "actors/messages.hpp"
#include "deploy/api_keys.hpp"

namespace caf {
class actor_system;
}

namespace baton::deploy {

/// A call's go-between saw its first chunk: the call's first-token deadline and its keepalive no
/// longer apply (a scoring call's one chunk holds no generated token, and ends the call).
using token_seen_atom = caf::atom_constant<caf::atom("toknseen")>;
/// ... and its first generated token (with the router's number of its request): TTFT is timed.
using first_token_atom = caf::atom_constant<caf::atom("firsttok")>;
/// A call's go-between read a streaming call: until its first token the gateway keeps the
/// connection busy (gateway_config::stream_keepalive_ms).
using streaming_atom = caf::atom_constant<caf::atom("streaming")>;

/// What every call's go-between is told of the gateway and the model (fixed once it starts).
struct call_settings {
  std::chrono::milliseconds unanswered_grace{0};  ///< gateway_config::unanswered_grace_ms
  uint8_t chat_reasoning = 0;   ///< cluster_stats': how chat answers carry reasoning (gpu::chat_reasoning)
  uint8_t chat_tool_calls = 0;  ///< cluster_stats': how answers write tool calls (gpu::tool_call_format)
  float default_temperature = 0.0f;  ///< cluster_stats': what a call without them samples with
  float default_top_p = 1.0f;
  uint32_t default_top_k = 0;
  float default_repetition_penalty = 1.0f;
  uint32_t max_active_requests = 0;  ///< cluster_stats': the router's admission limit (0: none)
  /// More names calls may give the model by (--served-model-name a,b: b), answered under the one
  /// they gave.
  std::vector<std::string> model_aliases;
};

/// Seconds since the epoch: OpenAI's `created`.
int64_t unix_seconds();

/// One call's go-between, on the scheduler's threads: it parses the body, asks the router with
/// itself as the sink (or, for n > 1 choices, with a linked actor per choice: run_choice), and
/// renders every chunk and the answer into JSON -- so the connection's thread, CAF's one I/O
/// thread serving every socket, only frames and writes bytes (a 1 MiB chat body or thousands of
/// streams' tokens do not stall the other connections). It passes what it renders to its
/// connection in the order it gets the chunks and the answer (the request actor sends its last
/// chunk before its answer; one sender keeps that order). When it exits (finish(), or the
/// connection closed) the request actors see their sinks go and stop the generation, so a call
/// that ends early (a timeout, a client gone) frees its KV at once. To the connection:
///   (seq, status, error JSON)          the body was refused
///   (seq, event JSON)                  one server-sent event of a stream
///   (seq, completions, JSON, stream)   the answer (a completion per choice): the whole body, or a stream's usage chunk ("" if none)
///   (seq, error)                       the generation failed
/// `key` (may be null): the API key that asked, whose limits the call is held to and whose
/// numbers it counts into.
caf::actor spawn_call(caf::actor_system& sys, caf::actor broker, uint64_t seq, router_actor router, std::string body,
                      bool chat, std::string model, std::string id, call_settings settings, api_key_ptr key);

}  // namespace baton::deploy
