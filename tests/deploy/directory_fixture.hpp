#pragma once

// What the node-process tests share: an actor system with CAF's network layer, and stand-ins
// for a node's agent and for the processes that post to the node directory's rendezvous.

#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "actors/node_directory.hpp"

namespace baton::test {

struct network_system {
  caf::actor_system_config cfg;
  caf::actor_system sys;
  static caf::actor_system_config& init(caf::actor_system_config& c) {
    register_message_types(c);
    c.load<caf::io::middleman>();
    c.set("scheduler.max-threads", 2);
    c.set("work-stealing.moderate-poll-attempts", 0);
    return c;
  }
  network_system() : sys(init(cfg)) {}
};

/// What a stand-in node agent heard from the directory: loss notices, and drain requests (which
/// the tests send after the directory's own messages, to know those were handled).
struct gone_log {
  std::mutex m;
  std::vector<std::tuple<std::string, std::vector<uint32_t>, std::string>> got;
  uint32_t drains = 0;
  uint32_t returns = 0;  ///< notices that members came back to a shrunk group
  int32_t replaced_by = 0;  ///< a newer process under its name (replaced_atom)
};

/// Node `name`'s state in the directory's register (empty: not there), asked by `self` -- so
/// after anything `self` sent the directory before.
inline std::string state_of(caf::scoped_actor& self, const node_directory_actor& dir, const std::string& name) {
  std::string out;
  self->request(dir, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](std::vector<node_status>& s) { for (const auto& x : s) if (x.name == name) out = x.state; },
               [](caf::error&) {});
  return out;
}

/// A directory for stand-in agents, which never heartbeat: its liveness sweep does not fire within a
/// test (with the default 2 s, a stalled machine would see them given up for silence, and their
/// groups lost, in the middle of a test that is about something else).
inline node_directory_config stand_in_directory() {
  node_directory_config dc;
  dc.heartbeat_interval_ms = 60000;
  return dc;
}

/// A stand-in for a node's agent: joins the directory as process 1 of `name`, and records what
/// the directory tells it.
inline node_agent_actor spawn_agent_stand_in(caf::actor_system& sys, node_directory_actor dir, const std::string& name,
                                      std::shared_ptr<gone_log> log, std::optional<node_ranks> ranks = {}) {
  return sys.spawn([dir, name, log, ranks](node_agent_actor::pointer self) -> node_agent_actor::behavior_type {
    // (drain_atom, bool): as a node's agent, tells the directory it drains (to be restarted or not).
    // Once joined, its ranks, as a node's agent tells them (the directory takes them from it alone).
    self->request(dir, std::chrono::seconds{5}, join_atom::value, node_hello{name, {"decode"}, 1})
        .then([=](cluster_welcome&) {
          if (ranks) self->send(dir, name, *ranks);
        });
    return {[](heartbeat_atom) {},
            [log](drain_atom) {
              std::lock_guard<std::mutex> lock{log->m};
              ++log->drains;
            },
            [self, dir, name, log](drain_atom, bool for_restart) {
              std::lock_guard<std::mutex> lock{log->m};
              ++log->drains;
              self->send(dir, drain_atom::value, name, for_restart);
            },
            [](poll_atom) {},
            [log](member_gone_atom, const std::string& g, const std::vector<uint32_t>& m, const std::string& why,
                  bool returned) {
              if (returned) ++log->returns;
              std::lock_guard<std::mutex> lock{log->m};
              log->got.emplace_back(g, m, why);
            },
            [log](replaced_atom, int32_t pid) {
              std::lock_guard<std::mutex> lock{log->m};
              log->replaced_by = pid;
            }};
  });
}

/// A post to the directory's rendezvous, and what came of it (post_async).
struct rendezvous_post {
  std::string group;
  uint32_t size = 0, first = 0;
  std::vector<std::string> cards;
  std::string node;
  int32_t pid = 1;
  uint32_t shrink_after_ms = 0;
};
struct answer_box {
  std::mutex m;
  bool sent = false, answered = false;
  std::vector<std::string> cards;
  std::string error;
};

/// Posts `p` from an actor of its own, so that the test can look at the answer without waiting
/// for it (sent(), answered(), cards()).
inline std::shared_ptr<answer_box> post_async(caf::actor_system& sys, node_directory_actor dir, rendezvous_post p) {
  auto box = std::make_shared<answer_box>();
  sys.spawn([dir, box, p](caf::event_based_actor* self) {
    self->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, p.group, p.size, p.first, p.cards, p.node, p.pid,
                  p.shrink_after_ms)
        .then(
            [box](std::vector<std::string>& c) {
              std::lock_guard<std::mutex> lock{box->m};
              box->answered = true, box->cards = c;
            },
            [box, self](caf::error& e) {
              std::lock_guard<std::mutex> lock{box->m};
              box->answered = true, box->error = self->system().render(e);
            });
    std::lock_guard<std::mutex> lock{box->m};
    box->sent = true;
  });
  return box;
}
inline bool sent(const std::shared_ptr<answer_box>& b) {
  std::lock_guard<std::mutex> lock{b->m};
  return b->sent;
}
inline bool answered(const std::shared_ptr<answer_box>& b) {
  std::lock_guard<std::mutex> lock{b->m};
  return b->answered;
}
inline std::vector<std::string> cards(const std::shared_ptr<answer_box>& b) {
  std::lock_guard<std::mutex> lock{b->m};
  return b->cards;
}
/// Waits (bounded: 5 s) until every box is answered.
inline bool await_answers(std::initializer_list<std::shared_ptr<answer_box>> boxes) {
  for (int i = 0; i < 500; ++i) {
    if (std::all_of(boxes.begin(), boxes.end(), [](const auto& b) { return answered(b); })) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  return false;
}

}  // namespace baton::test
