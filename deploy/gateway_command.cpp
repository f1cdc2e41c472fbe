// `baton gateway`: the OpenAI-compatible HTTP gateway in its own process, a client of a router
// that another process publishes (`baton local --serve --router-listen`, or `baton launch`).

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/utc_stamp.hpp"
#include "deploy/flags.hpp"
#include "deploy/gateway.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

bool api_keys_from_env(std::vector<std::string>* keys, std::string* why) {
  const char* v = std::getenv("BATON_API_KEYS");  // comma-separated; kept off command lines (ps)
  if (!v) return true;
  // Set but holding no key (an empty variable, a script's unset substitution): no key would mean
  // no authentication, which nobody who set it asked for.
  size_t found = 0;
  for (auto& k : split_list(v)) {
    const auto first = k.find_first_not_of(" \t"), last = k.find_last_not_of(" \t");
    if (first == std::string::npos) continue;  // "a, ,b": the blank one is a typo, not a key
    keys->push_back(k.substr(first, last - first + 1));  // "k1, k2": a client sends "k2"
    ++found;
  }
  if (found == 0) {
    *why = "BATON_API_KEYS is set but holds no key (give comma-separated keys, or unset it to serve without "
           "authentication)";
    return false;
  }
  return true;
}

bool load_gateway_keys(const std::string& keys_file, gateway_config* gc, std::string* why) {
  if (!api_keys_from_env(&gc->api_keys, why)) return false;
  if (!keys_file.empty()) {
    gc->keys_file_stamp = file_stamp(keys_file);  // before the read: a change after it is read again
    if (!read_api_keys_file(keys_file, &gc->named_keys, why)) return false;
    gc->keys_file = keys_file;  // (watched: a rewrite is read again; the environment's is not)
    return true;
  }
  const char* v = std::getenv("BATON_API_KEYS_JSON");
  if (!v || parse_api_keys(v, &gc->named_keys, why)) return true;
  *why = "BATON_API_KEYS_JSON: " + *why;
  return false;
}

