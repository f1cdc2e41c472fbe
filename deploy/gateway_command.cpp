// `baton gateway`: the OpenAI-compatible HTTP gateway in its own process, a client of a router
// that another process publishes (`baton local --serve --router-listen`, or `baton launch`).

#include <chrono>
#include <cstdio>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/gateway.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

int run_gateway(const std::vector<std::string>& args) {
  std::string router = "127.0.0.1:7100", listen = "127.0.0.1:8000";
  gateway_config gc;
  uint32_t scheduler_threads = 2;
  flag_set flags;
  flags.add("--router", &router, "HOST:PORT of the router to send requests to");
  flags.add("--listen", &listen, "HOST:PORT to serve HTTP on (port 0: any free port)");
  flags.add("--api-key", &gc.api_keys, "an API key accepted as a bearer token (repeatable; none: no authentication)");
  flags.add("--request-timeout-ms", &gc.request_timeout_ms, "a generation's whole time before 504");
  flags.add("--max-connections", &gc.max_connections, "connections beyond this are answered 503");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  if (auto rc = flags.parse_command_line(args, "gateway", "baton gateway --router HOST:PORT --listen HOST:PORT [flags]"))
    return *rc;
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(router, "--router", &host, &port, &why) ||
      !parse_host_port(listen, "--listen", &gc.host, &gc.port, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 2;
  }
  install_stop_signals();
  caf::actor_system_config cfg;
  register_message_types(cfg);
  cfg.load<caf::io::middleman>();
  cfg.set("scheduler.max-threads", scheduler_threads);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{cfg};
  auto r = sys.middleman().remote_actor<router_actor>(host, port);
  if (!r) {
    std::fprintf(stderr, "baton gateway: cannot reach the router at %s: %s\n", router.c_str(), sys.render(r.error()).c_str());
    return 1;
  }
  gateway_handle gateway;
  if (!spawn_gateway(sys, gc, *r, &gateway, &why)) {
    std::fprintf(stderr, "baton gateway: %s\n", why.c_str());
    return 1;
  }
  std::printf("baton gateway: listening on http://%s:%u, router %s\n", gc.host.c_str(), static_cast<unsigned>(gateway.port),
              router.c_str());
  std::fflush(stdout);
  caf::scoped_actor self{sys};
  self->monitor(*r);
  bool router_gone = false;
  while (!router_gone && !stop_requested())
    self->receive([&](const caf::down_msg&) { router_gone = true; }, caf::after(std::chrono::milliseconds{200}) >> [] {});
  self->send_exit(gateway.server, caf::exit_reason::user_shutdown);
  if (router_gone) std::fprintf(stderr, "baton gateway: the router went away\n");
  return router_gone ? 1 : 0;
}

}  // namespace baton::deploy
