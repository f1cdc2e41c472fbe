// `baton status`: asks a running cluster's node directory (its --cluster-listen address) and
// router (--router-listen) what they see, and prints it (deploy/status_view.hpp). An operations
// trial found no command that lists a cluster: only /health's counts, /metrics and the head's log.

#include "deploy/status_view.hpp"

#include <chrono>
#include <cstdio>
#include <optional>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <nlohmann/json.hpp>

#include "actors/messages.hpp"
#include "actors/node_messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

namespace {

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s + "  ";
}

std::string join(const std::vector<std::string>& xs, const char* sep) {
  std::string out;
  for (const auto& x : xs) out += (out.empty() ? "" : sep) + x;
  return out;
}

/// "taking work", or why not (draining, an executor that stepped aside).
std::string rank_state(const rank_load& r) { return r.unavailable.empty() ? "taking work" : r.unavailable; }

}  // namespace

std::string status_text(const std::vector<node_status>* nodes, const std::string& nodes_why,
                        const cluster_stats* ranks, const std::string& ranks_why) {
  std::string out;
  if (nodes || !nodes_why.empty()) {
    out += "nodes:\n";
    if (!nodes) {
      out += "  (" + nodes_why + ")\n";
    } else if (nodes->empty()) {
      out += "  (none has joined: every rank runs in the head's process)\n";
    } else {
      out += "  " + pad("NAME", 16) + pad("ROLES", 14) + pad("PID", 8) + pad("STATE", 9) + pad("HEARTBEAT", 10) + "RANKS\n";
      for (const auto& n : *nodes) {
        std::string line = "  " + pad(n.name, 16) + pad(join(n.roles, ","), 14) + pad(std::to_string(n.pid), 8) +
                           pad(n.state, 9) + pad(std::to_string(n.since_heartbeat_ms) + " ms", 10) + join(n.ranks, " ");
        if (!n.why.empty()) line += (n.ranks.empty() ? "" : " ") + std::string{"("} + n.why + ")";
        while (!line.empty() && line.back() == ' ') line.pop_back();
        out += line + "\n";
      }
    }
  }
  if (ranks || !ranks_why.empty()) {
    out += "ranks:\n";
    if (!ranks) {
      out += "  (" + ranks_why + ")\n";
    } else {
      out += "  " + pad("ROLE", 8) + pad("RANK", 16) + pad("RUNNING", 8) + pad("QUEUED", 8) + pad("FREE KV PAGES", 14) +
             "STATE\n";
      for (const auto& [role, list] : {std::pair{"prefill", &ranks->prefill}, std::pair{"decode", &ranks->decode}})
        for (const auto& r : *list)
          out += "  " + pad(role, 8) + pad(r.name, 16) + pad(std::to_string(r.num_running), 8) +
                 pad(std::to_string(r.queued_tokens), 8) +
                 pad(std::to_string(r.num_free_pages) + " of " + std::to_string(r.num_total_pages), 14) + rank_state(r) +
                 // Held for late writers: neither free nor running, and not a leak (kv_quarantine_ms).
                 (r.quarantined_pages ? "; " + std::to_string(r.quarantined_pages) + " KV pages quarantined" : "") + "\n";
      if (!ranks->decode_answered) out += "  (the decode balancer did not answer: no decode rank is shown)\n";
      out += "  placements waiting: prefill " + std::to_string(ranks->prefill_parked) + ", decode " +
             std::to_string(ranks->decode_parked) + " (the KV queue); requests in flight " +
             std::to_string(ranks->num_active) + "\n";
      // The store is a cache: a server down costs hits, not answers, so nothing above shows it.
      if (ranks->store_servers)
        out += "  store servers: " + std::to_string(ranks->store_servers_up) + " of " +
               std::to_string(ranks->store_servers) + " answering\n";
    }
  }
  return out;
}

