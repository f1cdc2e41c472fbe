#include <doctest/doctest.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include "actors/local_cluster.hpp"
#include "sims/modelled_executor.hpp"

using namespace baton;

namespace {

/// CAF's test coordinator as a discrete-event engine: one thread, virtual time.
struct sim_system {
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

  /// Runs ready jobs, then jumps to the earliest timer, until nothing is left or `limit` events.
  void run_until_idle(size_t limit = 1'000'000) {
    for (size_t i = 0; i < limit; ++i) {
      sched.run();
      if (!sched.has_pending_timeout()) return;
      sched.trigger_timeout();
    }
    FAIL("simulation did not settle");
  }
};

sims::modelled_executor_config model_times() {
  sims::modelled_executor_config m;
  m.prefill = {0.01, 0.002, 5.0};   // alpha, beta, gamma in microseconds
  m.decode = {800.0, 10.0, 0.1};    // base, per sequence, per context token
  m.num_kv_pages = 64;
  return m;
}

}  // namespace

TEST_CASE("sim seam: the production actors serve a request in virtual time and TTFT is the modelled times summed") {
  sim_system s;
  local_cluster_config cfg;
  cfg.prefill.chunk_tokens = 16;
  const auto times = model_times();
  auto make_exec = [&](const std::string&) -> std::shared_ptr<gpu::executor> {
    return sims::make_modelled_executor(cfg.model, times);
  };
  auto cluster = start_local_cluster(s.sys, cfg, make_exec);

  generate_request req;
  req.prompt = "forty bytes of prompt, in three chunks!";  // + <bos> = 40 tokens: 16 + 16 + 8
  req.max_tokens = 5;
  auto result = std::make_shared<caf::expected<completion>>(caf::error{});
  const auto t0 = s.sched.clock().now();
  s.sys.spawn([=](caf::event_based_actor* self) {
    self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req)
        .then([=](completion& c) { *result = std::move(c); }, [=](caf::error& e) { *result = std::move(e); });
  });
  s.run_until_idle();
  REQUIRE_MESSAGE(*result, s.sys.render(result->error()));
  const auto& c = **result;

  // Expected TTFT: the three chunks' modelled times, summed independently of the actors.
  const uint32_t layers = cfg.model.num_hidden_layers;
  const uint32_t n = c.num_prompt_tokens;
  REQUIRE(n == 40);
  int64_t expected_ns = 0;
  for (uint32_t start = 0; start < n; start += 16) {
    gpu::forward_job job{0, {gpu::forward_seq{0, std::vector<int32_t>(std::min(16u, n - start), 1), start, {}, true}}};
    expected_ns += sims::modelled_layer_ns(job, cfg.model, times) * layers;
  }
  CHECK(c.ttft_us * 1000 == expected_ns / 1000 * 1000);
  CHECK(c.ttft_us == expected_ns / 1000);
  // Each decode step took exactly its modelled time too.
  REQUIRE(c.tokens.size() == 5);
  REQUIRE(c.tbt_us.size() == 4);
  for (uint32_t i = 0; i < 4; ++i) {
    gpu::forward_job step{0, {gpu::forward_seq{0, {1}, n + i, {}, true}}, gpu::forward_job::decode};
    CHECK(c.tbt_us[i] == sims::modelled_layer_ns(step, cfg.model, times) * layers / 1000);
  }
  CHECK(c.tokens[0] == 'a');
  CHECK(s.sched.clock().now() - t0 >= std::chrono::microseconds{c.ttft_us});
  caf::anon_send_exit(cluster.router, caf::exit_reason::user_shutdown);
  for (auto& r : cluster.prefill) caf::anon_send_exit(r.handle, caf::exit_reason::user_shutdown);
  for (auto& r : cluster.decode) caf::anon_send_exit(r.handle, caf::exit_reason::user_shutdown);
  s.run_until_idle();
}
