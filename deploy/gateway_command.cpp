// `baton gateway`: the OpenAI-compatible HTTP gateway in its own process, a client of a router
// that another process publishes (`baton local --serve --router-listen`, or `baton launch`).

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/gateway.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

std::vector<std::string> api_keys_from_env() {
  const char* v = std::getenv("BATON_API_KEYS");  // comma-separated; kept off command lines (ps)
  return v ? split_list(v) : std::vector<std::string>{};
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
            "an API key accepted as a bearer token (repeatable; also BATON_API_KEYS, comma-separated; none: no "
            "authentication)");
  flags.add("--request-timeout-ms", &gc.request_timeout_ms, "a generation's whole time before 504");
  flags.add("--max-connections", &gc.max_connections, "connections beyond this are answered 503");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  if (auto rc = flags.parse_command_line(args, "gateway", "baton gateway --router HOST:PORT --listen HOST:PORT [flags]"))
    return *rc;
  for (auto& k : api_keys_from_env()) gc.api_keys.push_back(std::move(k));
  std::string host, why;
  uint16_t port = 0;
  if (auto e = sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton gateway: %s\n", e.c_str());
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
  router_actor target;
  caf::actor agent;
  if (!router.empty()) {
    auto r = connect_actor<router_actor>(sys, sec, host, port);
    if (!r) {
      std::fprintf(stderr, "baton gateway: cannot reach the router at %s: %s\n", router.c_str(), explain_connect_error(sys, r.error(), sec.tls()).c_str());
      return 1;
    }
    target = *r;
  } else {
    // As a node: the agent joins the directory and heartbeats; the welcome names the router.
    auto dir = connect_actor<node_directory_actor>(sys, sec, host, port);
    if (!dir) {
      std::fprintf(stderr, "baton gateway: cannot reach the node directory at %s: %s\n", cluster.c_str(),
                   explain_connect_error(sys, dir.error(), sec.tls()).c_str());
      return 1;
    }
    auto welcome = std::make_shared<std::promise<router_actor>>();
    auto got = welcome->get_future();
    node_agent_config ac;
    ac.hello = {name, {"gateway"}, static_cast<int32_t>(::getpid())};
    agent = caf::actor_cast<caf::actor>(spawn_node_agent(sys, *dir, ac, [welcome](caf::actor_system&, const cluster_welcome& w, node_actors*) {
      welcome->set_value(w.router);
      return std::string{};
    }));
    if (got.wait_for(std::chrono::seconds{15}) != std::future_status::ready) {
      std::fprintf(stderr, "baton gateway: the node directory at %s did not welcome this node\n", cluster.c_str());
      return 1;
    }
    target = got.get();
  }
  gateway_handle gateway;
  if (!spawn_gateway(sys, gc, target, &gateway, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 1;
  }
  std::printf("baton gateway: listening on http://%s:%u\n", gc.host.c_str(), static_cast<unsigned>(gateway.port));
  std::fflush(stdout);
  caf::scoped_actor self{sys};
  self->monitor(target);
  bool router_gone = false;
  while (!router_gone && !stop_requested())
    self->receive([&](const caf::down_msg&) { router_gone = true; }, caf::after(std::chrono::milliseconds{200}) >> [] {});
  self->send_exit(gateway.server, caf::exit_reason::user_shutdown);
  if (agent) self->send_exit(agent, caf::exit_reason::user_shutdown);
  if (router_gone) std::fprintf(stderr, "baton gateway: the router went away\n");
  return router_gone ? 1 : 0;
}

}  // namespace baton::deploy