int run_gateway(const std::vector<std::string>& args) {
  std::string router, cluster, name = "gateway", listen = "127.0.0.1:8000";
  gateway_config gc;
  uint32_t scheduler_threads = 2;
  net_security sec;
  flag_set flags;
  add_security_flags(flags, &sec);
  flags.add("--router", &router, "HOST:PORT of the router to send requests to");
  flags.add("--cluster", &cluster, "or: HOST:PORT of the head's node directory (join as a node, find the router there)");
  flags.add("--name", &name, "the node's name, with --cluster");
  flags.add("--listen", &listen, "HOST:PORT to serve HTTP on (port 0: any free port)");
  flags.add("--api-key", &gc.api_keys,
            "an API key accepted as a bearer token (repeatable; also BATON_API_KEYS, comma-separated; none here or "
            "in --api-keys-file: no authentication); named key-1, key-2, ... in the log and /metrics");
  std::string keys_file;
  flags.add("--api-keys-file", &keys_file,
            "a JSON file of named API keys, each with its own limits: {\"keys\": [{\"name\", \"key\", "
            "\"max_in_flight\", \"max_tokens\", \"requests_per_minute\", \"tokens_per_minute\", \"priority\"}]}, read "
            "again when it changes (README, Serving several teams)");
  flags.add("--first-token-timeout-ms", &gc.first_token_timeout_ms,
            "a call's wait for its first token before 504 (later tokens: the request's own watchdog)");
  flags.add("--router-silence-ms", &gc.router_silence_ms,
            "the router not answering the gateway's probe this long (its head stalled, or cut off with the link open): "
            "new calls get 503 at once until it answers (0: not watched)");
  flags.add("--stream-keepalive-ms", &gc.stream_keepalive_ms,
            "a streaming call without its first token this long gets its 200 head and a comment line this often, so "
            "proxies do not cut it as idle (0: nothing before the first token)");
  flags.add("--max-connections", &gc.max_connections, "connections beyond this are answered 503");
  flags.add("--idle-timeout-ms", &gc.idle_timeout_ms,
            "a connection with nothing in progress that completes no request for this long is closed");
  flags.add("--max-body-bytes", &gc.limits.max_body_bytes, "request bodies larger than this are answered 413");
  flags.add("--max-stream-backlog-bytes", &gc.max_stream_backlog_bytes,
            "a streaming client that lets more than this wait unread is dropped (499; its generation stops)");
  flags.add("--max-total-backlog-bytes", &gc.max_total_backlog_bytes,
            "answers waiting unread for all clients together; past it, a stream with more than 1 MiB unread is dropped "
            "(499)");
  flags.add("--served-model-name", &gc.served_model_name,
            "the model's id in the API (default: the model's own name); NAME,ALIAS,...: calls may name it by any, "
            "answered under the name they gave (vLLM's list)");
  flags.add("--cors-origin", &gc.cors_origins,
            "a browser origin (https://host[:port], or * for any) whose pages may call the API (repeatable; default none)");
  flags.add("--log-requests", &gc.log_requests,
            "a line per call as it ends (its id, status, time; each generation's request, ranks, tokens and stage times)");
  flags.add("--explain", &gc.log_placements,
            "--log-requests, with why each generation was placed on its prefill and decode ranks");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  uint32_t head_wait_s = 60, drain_timeout_ms = 60000;
  flags.add("--drain-timeout-ms", &drain_timeout_ms,
            "on SIGTERM, take no new calls and wait this long for those in progress before stopping");
  flags.add("--head-wait-s", &head_wait_s,
            "with --cluster: when the router goes away, wait this long for a head at --cluster to come back "
            "(restarted: `baton launch --restart-failed`) and serve through it, on the same port (0 = leave at once)");
  if (auto rc = flags.parse_command_line(args, "gateway", "baton gateway --router HOST:PORT --listen HOST:PORT [flags]"))
    return *rc;
  gc.log_requests = gc.log_requests || gc.log_placements;
  std::string host, why;
  uint16_t port = 0;
  if (!load_gateway_keys(keys_file, &gc, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 2;
  }
  if (auto e = sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton gateway: %s\n", e.c_str());
    return 2;
  }
  if (auto e = gc.validate(); !e.empty()) {  // before any connection: said at once ("gateway: ...")
    std::fprintf(stderr, "baton %s\n", e.c_str());
    return 2;
  }
  if (router.empty() == cluster.empty()) {
    std::fprintf(stderr, "baton gateway: give one of --router or --cluster\n");
    return 2;
  }
  if (!parse_host_port(router.empty() ? cluster : router, router.empty() ? "--cluster" : "--router", &host, &port, &why) ||
      !parse_host_port(listen, "--listen", &gc.host, &gc.port, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 2;
  }
  install_stop_signals();
  caf::actor_system_config cfg;
  configure_networked_system(cfg, scheduler_threads, 0, sec);
  caf::actor_system sys{cfg};
  // As a node: the agent joins the directory and heartbeats; the welcome names the router.
  caf::actor agent;
  node_directory_actor joined;  // the directory this gateway last joined
  auto join_cluster = [&](std::chrono::seconds within, std::string* err) -> std::optional<router_actor> {
    auto dir = connect_actor<node_directory_actor>(sys, sec, host, port);
    if (!dir) return *err = "cannot reach the node directory at " + cluster + ": " + explain_connect_error(sys, dir.error(), sec.tls()), std::nullopt;
    // CAF's middleman hands out the old head's cached proxy until it has processed its loss.
    if (joined && *dir == joined) return *err = "only the head that went away answers at " + cluster, std::nullopt;
    joined = *dir;
    auto welcome = std::make_shared<std::promise<router_actor>>();
    auto got = welcome->get_future();
    node_agent_config ac;
    ac.hello = {name, {"gateway"}, static_cast<int32_t>(::getpid())};
    agent = caf::actor_cast<caf::actor>(spawn_node_agent(sys, *dir, ac, [welcome](caf::actor_system&, const cluster_welcome& w, node_actors*) {
      welcome->set_value(w.router);
      return std::string{};
    }));
    // Until the welcome, or the agent's end: a directory that refuses the join (another process
    // holds this name) says why, and that is what the user reads, not a timeout.
    caf::scoped_actor watch{sys};
    watch->monitor(agent);
    std::string refused;
    const auto until = std::chrono::steady_clock::now() + within;
    while (refused.empty() && got.wait_for(std::chrono::milliseconds{0}) != std::future_status::ready &&
           std::chrono::steady_clock::now() < until)
      watch->receive([&](const caf::down_msg& dm) { refused = dm.reason ? sys.render(dm.reason) : "its agent ended"; },
                     caf::after(std::chrono::milliseconds{50}) >> [] {});
    if (got.wait_for(std::chrono::milliseconds{0}) != std::future_status::ready) {
      caf::anon_send_exit(agent, caf::exit_reason::user_shutdown);  // a late welcome must not leave a second gateway joined
      agent = {};
      return *err = "the node directory at " + cluster + (refused.empty() ? " did not welcome this node" : " refused this node: " + refused),
             std::nullopt;
    }
    return got.get();
  };
  router_actor target;
  if (!router.empty()) {
    auto r = connect_actor<router_actor>(sys, sec, host, port);
    if (!r) {
      std::fprintf(stderr, "baton gateway: cannot reach the router at %s: %s\n", router.c_str(), explain_connect_error(sys, r.error(), sec.tls()).c_str());
      return 1;
    }
    target = *r;
  } else if (auto r = join_cluster(std::chrono::seconds{15}, &why)) {
    target = *r;
  } else {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 1;
  }
  gateway_handle gateway;
  if (!spawn_gateway(sys, gc, target, &gateway, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 1;
  }
  std::printf("baton gateway: listening on http://%s:%u\n", gc.host.c_str(), static_cast<unsigned>(gateway.port));
  if (!gateway.keys.empty()) std::printf("baton gateway: API keys: %s\n", gateway.keys.c_str());
  std::fflush(stdout);
  caf::scoped_actor self{sys};
  auto stop = [&](int rc) {
    self->send_exit(gateway.server, caf::exit_reason::user_shutdown);
    if (agent) self->send_exit(agent, caf::exit_reason::user_shutdown);
    return rc;
  };
  for (;;) {
    self->monitor(target);
    bool router_gone = false;
    while (!router_gone && !stop_requested())
      self->receive([&](const caf::down_msg&) { router_gone = true; }, caf::after(std::chrono::milliseconds{50}) >> [] {});
    if (!router_gone) {
      // SIGTERM (a rolling restart, `baton launch` stopping): the calls in progress finish,
      // new ones go elsewhere; a second signal, or --drain-timeout-ms, ends the wait.
      std::printf("baton gateway: draining: no new calls; waiting up to %u ms for those in progress "
                  "(a second SIGTERM stops at once)\n", drain_timeout_ms);
      std::fflush(stdout);
      const auto left = drain_gateway(sys, gateway, std::chrono::milliseconds{drain_timeout_ms}, stop_insisted);
      if (left > 0) std::printf("baton gateway: stopping with %u calls still running\n", left);
      if (agent) {
        // Leaving, as a node that drains does: the head's directory records it as left, not
        // lost (an alert) -- every rolling restart of a gateway stopped it this way. Its agent
        // has no ranks: it tells the directory and ends; bounded if the head does not answer.
        caf::scoped_actor leaving{sys};
        leaving->monitor(agent);
        leaving->send(agent, drain_atom::value);
        leaving->receive([](const caf::down_msg&) {}, caf::after(std::chrono::seconds{2}) >> [] {});
      }
      std::printf("baton gateway: stopped\n");
      return stop(0);
    }
    if (cluster.empty() || head_wait_s == 0) {
      std::fprintf(stderr, "%s baton gateway: the router went away\n", utc_stamp().c_str());
      return stop(1);
    }
    // The head went away (crashed, or restarted): keep the port, answer 503 meanwhile (a load
    // balancer sees an unhealthy replica, not a refused connection), wait for a head at the
    // same address, join it, and serve through its router. Calls in flight got their 503.
    if (agent) self->send_exit(agent, caf::exit_reason::user_shutdown);
    agent = {};
    gateway_router_lost(gateway, "the cluster's head at " + cluster + " went away; this gateway waits up to " +
                                     std::to_string(head_wait_s) + " s for it to come back: retry shortly");
    std::printf("%s baton gateway: the router went away; waiting up to %u s for a head at %s\n", utc_stamp().c_str(), head_wait_s,
                cluster.c_str());
    std::fflush(stdout);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{head_wait_s};
    router_actor next;  // null until a head is joined and its router answers
    while (!next && !stop_requested() && std::chrono::steady_clock::now() < deadline) {
      if (auto r = join_cluster(std::chrono::seconds{5}, &why)) {
        if (gateway_set_router(sys, gateway, *r, &why)) {
          next = *r;
          break;
        }
        // Joined, but its router did not answer: leave, so that the next try joins afresh
        // (join_cluster refuses the directory it last joined as the head that went away).
        if (agent) self->send_exit(agent, caf::exit_reason::user_shutdown);
        agent = {};
        joined = node_directory_actor{};
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{250});
    }
    if (!next) {
      if (stop_requested()) return stop(0);
      std::fprintf(stderr, "baton gateway: no head came back at %s within %u s (%s)\n", cluster.c_str(), head_wait_s,
                   why.c_str());
      return stop(1);
    }
    target = next;
    std::printf("%s baton gateway: serving again on http://%s:%u, through the head that came back\n", utc_stamp().c_str(), gc.host.c_str(),
                static_cast<unsigned>(gateway.port));
    std::fflush(stdout);
  }
}

}  // namespace baton::deploy
