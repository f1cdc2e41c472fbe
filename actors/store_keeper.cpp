#include "actors/store_keeper.hpp"

#include <memory>

#include <caf/actor_system.hpp>
#include <caf/blocking_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace baton {

namespace {

struct store_keeper_state {
  store_keeper_config cfg;
  std::vector<kept_store_node> nodes;
  std::vector<bool> lost;         ///< by node: its server went down, not adopted again yet
  std::vector<std::string> last_why;  ///< by node: why the last try failed (logged when it changes)
  std::vector<bool> probing;      ///< by node: a probe of its server is in flight
  /// The servers now, shared with the exit functor (CAF destroys the state before it runs): the
  /// cluster's end stops the servers adopted again too, as it stops those it started with.
  std::shared_ptr<std::vector<block_server_actor>> current = std::make_shared<std::vector<block_server_actor>>();
  static inline const char* name = "baton.store_keeper";
};

using pointer = store_keeper_actor::stateful_pointer<store_keeper_state>;

void log(pointer self, const std::string& line) {
  if (self->state.cfg.log) self->state.cfg.log(line);
}

void retry_later(pointer self, uint64_t node) {
  self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.retry_interval_ms}, timer_atom::value, node);
}

void failed(pointer self, uint64_t node, const std::string& why) {
  auto& st = self->state;
  if (node >= st.nodes.size() || !st.lost[node]) return;
  // Said once, and again when the reason changes (a node restarted with another cluster id
  // fails otherwise than one that is not up yet).
  if (st.last_why[node] != why)
    log(self, st.nodes[node].name + " (block server " + std::to_string(st.nodes[node].adoption.server_id) +
                  "): not adopted again yet (" + why + "); trying every " + std::to_string(st.cfg.retry_interval_ms) +
                  " ms");
  st.last_why[node] = why;
  retry_later(self, node);
}

/// Node i's server is down, or given up: it is tried again from now on.
void lose(pointer self, uint64_t i, const std::string& why) {
  auto& st = self->state;
  st.lost[i] = true;
  st.last_why[i].clear();
  log(self, st.nodes[i].name + " (block server " + std::to_string(st.nodes[i].adoption.server_id) + ") " + why +
                "; its prefixes are computed again until it is adopted again");
  self->send(self, timer_atom::value, i);
}

/// Asks each server that is up, and not asked already, for its stats: one probe in flight per
/// server, which must be answered within missed_probes intervals, else the server is given up:
/// the index shards mark it down (as its down message would) and the node is adopted again once
/// its host answers. (A node that hangs, or whose packets are dropped, keeps its TCP link for
/// minutes: no down message.) One probe with the whole wait, not one per interval each with an
/// interval's: a busy link (a server's recovery sends a commit per block it found, ahead of the
/// answer) delays an answer without losing it.
void probe(pointer self) {
  auto& st = self->state;
  const auto interval = std::chrono::milliseconds{st.cfg.probe_interval_ms};
  const auto wait = interval * st.cfg.missed_probes;
  for (uint64_t i = 0; i < st.nodes.size(); ++i) {
    if (st.lost[i] || st.probing[i]) continue;
    st.probing[i] = true;
    const auto server = st.nodes[i].server;
    self->request(server, wait, stats_atom::value)
        .then(
            [=](const store_stats&) {
              auto& st = self->state;
              if (st.nodes[i].server == server) st.probing[i] = false;
            },
            [=](caf::error& e) {
              auto& st = self->state;
              // A server replaced meanwhile is not this one (its own probe is asked afresh).
              if (st.nodes[i].server != server) return;
              st.probing[i] = false;
              // A server that went down is the down handler's.
              if (st.lost[i] || e == caf::sec::request_receiver_down) return;
              for (const auto& shard : st.nodes[i].adoption.index)
                self->send(shard, lost_atom::value, st.nodes[i].adoption.server_id, server);
              lose(self, i,
                   "answered no probe within " + std::to_string(wait.count()) + " ms (" +
                       std::to_string(st.cfg.missed_probes) + " probe intervals): given up as hung or cut off");
            });
  }
  self->delayed_send(self, interval, poll_atom::value);
}

store_keeper_actor::behavior_type store_keeper_impl(pointer self, store_keeper_config cfg,
                                                    std::vector<kept_store_node> nodes) {
  auto& st = self->state;
  st.cfg = std::move(cfg);
  st.nodes = std::move(nodes);
  st.lost.assign(st.nodes.size(), false);
  st.last_why.assign(st.nodes.size(), {});
  st.probing.assign(st.nodes.size(), false);
  for (const auto& n : st.nodes) {
    self->monitor(n.server);
    st.current->push_back(n.server);
  }
  self->attach_functor([current = st.current] {
    for (const auto& s : *current) caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
  });
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    for (uint64_t i = 0; i < st.nodes.size(); ++i) {
      if (st.lost[i] || caf::actor_cast<caf::actor_addr>(st.nodes[i].server) != dm.source) continue;
      lose(self, i, "went down (" + self->system().render(dm.reason) + ")");
    }
  });
  if (st.cfg.probe_interval_ms > 0 && st.cfg.missed_probes > 0 && !st.nodes.empty()) probe(self);
  return {
      [=](poll_atom) { probe(self); },
      [=](timer_atom, uint64_t node) {
        auto& st = self->state;
        if (node >= st.nodes.size() || !st.lost[node]) return;
        if (!st.cfg.reconnect) {  // nothing to try: said once, then it stays lost
          log(self, st.nodes[node].name + ": not adopted again: this cluster has no way to reach it configured");
          return;
        }
        // Connecting blocks (a host that is down refuses at once, an unreachable one may take
        // the TCP timeout): on a thread of its own, never on the keeper's.
        self->system().spawn([keeper = caf::actor_cast<store_keeper_actor>(self), node, sys = &self->system(),
                              connect = st.cfg.reconnect](caf::blocking_actor*) {
          auto host = connect(node);
          if (host) caf::anon_send(keeper, adopt_atom::value, node, std::move(*host));
          else caf::anon_send(keeper, adopt_atom::value, node, sys->render(host.error()));
        });
      },
      [=](adopt_atom, uint64_t node, std::string& why) { failed(self, node, why); },
      [=](adopt_atom, uint64_t node, store_host_actor& host) {
        auto& st = self->state;
        if (node >= st.nodes.size() || !st.lost[node]) return;
        self->request(host, std::chrono::milliseconds{st.cfg.adopt_timeout_ms}, adopt_atom::value, st.nodes[node].adoption)
            .then(
                [=](block_server_actor& server) {
                  auto& st = self->state;
                  auto& n = st.nodes[node];
                  n.server = server;
                  (*st.current)[node] = server;
                  st.lost[node] = false;
                  st.probing[node] = false;
                  self->monitor(server);
                  for (const auto& shard : n.adoption.index) self->send(shard, adopt_atom::value, n.adoption.server_id, server);
                  log(self, n.name + " (block server " + std::to_string(n.adoption.server_id) +
                                ") adopted again: it serves the blocks its disk holds");
                },
                [=](caf::error& e) { failed(self, node, "its adoption failed: " + self->system().render(e)); });
      },
  };
}

}  // namespace

store_keeper_actor spawn_store_keeper(caf::actor_system& sys, store_keeper_config cfg, std::vector<kept_store_node> nodes) {
  return sys.spawn(store_keeper_impl, std::move(cfg), std::move(nodes));
}

}  // namespace baton
