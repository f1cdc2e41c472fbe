// Actor overhead: request/response round trips and one-way message rate to a Baton decode rank
// (its real handlers: stats, kv_layer_ready), next to a bare CAF typed actor pair doing the same
// in the same run. Usage: baton_bench_actors [--scheduler-threads N] [--poll-attempts N]

#include <chrono>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/decode_rank.hpp"
#include "actors/messages.hpp"
#include "gpu/cpu_executor.hpp"
#include "transport/loopback.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

using ping_atom = caf::atom_constant<caf::atom("ping")>;
using bare_actor = caf::typed_actor<caf::replies_to<ping_atom>::with<int32_t>,
                                    caf::reacts_to<kv_layer_ready>>;

bare_actor::behavior_type bare_impl(bare_actor::pointer) {
  return {[](ping_atom) { return int32_t{42}; }, [](const kv_layer_ready&) {}};
}

/// `n` sequential round trips from an event-based actor to `target`, asking `Atom` and
/// expecting a `Reply`; returns seconds.
template <class Reply, class Atom, class Handle>
double round_trips(caf::actor_system& sys, Handle target, int n) {
  std::promise<void> done;
  auto fut = done.get_future();
  auto t0 = clock_type::now();
  sys.spawn([=, &done](caf::event_based_actor* self) {
    auto left = std::make_shared<int>(n);
    auto step = std::make_shared<std::function<void()>>();
    *step = [=, &done] {
      if ((*left)-- == 0) {
        done.set_value();
        return;
      }
      self->request(target, caf::infinite, Atom::value).then([=](const Reply&) { (*step)(); });
    };
    (*step)();
  });
  fut.wait();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// `n` one-way messages, then one round trip so that all were handled; returns seconds.
template <class Reply, class Atom, class Handle>
double one_way(caf::actor_system& sys, Handle target, int n) {
  caf::scoped_actor self{sys};
  auto t0 = clock_type::now();
  for (int i = 0; i < n; ++i) self->send(target, kv_layer_ready{0, 999999, 0, 0, 0, {}});
  self->request(target, caf::infinite, Atom::value).receive([](const Reply&) {}, [](caf::error&) {});
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t threads = 2, poll_attempts = 0;
  deploy::flag_set flags;
  flags.add("--scheduler-threads", &threads, "CAF scheduler threads (scheduler.max-threads)");
  flags.add("--poll-attempts", &poll_attempts, "CAF work-stealing.moderate-poll-attempts");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--scheduler-threads N] [--poll-attempts N]")) return *rc;
  caf::actor_system_config cfg;
  register_message_types(cfg);
  cfg.set("scheduler.max-threads", threads);
  cfg.set("work-stealing.moderate-poll-attempts", poll_attempts);
  caf::actor_system sys{cfg};

  auto model = gpu::builtin_tiny_config();
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(model, 1));
  auto fabric = transport::make_loopback_fabric();
  auto decode = spawn_decode_rank(sys, decode_rank_config{}, gpu::make_cpu_executor(model, weights, {.num_threads = 1, .num_kv_pages = 16, .page_size_tokens = 16}),
                                  transport::make_loopback_transport(fabric, "decode-0"));
  auto bare = sys.spawn(bare_impl);

  const int trips = 50000, msgs = 500000;
  round_trips<int32_t, ping_atom>(sys, bare, 2000);  // warm up
  round_trips<rank_stats, stats_atom>(sys, decode, 2000);
  const double rt_bare = round_trips<int32_t, ping_atom>(sys, bare, trips);
  const double rt_decode = round_trips<rank_stats, stats_atom>(sys, decode, trips);
  const double ow_bare = one_way<int32_t, ping_atom>(sys, bare, msgs);
  const double ow_decode = one_way<rank_stats, stats_atom>(sys, decode, msgs);

  std::printf("## Actor overhead (scheduler.max-threads=%u, work-stealing.moderate-poll-attempts=%u)\n\n", threads,
              poll_attempts);
  std::printf("| pair | round trip (1 in flight) | one-way messages |\n|---|---|---|\n");
  std::printf("| bare CAF typed actor pair | %.2f us (%.0f /s) | %.2f M msg/s |\n", rt_bare / trips * 1e6, trips / rt_bare,
              msgs / ow_bare / 1e6);
  std::printf("| event-based actor -> Baton decode rank (stats; kv_layer_ready) | %.2f us (%.0f /s) | %.2f M msg/s |\n",
              rt_decode / trips * 1e6, trips / rt_decode, msgs / ow_decode / 1e6);
  caf::anon_send_exit(decode, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(bare, caf::exit_reason::user_shutdown);
  return 0;
}
