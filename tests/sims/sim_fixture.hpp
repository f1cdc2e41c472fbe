#pragma once

// CAF's test coordinator as a discrete-event engine: one thread, virtual time
// (platform-notes §1.6). Tests drive it to a chosen virtual time or until nothing is left.

#include <memory>
#include <optional>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"

namespace baton::test {

struct sim_system {
  using time_point = caf::actor_clock::time_point;
  caf::actor_system_config cfg;
  caf::actor_system sys;
  caf::scheduler::test_coordinator& sched;

  static caf::actor_system_config& init(caf::actor_system_config& c) {
    register_message_types(c);
    c.set("scheduler.policy", caf::atom("testing"));
    c.set("logger.file-verbosity", caf::atom("quiet"));
    return c;
  }
  sim_system() : sys(init(cfg)), sched(dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler())) {}

  time_point now() { return sched.clock().now(); }

  /// Runs every event up to and including virtual time `t`; later timers stay pending.
  void run_until(time_point t) {
    for (size_t i = 0; i < 10'000'000; ++i) {
      sched.run();
      if (!sched.has_pending_timeout() || sched.clock().schedule().begin()->first > t) return;
      sched.trigger_timeout();
    }
  }

  /// Runs until no job and no timer is left (bounded).
  bool run_until_idle(size_t limit = 10'000'000) {
    for (size_t i = 0; i < limit; ++i) {
      sched.run();
      if (!sched.has_pending_timeout()) return true;
      sched.trigger_timeout();
    }
    return false;
  }

  using result_slot = std::shared_ptr<std::optional<caf::expected<completion>>>;

  /// Sends a request from a fresh client actor; the answer lands in the returned slot (empty
  /// until then), and the virtual time of its arrival in `*at`.
  result_slot generate(const router_actor& router, generate_request req, std::shared_ptr<time_point> at = nullptr) {
    auto out = std::make_shared<std::optional<caf::expected<completion>>>();
    sys.spawn([=](caf::event_based_actor* self) {
      self->request(router, std::chrono::seconds{3600}, generate_atom::value, req)
          .then(
              [=](completion& c) {
                *out = std::move(c);
                if (at) *at = self->clock().now();
              },
              [=](caf::error& e) {
                *out = std::move(e);
                if (at) *at = self->clock().now();
              });
    });
    return out;
  }

  /// Stops every actor of a cluster when the test leaves scope (also on a failed REQUIRE): the
  /// actor system's destructor waits for all actors, which under the test coordinator would
  /// otherwise never return.
  struct stopper {
    sim_system& sim;
    local_cluster& cluster;
    ~stopper() {
      for (auto& a : cluster.actors()) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
      sim.run_until_idle();
    }
  };

  /// A rank's event log, answered without advancing virtual time.
  template <class Handle>
  std::vector<rank_event> events(const Handle& rank) {
    auto out = std::make_shared<std::vector<rank_event>>();
    sys.spawn([=](caf::event_based_actor* self) {
      self->request(rank, std::chrono::seconds{3600}, events_atom::value).then([=](std::vector<rank_event>& e) {
        *out = std::move(e);
      });
    });
    sched.run();
    return *out;
  }

  /// A rank's stats, answered without advancing virtual time.
  template <class Handle>
  rank_stats stats(const Handle& rank) {
    auto out = std::make_shared<rank_stats>();
    sys.spawn([=](caf::event_based_actor* self) {
      self->request(rank, std::chrono::seconds{3600}, stats_atom::value).then([=](rank_stats& s) { *out = std::move(s); });
    });
    sched.run();
    return *out;
  }
};

}  // namespace baton::test
