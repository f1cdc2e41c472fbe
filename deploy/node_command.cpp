// `baton node --role decode`: a decode rank in its own process. It connects to the decode
// balancer that the head process publishes, registers by reporting its load, receives KV over
// UCX and streams tokens back to request actors in the head -- all through CAF's network layer.
// It exits when the head goes away or on SIGTERM/SIGINT.

#include <cstdio>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/decode_rank.hpp"
#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/processes.hpp"
#include "gpu/cpu_executor.hpp"
#include "transport/ucx.hpp"

namespace baton::deploy {

int run_node(const std::vector<std::string>& args) {
  std::string role = "decode", connect;
  decode_rank_config rank;
  gpu::cpu_executor_config exec_cfg;
  uint64_t weights_seed = local_cluster_config{}.weights_seed;
  uint32_t scheduler_threads = 2, poll_attempts = 0;
  flag_set flags;
  flags.add("--role", &role, "what this node runs (decode)");
  flags.add("--name", &rank.name, "the rank's name");
  flags.add("--connect", &connect, "host:port of the head's decode balancer");
  flags.add("--kv-pages", &exec_cfg.num_kv_pages, "KV pages");
  flags.add("--page-tokens", &exec_cfg.page_size_tokens, "tokens per KV page");
  flags.add("--executor-threads", &exec_cfg.num_threads, "math threads");
  flags.add("--weights-seed", &weights_seed, "seed of the built-in model's weights (must match the head)");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  flags.add("--poll-attempts", &poll_attempts, "CAF work-stealing moderate-poll-attempts");
  std::string model_dir = "random";
  flags.add("--model", &model_dir, "the head's model directory, or `random` for the seeded random model");
  if (auto rc = flags.parse_command_line(args, "node", "baton node --role decode --connect HOST:PORT [flags]")) return *rc;
  if (role != "decode") {
    std::fprintf(stderr, "baton node: --role must be decode (got '%s')\n", role.c_str());
    return 2;
  }
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(connect, "--connect", &host, &port, &why) || port == 0) {
    std::fprintf(stderr, "baton node: %s\n", why.empty() ? "--connect needs a non-zero port" : why.c_str());
    return 2;
  }
  local_cluster_config loaded;  // the model this node serves: the head's
  if (model_dir != "random") {
    if (!load_model_into(model_dir, &loaded, &why)) {
      std::fprintf(stderr, "baton node: %s\n", why.c_str());
      return 2;
    }
  }
  auto model = loaded.model;
  if (auto err = rank.validate() + exec_cfg.validate(); !err.empty()) {
    std::fprintf(stderr, "baton node: %s\n", err.c_str());
    return 2;
  }

  install_stop_signals();
  caf::actor_system_config cfg;
  register_message_types(cfg);
  cfg.load<caf::io::middleman>();
  cfg.set("scheduler.max-threads", scheduler_threads);
  cfg.set("work-stealing.moderate-poll-attempts", poll_attempts);
  caf::actor_system sys{cfg};
  auto balancer = sys.middleman().remote_actor<decode_balancer_actor>(host, port);
  if (!balancer) {
    std::fprintf(stderr, "baton node %s: cannot reach the decode balancer at %s: %s\n", rank.name.c_str(),
                 connect.c_str(), sys.render(balancer.error()).c_str());
    return 1;
  }
  auto xport = transport::make_ucx_transport({rank.name}, &why);
  if (!xport) {
    std::fprintf(stderr, "baton node %s: UCX: %s\n", rank.name.c_str(), why.c_str());
    return 1;
  }
  auto weights = loaded.weights ? loaded.weights
                                : std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(model, weights_seed));
  caf::scoped_actor self{sys};
  // The head's block store, if it runs one: this rank writes its finished sequences back to it
  // through UCX, like the head's own ranks.
  store_access store;
  self->request(*balancer, std::chrono::seconds{10}, store_atom::value)
      .receive([&](store_info& info) { store = store_access::from_info(info); },
               [&](caf::error& e) {
                 std::fprintf(stderr, "baton node %s: no store information from the head: %s\n", rank.name.c_str(),
                              sys.render(e).c_str());
               });
  auto decode = spawn_decode_rank(sys, rank, gpu::make_cpu_executor(model, weights, exec_cfg), std::move(xport),
                                  *balancer, store);
  self->monitor(*balancer);
  bool head_gone = false;
  while (!head_gone && !stop_requested()) {
    self->receive([&](const caf::down_msg&) { head_gone = true; },
                  caf::after(std::chrono::milliseconds{200}) >> [] {});
  }
  self->send_exit(decode, caf::exit_reason::user_shutdown);
  return 0;
}

}  // namespace baton::deploy