std::string status_json(const std::vector<node_status>* nodes, const std::string& nodes_why,
                        const cluster_stats* ranks, const std::string& ranks_why) {
  nlohmann::json out = nlohmann::json::object();
  if (nodes) {
    out["nodes"] = nlohmann::json::array();
    for (const auto& n : *nodes)
      out["nodes"].push_back({{"name", n.name},
                              {"roles", n.roles},
                              {"pid", n.pid},
                              {"state", n.state},
                              {"since_heartbeat_ms", n.since_heartbeat_ms},
                              {"ranks", n.ranks},
                              {"why", n.why},
                              {"left", n.left}});
  } else if (!nodes_why.empty()) {
    out["nodes"] = nullptr;
    out["nodes_error"] = nodes_why;
  }
  if (ranks) {
    out["ranks"] = nlohmann::json::array();
    for (const auto& [role, list] : {std::pair{"prefill", &ranks->prefill}, std::pair{"decode", &ranks->decode}})
      for (const auto& r : *list)
        out["ranks"].push_back({{"role", role},
                                {"name", r.name},
                                {"taking_work", r.unavailable.empty()},
                                {"state", rank_state(r)},
                                {"running", r.num_running},
                                {"queued_tokens", r.queued_tokens},
                                {"free_kv_pages", r.num_free_pages},
                                {"kv_pages", r.num_total_pages},
                                {"quarantined_kv_pages", r.quarantined_pages}});
    out["placements_waiting"] = {{"prefill", ranks->prefill_parked}, {"decode", ranks->decode_parked}};
    out["requests_active"] = ranks->num_active;
    if (ranks->store_servers) out["store_servers"] = {{"total", ranks->store_servers}, {"answering", ranks->store_servers_up}};
  } else if (!ranks_why.empty()) {
    out["ranks"] = nullptr;
    out["ranks_error"] = ranks_why;
  }
  // Names are the operators' own (--name): replaced, never refused, where not UTF-8.
  return out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

int run_status(const std::vector<std::string>& args) {
  std::string cluster, router;
  bool json = false;
  uint32_t timeout_ms = 5000;
  net_security sec;
  flag_set flags;
  add_security_flags(flags, &sec);
  flags.add("--cluster", &cluster, "HOST:PORT of the head's node directory (baton local --cluster-listen): the nodes");
  flags.add("--router", &router,
            "HOST:PORT of the router (--router-listen): the ranks, as the balancers see them, and the head's nodes");
  flags.add("--json", &json, "one JSON object instead of tables");
  flags.add("--timeout-ms", &timeout_ms,
            "how long each of the two may take to answer once connected (a connect gives up after 10 s)");
  if (auto rc = flags.parse_command_line(args, "status", "baton status [--cluster HOST:PORT] [--router HOST:PORT] [flags]"))
    return *rc;
  if (cluster.empty() && router.empty()) {
    std::fprintf(stderr, "baton status: give --router HOST:PORT (the ranks and the nodes), --cluster HOST:PORT (the "
                         "nodes, from the head's directory), or both\n");
    return 2;
  }
  if (timeout_ms == 0) {
    std::fprintf(stderr, "baton status: --timeout-ms must be >= 1\n");
    return 2;
  }
  std::string why;
  std::string cluster_host, router_host;
  uint16_t cluster_port = 0, router_port = 0;
  if ((!cluster.empty() && !parse_host_port(cluster, "--cluster", &cluster_host, &cluster_port, &why)) ||
      (!router.empty() && !parse_host_port(router, "--router", &router_host, &router_port, &why))) {
    std::fprintf(stderr, "baton status: %s\n", why.c_str());
    return 2;
  }
  if (auto e = sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton status: %s\n", e.c_str());
    return 2;
  }
  caf::actor_system_config cfg;
  configure_networked_system(cfg, 1, 0, sec);
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  const auto timeout = std::chrono::milliseconds{timeout_ms};
  std::optional<std::vector<node_status>> nodes;
  std::optional<cluster_stats> ranks;
  std::string nodes_why, ranks_why;
  if (!cluster.empty()) {
    if (auto dir = connect_actor<node_directory_actor>(sys, sec, cluster_host, cluster_port); !dir)
      nodes_why = "the node directory at " + cluster + " could not be reached: " + explain_connect_error(sys, dir.error(), sec.tls());
    else
      self->request(*dir, timeout, stats_atom::value)
          .receive([&](std::vector<node_status>& n) { nodes = std::move(n); },
                   [&](caf::error& e) { nodes_why = "the node directory at " + cluster + " did not answer: " + sys.render(e); });
  }
  if (!router.empty()) {
    if (auto r = connect_actor<router_actor>(sys, sec, router_host, router_port); !r)
      ranks_why = "the router at " + router + " could not be reached: " + explain_connect_error(sys, r.error(), sec.tls());
    else
      self->request(*r, timeout, stats_atom::value)
          .receive([&](cluster_stats& s) { ranks = std::move(s); },
                   [&](caf::error& e) { ranks_why = "the router at " + router + " did not answer: " + sys.render(e); });
  }
  // Without --cluster, the nodes as the router's stats carry them (its head's directory).
  if (cluster.empty() && ranks) {
    if (ranks->nodes_known)
      nodes = ranks->nodes;
    else
      nodes_why = "the router's node directory did not answer within 1 s (--cluster HOST:PORT asks it directly)";
  }
  const auto* n = nodes ? &*nodes : nullptr;
  const auto* r = ranks ? &*ranks : nullptr;
  std::fputs((json ? status_json(n, nodes_why, r, ranks_why) : status_text(n, nodes_why, r, ranks_why)).c_str(), stdout);
  return nodes_why.empty() && ranks_why.empty() ? 0 : 1;
}

}  // namespace baton::deploy
