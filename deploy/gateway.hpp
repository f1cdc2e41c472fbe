#pragma once

// The OpenAI-compatible HTTP gateway: an actor (a CAF broker per connection) that messages the
// router like any other client. Routes: POST /v1/completions and /v1/chat/completions (with
// "stream": true as server-sent events), GET /v1/models, /health and /metrics (Prometheus).
// With API keys configured, every route but /health needs "Authorization: Bearer <key>".

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "deploy/api_keys.hpp"
#include "deploy/http.hpp"

namespace caf {
class actor_system;
}

namespace baton::deploy {

struct gateway_config {
  std::string host = "127.0.0.1";  ///< where to listen
  uint16_t port = 8000;            ///< 0 = any free port
  std::vector<std::string> api_keys;  ///< plain keys, named key-1, key-2, ... (none here or in named_keys: no authentication)
  std::vector<api_key> named_keys;    ///< a keys file's (--api-keys-file): names and limits (deploy/api_keys.hpp)
  /// That file, when named_keys came from one: looked at every keys_poll_ms, and read again when it
  /// changed (a key added, rotated, removed, a limit changed) without a restart; a version that
  /// does not read is refused (logged), the keys staying as they were. Empty: not watched.
  std::string keys_file;
  uint32_t keys_poll_ms = 2000;
  /// The file's stamp when named_keys were read from it (api_keys.hpp's file_stamp): a change
  /// between that read and the gateway's start is read again at its first look.
  std::string keys_file_stamp;
  http::limits limits;
  /// A call whose first token has not come within this long is cancelled with 504. Only the
  /// first: once tokens flow, the request's own watchdog bounds each next one
  /// (request_config::token_timeout_ms), so a long generation is never cut for its length.
  uint32_t first_token_timeout_ms = 600000;
  /// A streaming call still waiting for its first token this long (in the KV queue, behind long
  /// prompts) gets its 200 head and then an SSE comment line this often, so that a proxy or load
  /// balancer does not cut it as idle (ALB's and nginx's 60 s); a failure after that comes as the
  /// stream's error event, as one after the first token does. 0: nothing before the first token.
  uint32_t stream_keepalive_ms = 15000;
  uint32_t max_connections = 1024;       ///< beyond: 503 and close (16 more for /health and /metrics alone)
  /// A connection with no request in progress that completes none for this long is closed.
  uint32_t idle_timeout_ms = 60000;
  /// A stream's events not yet sent beyond this (in the connection's write buffer, the socket's
  /// being full): the client reads far slower than the stream is made (it reads, so the idle
  /// limit never comes), and its call and connection are dropped (499) instead of its events
  /// piling up in memory.
  uint64_t max_stream_backlog_bytes = uint64_t{32} << 20;
  /// The same over every connection together: past it, a stream whose client has more than 1 MiB
  /// waiting unread is dropped (499). Without it, 1,024 slow readers could hold 32 GiB.
  uint64_t max_total_backlog_bytes = uint64_t{512} << 20;
  /// A request actor already ended when the gateway first looked (CAF reports exit_reason
  /// unknown) may still have its answer on the wire behind that report: the call waits this long
  /// for it before failing with 503.
  uint32_t unanswered_grace_ms = 5000;
  /// The router is asked for its numbers every quarter of this; when it has not answered for this
  /// long (its head stalled, or a partition that leaves the TCP link open), new calls get 503 at
  /// once, saying so, until it answers again -- they waited in silence up to the first-token
  /// timeout. 0: not watched.
  uint32_t router_silence_ms = 5000;
  /// The model's id in the API (`model` in calls and answers, /v1/models), as vLLM's
  /// --served-model-name; empty: the model's own name (config.json's _name_or_path, else its
  /// architecture). Calls naming another model get 404.
  std::string served_model_name;
  /// Browser origins (`https://app.example.com`, or `*` for any) whose pages may call the API:
  /// their CORS preflights (OPTIONS) are answered, and answers carry
  /// Access-Control-Allow-Origin. Empty: none (OPTIONS still answers with what a route allows).
  std::vector<std::string> cors_origins;
  /// A line per call on standard output as it ends (deploy/access_log.hpp): its id, status,
  /// time, and each generation's router request, ranks, tokens and stage times.
  bool log_requests = false;
  /// With log_requests: each generation's placement reasons in its line (`--explain`).
  bool log_placements = false;
  std::string validate() const;
};

struct gateway_handle {
  caf::actor server;   ///< the listening broker; send it exit to stop
  uint16_t port = 0;   ///< the port it listens on
  std::string keys;    ///< its API keys and their limits, as its start line tells them (empty: none)
};

/// Listens on cfg.host:cfg.port and serves until the returned server is stopped. The model's
/// name for /v1/models comes from the router (asked once here, blocking for at most 10 s).
bool spawn_gateway(caf::actor_system& sys, const gateway_config& cfg, router_actor router, gateway_handle* out,
                   std::string* why);

/// Shutting down gracefully: from now on calls and /health get 503 (so load balancers and
/// clients' retries go elsewhere) and connections close after their answer, while the calls in
/// progress run to their end. Waits until none is left, `grace` has passed, or `give_up` says so
/// (a second SIGTERM); returns how many were still running.
uint32_t drain_gateway(caf::actor_system& sys, const gateway_handle& gw, std::chrono::milliseconds grace,
                       const std::function<bool()>& give_up = {});

/// The router is gone (its head stopped or was cut off): the gateway keeps its port, and calls
/// and /health get 503 with `why` until gateway_set_router.
void gateway_router_lost(const gateway_handle& gw, std::string why);

/// Serves through `router` from now on (a head that came back), with its model and settings;
/// false, with why, when it does not answer within 10 s.
bool gateway_set_router(caf::actor_system& sys, const gateway_handle& gw, router_actor router, std::string* why);

}  // namespace baton::deploy
