// Simulation speed (issue 8): the whole Mooncake conversation trace (12,031 requests, 59 min) on
// 16 simulated H200s (Llama-3-70B, TP2: 5 prefill + 3 decode instances) through the production
// actors under CAF's test coordinator, next to the ceiling it chases, measured in the same run:
// the test coordinator's own rate of message-plus-timer events between two bare actors (what a
// simulator built on it could do if Baton's actors cost nothing). Goal: <= 10 s on one core
// (>= 1,200 requests/s). Usage: baton_bench_sim [TRACE] (default: the copy in traces)

#include <chrono>
#include <cstdio>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include "actors/messages.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

/// Two bare actors under the test coordinator: each event is a message, every other one also a
/// timer (as the sim's steps are). Returns events per second.
double bare_events_per_s(uint64_t n) {
  caf::actor_system_config cfg;
  cfg.set("scheduler.policy", caf::atom("testing"));
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{cfg};
  auto& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
  auto echo = sys.spawn([](caf::event_based_actor* self) {
    return caf::behavior{[=](uint64_t i) { self->delayed_send(caf::actor_cast<caf::actor>(self->current_sender()), std::chrono::microseconds{10}, i + 1); }};
  });
  auto left = std::make_shared<uint64_t>(n);
  sys.spawn([echo, left](caf::event_based_actor* self) {
    self->send(echo, uint64_t{0});
    return caf::behavior{[=](uint64_t i) {
      if (--*left > 0) self->send(echo, i);
    }};
  });
  const auto t0 = clock_type::now();
  uint64_t events = 0;
  for (;;) {
    events += sched.run();
    if (!sched.has_pending_timeout()) break;
    sched.trigger_timeout();
    ++events;
  }
  const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
  anon_send_exit(echo, caf::exit_reason::user_shutdown);
  sched.run();
  return static_cast<double>(events) / s;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  deploy::flag_set flags;
  flags.collect_positional(&positional);
  if (auto rc = bench::parse_flags(flags, argc, argv, "[TRACE.jsonl]  (default: traces/mooncake_conversation_trace.jsonl)")) return *rc;
  if (positional.size() > 1) return std::fprintf(stderr, "baton_bench_sim: one trace at most, got %zu\n", positional.size()), 2;
  const std::string path = positional.empty() ? BATON_SOURCE_DIR "/traces/mooncake_conversation_trace.jsonl" : positional[0];
  sims::trace t;
  std::string why;
  if (!sims::load_trace(path, {}, &t, &why)) {
    std::fprintf(stderr, "baton_bench_sim: %s\n", why.c_str());
    return 2;
  }
  sims::tune_allocator_for_sims();  // as `baton sim` does
  const double ceiling = bare_events_per_s(2'000'000);
  sims::sim_config cfg;  // Llama-3-70B, TP2 on H200
  cfg.prefill_instances = 5;
  cfg.decode_instances = 3;
  const auto t0 = clock_type::now();
  sims::sim_result r;
  if (!sims::run_sim(cfg, t, path, &r, &why)) {
    std::fprintf(stderr, "baton_bench_sim: %s\n", why.c_str());
    return 1;
  }
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  const double n = static_cast<double>(t.requests.size());
  std::printf("trace: %s, %zu requests, %.0f s of arrivals; 16 simulated H200s (5 prefill + 3 decode instances, TP2)\n",
              path.c_str(), t.requests.size(), t.span_s());
  std::printf("sim: %.2f s wall, %.0f requests/s, %.0f s virtual (%.0fx real time), %zu completed\n", wall, n / wall,
              r.virtual_s, r.virtual_s / wall, r.summary.completed);
  std::printf("events: %.2fM, %.0f per request, %.2fM events/s\n", static_cast<double>(r.events) / 1e6,
              static_cast<double>(r.events) / n, static_cast<double>(r.events) / wall / 1e6);
  std::printf("ceiling: bare test-coordinator events %.2fM/s; the sim reaches %.0f%% of it\n", ceiling / 1e6,
              100.0 * static_cast<double>(r.events) / wall / ceiling);
  std::printf("goal: <= 10 s (>= 1,200 requests/s): %s\n", wall <= 10.0 ? "met" : "missed");
  return 0;
}
