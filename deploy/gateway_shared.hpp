#pragma once

// What the gateway's server broker and its connections share (gateway.cpp: the connections,
// gateway_server.cpp: the server and the gateway's public functions). Internal to the gateway.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_addr.hpp>
#include <caf/atom.hpp>
#include <caf/behavior.hpp>
#include <caf/io/connection_handle.hpp>
#include <caf/io/fwd.hpp>

#include "deploy/gateway.hpp"
#include "deploy/gateway_call.hpp"
#include "deploy/metrics.hpp"

namespace baton::deploy {

/// A connection's timer, kept by the server (wake_later).
using wake_atom = caf::atom_constant<caf::atom("wake")>;
using wake_due_atom = caf::atom_constant<caf::atom("wakedue")>;
using wake_forget_atom = caf::atom_constant<caf::atom("wakeforget")>;
/// gateway_router_lost, gateway_set_router: the router went away, or here is one.
using router_lost_atom = caf::atom_constant<caf::atom("rtrlost")>;
using router_set_atom = caf::atom_constant<caf::atom("rtrset")>;
/// The server's look at its keys file (gateway_config::keys_file).
using keys_poll_atom = caf::atom_constant<caf::atom("keyspoll")>;
/// The server's look at whether the router still answers (gateway_config::router_silence_ms).
using router_probe_atom = caf::atom_constant<caf::atom("rtrprobe")>;

/// /health's answer for the cluster's numbers (null: the router did not answer): 200 and its
/// JSON when it can answer calls, else 503 and why.
std::pair<int, std::string> cluster_health(const cluster_stats* s);

/// What every connection of one gateway shares.
struct gateway_shared {
  gateway_config cfg;
  router_actor router;
  std::string model;
  uint32_t context_tokens = 0;  ///< the model's context, as the router says (/v1/models' max_model_len)
  call_settings calls;
  int64_t started_s = 0;
  /// Drawn at start: call ids of gateways started in the same second differ (they repeated).
  std::string id_prefix;
  gateway_metrics metrics;
  std::vector<api_key_ptr> keys;  ///< cfg's keys, named, with their live numbers (empty: no authentication)
  std::atomic<uint32_t> num_connections{0};
  std::atomic<uint64_t> last_id{0};
  // The server's and its connections' (brokers all run on the middleman's one thread).
  /// Shutting down (drain_gateway): calls and /health get 503, connections close after their
  /// answer, and the calls in progress run to their end.
  bool draining = false;
  /// Non-empty while the router is gone (its head stopped, or the link to it was cut): why, for
  /// the 503s that calls get until gateway_set_router.
  std::string router_away;
  /// router_away says the router has not answered (the server's probe, gateway_config::
  /// router_silence_ms): cleared by its next answer, unlike a router that went away.
  bool router_silent = false;
  std::atomic<uint32_t> calls_in_flight{0};  ///< connections with a call between generate and end_call
  caf::actor_addr server;  ///< the listening broker (weak: it holds this struct), which keeps connections' timers
  std::atomic<uint64_t> out_pending{0};  ///< every connection's answers queued unsent, together (max_total_backlog_bytes)
  uint64_t last_connection = 0;  ///< numbers connections for the server's timers (brokers share one thread)
};

/// A connection's broker, forked by the server for each client.
caf::behavior gateway_connection(caf::io::broker* self, caf::io::connection_handle hdl, std::shared_ptr<gateway_shared> g,
                                 caf::actor server);

}  // namespace baton::deploy
