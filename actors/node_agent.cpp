#include "actors/node_agent.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace baton {

namespace {

struct node_agent_state {
  node_agent_config cfg;
  node_directory_actor directory;
  cluster_welcome welcome;
  node_actors actors;
  bool serving = false;
  bool draining = false;
  caf::actor_clock::time_point drain_started;
  static inline const char* name = "baton.node_agent";
};

using pointer = node_agent_actor::stateful_pointer<node_agent_state>;

/// Heartbeats for a node whose agent is busy starting its actors: `start` runs on the agent's
/// thread and may take seconds (expert processes to spawn and meet, weights to upload to a GPU),
/// longer than the directory waits for a heartbeat, which would declare the node gone and tell
/// its groups so before it ever served. On a thread of its own (detached): the agent's
/// scheduler thread is the one that is busy. Stopped once `start` returns.
caf::actor spawn_start_pulse(caf::actor_system& sys, node_directory_actor directory, std::string name,
                             uint64_t incarnation, uint32_t interval_ms) {
  return sys.spawn<caf::detached>([=](caf::event_based_actor* self) -> caf::behavior {
    self->send(self, heartbeat_atom::value);
    return {
        [=](heartbeat_atom) {
          self->send(directory, heartbeat_atom::value, name, incarnation);
          self->delayed_send(self, std::chrono::milliseconds{std::max<uint32_t>(1, interval_ms)}, heartbeat_atom::value);
        },
    };
  });
}

void stop_all(pointer self) {
  auto& a = self->state.actors;
  for (auto& r : a.ranks.decode) self->send_exit(r, caf::exit_reason::user_shutdown);
  for (auto& r : a.ranks.prefill) self->send_exit(r, caf::exit_reason::user_shutdown);
  for (auto& o : a.others) self->send_exit(o, caf::exit_reason::user_shutdown);
}

/// Draining: asks every rank whether it still holds work (prompts, sequences, leases, write-backs
/// to the store); leaves when none does.
void check_drained(pointer self) {
  auto& st = self->state;
  const auto waited = self->clock().now() - st.drain_started;
  if (waited > std::chrono::milliseconds{st.cfg.drain_timeout_ms}) {
    stop_all(self);
    self->quit(make_error(errc::deadline_exceeded, "node " + st.cfg.hello.name + ", stage drain: work left after " +
                                                       std::to_string(st.cfg.drain_timeout_ms) + " ms"));
    return;
  }
  const auto& ranks = st.actors.ranks;
  auto left = std::make_shared<size_t>(ranks.decode.size() + ranks.prefill.size());
  auto busy = std::make_shared<bool>(false);
  auto settle = [=] {
    if (--*left > 0) return;
    if (*busy) {
      self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.drain_poll_ms}, poll_atom::value);
      return;
    }
    stop_all(self);
    self->quit();
  };
  if (*left == 0) {
    stop_all(self);
    self->quit();
    return;
  }
  auto ask = [=](const auto& rank) {
    self->request(rank, std::chrono::seconds{5}, stats_atom::value)
        .then(
            [=](const rank_stats& s) {
              // Write-backs too: their puts read the rank's staging, which must outlive them.
              *busy = *busy || s.num_running > 0 || s.num_waiting > 0 || s.num_writes_in_flight > 0;
              settle();
            },
            [=](caf::error&) { settle(); });  // a rank that is gone holds nothing
  };
  for (const auto& r : ranks.decode) ask(r);
  for (const auto& r : ranks.prefill) ask(r);
}

/// Drains the node: its ranks take no new work and finish what they have, then it leaves;
/// `for_restart` tells the head it leaves to be restarted (lost), not on purpose.
void drain(pointer self, bool for_restart) {
  auto& st = self->state;
  if (st.draining) return;
  st.draining = true;
  st.drain_started = self->clock().now();
  if (!st.serving) {
    stop_all(self);
    self->quit();
    return;
  }
  self->send(st.directory, drain_atom::value, st.cfg.hello.name, for_restart);
  for (auto& r : st.actors.ranks.decode) self->send(st.welcome.decode_balancer, drain_atom::value, r);
  for (auto& r : st.actors.ranks.prefill) self->send(st.welcome.prefill_balancer, drain_atom::value, r);
  // The elastic controller would otherwise wake a standby side here, which registers with
  // its balancer afresh, not draining, and takes work the node can no longer finish.
  if (st.welcome.elastic_controller) self->send(st.welcome.elastic_controller, drain_atom::value, st.actors.ranks);
  check_drained(self);
}

