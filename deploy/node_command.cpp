// `baton node --role decode`: decode ranks in their own process. Its agent joins the head's
// node directory (published by `baton local --serve --cluster-listen`, or by `baton local
// --decode-processes`), gets the balancer and the block store from it, starts the ranks, and
// heartbeats. The ranks receive KV over UCX and stream tokens to request actors in the head --
// all through CAF's network layer. SIGTERM or SIGINT drains the node: no new placements, the
// running sequences finish, then it leaves. It also ends when the head goes away.

#include <cstdio>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/exit_reason.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/decode_rank.hpp"
#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"
#include "gpu/cpu_executor.hpp"
#include "transport/ucx.hpp"

namespace baton::deploy {

int run_node(const std::vector<std::string>& args) {
  std::string role = "decode", connect;
  decode_rank_config rank;
  gpu::cpu_executor_config exec_cfg;
  uint64_t weights_seed = local_cluster_config{}.weights_seed;
  uint32_t scheduler_threads = 2, poll_attempts = 0, num_ranks = 1;
  node_agent_config agent_cfg;
  net_security sec;
  flag_set flags;
  add_security_flags(flags, &sec);
  flags.add("--role", &role, "what this node runs (decode)");
  flags.add("--name", &rank.name, "the node's name (its ranks are <name>, or <name>-0, <name>-1, ... with --ranks > 1)");
  flags.add("--connect", &connect, "host:port of the head's node directory");
  flags.add("--ranks", &num_ranks, "decode ranks in this process (one per GPU; CPU executors here)");
  flags.add("--kv-pages", &exec_cfg.num_kv_pages, "KV pages per rank");
  flags.add("--page-tokens", &exec_cfg.page_size_tokens, "tokens per KV page");
  flags.add("--executor-threads", &exec_cfg.num_threads, "math threads per rank");
  flags.add("--weights-seed", &weights_seed, "seed of the built-in model's weights (must match the head)");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  flags.add("--poll-attempts", &poll_attempts, "CAF work-stealing moderate-poll-attempts");
  flags.add("--drain-timeout-ms", &agent_cfg.drain_timeout_ms, "on SIGTERM, stop anyway after this long");
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
  if (auto e = sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton node: %s\n", e.c_str());
    return 2;
  }
  if (num_ranks == 0) {
    std::fprintf(stderr, "baton node: --ranks must be >= 1\n");
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
  configure_networked_system(cfg, scheduler_threads, poll_attempts, sec);
  caf::actor_system sys{cfg};
  auto directory = connect_actor<node_directory_actor>(sys, sec, host, port);
  if (!directory) {
    std::fprintf(stderr, "baton node %s: cannot reach the head's node directory at %s: %s\n", rank.name.c_str(),
                 connect.c_str(), explain_connect_error(sys, directory.error(), sec.tls()).c_str());
    return 1;
  }
  auto weights = loaded.weights ? loaded.weights
                                : std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(model, weights_seed));
  agent_cfg.hello = {rank.name, {"decode"}, static_cast<int32_t>(::getpid())};
  auto start = [=](caf::actor_system& sys, const cluster_welcome& w, node_actors* out) -> std::string {
    // The head's block store, if it runs one: these ranks write finished sequences back to it
    // through UCX, like the head's own ranks.
    const auto store = store_access::from_info(w.store);
    for (uint32_t i = 0; i < num_ranks; ++i) {
      auto rc = rank;
      if (num_ranks > 1) rc.name.append("-").append(std::to_string(i));
      std::string why;
      auto xport = transport::make_ucx_transport({rc.name}, &why);
      if (!xport) return "rank " + rc.name + ": UCX: " + why;
      out->decode.push_back(spawn_decode_rank(sys, rc, gpu::make_cpu_executor(model, weights, exec_cfg),
                                              std::move(xport), w.decode_balancer, store));
      out->decode_names.push_back(rc.name);
    }
    return {};
  };
  auto agent = spawn_node_agent(sys, *directory, agent_cfg, start);
  caf::scoped_actor self{sys};
  self->monitor(agent);
  bool gone = false, drain_sent = false;
  caf::error reason;
  while (!gone) {
    if (stop_requested() && !drain_sent) {
      self->send(agent, drain_atom::value);
      drain_sent = true;
    }
    self->receive(
        [&](const caf::down_msg& dm) {
          gone = true;
          reason = dm.reason;
        },
        caf::after(std::chrono::milliseconds{100}) >> [] {});
  }
  if (reason && reason != caf::exit_reason::normal) {
    std::fprintf(stderr, "baton node %s: %s\n", rank.name.c_str(), sys.render(reason).c_str());
    return drain_sent ? 0 : 1;  // after a drain request, leaving is the goal
  }
  if (drain_sent) std::printf("baton node %s: drained and left\n", rank.name.c_str());
  return 0;
}

}  // namespace baton::deploy