node_agent_actor::behavior_type node_agent_impl(pointer self, node_directory_actor directory, node_agent_config cfg,
                                                node_start start) {
  auto& st = self->state;
  st.cfg = std::move(cfg);
  if (st.cfg.hello.incarnation == 0) {
    std::random_device rd;
    const auto now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    st.cfg.hello.incarnation = ((uint64_t{rd()} << 32) ^ rd() ^ now) | 1;  // never 0
  }
  st.directory = std::move(directory);
  self->monitor(st.directory);
  self->set_down_handler([=](caf::down_msg&) {  // the head went away: nothing left to serve
    stop_all(self);
    if (self->state.cfg.on_head_lost) self->state.cfg.on_head_lost();
    self->quit(make_error(errc::rank_unavailable, "node " + self->state.cfg.hello.name + ": the head went away"));
  });
  self->request(st.directory, std::chrono::milliseconds{st.cfg.join_timeout_ms}, join_atom::value, st.cfg.hello)
      .then(
          [=](cluster_welcome& w) {
            auto& st = self->state;
            st.welcome = std::move(w);
            std::string why;
            {
              // Stopped however start ends (an allocation that throws too): a pulse left running
              // would keep a node that never served alive in the directory.
              struct pulse_guard {
                caf::actor pulse;
                ~pulse_guard() { caf::anon_send_exit(pulse, caf::exit_reason::user_shutdown); }
              } guard{spawn_start_pulse(self->system(), st.directory, st.cfg.hello.name, st.cfg.hello.incarnation,
                                        st.welcome.heartbeat_interval_ms)};
              why = start(self->system(), st.welcome, &st.actors);
            }
            if (!why.empty()) {
              stop_all(self);
              self->quit(make_error(errc::executor_failed, "node " + st.cfg.hello.name + ", stage start: " + why));
              return;
            }
            st.serving = true;
            self->send(st.directory, st.cfg.hello.name, st.actors.ranks);
            self->send(self, heartbeat_atom::value);
          },
          [=](caf::error& e) {
            self->quit(make_error(errc::rank_unavailable, "node " + self->state.cfg.hello.name +
                                                              ", stage join: " + self->system().render(e)));
          });
  return {
      [=](heartbeat_atom) {
        auto& st = self->state;
        self->send(st.directory, heartbeat_atom::value, st.cfg.hello.name, st.cfg.hello.incarnation);
        self->delayed_send(self, std::chrono::milliseconds{st.welcome.heartbeat_interval_ms}, heartbeat_atom::value);
      },
      [=](drain_atom) { drain(self, false); },
      [=](drain_atom, bool for_restart) { drain(self, for_restart); },
      [=](poll_atom) { check_drained(self); },
      [=](member_gone_atom, const std::string& group, const std::vector<uint32_t>& members, const std::string& why,
          bool returned) {
        if (self->state.cfg.on_member_gone) self->state.cfg.on_member_gone(group, members, why, returned);
      },
      [=](replaced_atom, int32_t pid) {
        auto& st = self->state;
        stop_all(self);
        if (st.cfg.on_replaced) st.cfg.on_replaced(pid);
        self->quit(make_error(errc::rank_unavailable, "node " + st.cfg.hello.name + ": a newer process (pid " +
                                                          std::to_string(pid) + ") joined the head under its name"));
      },
  };
}

}  // namespace

node_agent_actor spawn_node_agent(caf::actor_system& sys, node_directory_actor directory, node_agent_config cfg,
                                  node_start start) {
  return sys.spawn(node_agent_impl, std::move(directory), std::move(cfg), std::move(start));
}

}  // namespace baton
