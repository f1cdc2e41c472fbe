// What a request that fails after failing over says: the rank failure that made it fail over
// first, not only its last attempt's sentence (an on-call trial's streams, their decode ranks
// killed, ended with "no decode rank took work ... (no rank registered)" twice over, the dead
// rank named nowhere), and which code (rank_unavailable: no rank to place on is no lack of KV);
// and what a request hears when its router stops under it.

#include <doctest/doctest.h>

#include <thread>

#include <caf/typed_event_based_actor.hpp>

#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;

TEST_CASE("a stream whose only decode rank goes down mid-generation, with no rank to go to, fails as "
          "rank_unavailable naming the rank that went down and the failovers") {
  test::cluster_system t;
  auto cfg = test::small_cluster();
  cfg.router.request.max_attempts = 3;
  cfg.router.request.retry_backoff_ms = 1;
  cfg.router.request.queue_timeout_ms = 300;  // a re-placement waits this long for a decode rank
  cfg.router.request.place_timeout_ms = 300;
  // Decode steps 20 ms late: the generation is still going when its rank is killed.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto cluster = start_local_cluster(t.sys, cfg, [&](const std::string& name) -> std::shared_ptr<gpu::executor> {
    std::shared_ptr<gpu::executor> x = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    return name == "decode-0" ? gpu::make_fault_slow_executor(x, 20) : x;
  });
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  auto tokens = std::make_shared<std::atomic<uint32_t>>(0);
  auto sink = t.sys.spawn([tokens](client_sink_actor::pointer) -> client_sink_actor::behavior_type {
    return {[tokens](stream_chunk& c) { *tokens += static_cast<uint32_t>(c.tokens.size()); }};
  });
  generate_request req;
  req.prompt = test::prompts[0];
  req.max_tokens = 200;
  req.ignore_eos = true;
  auto asked = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req, sink);
  for (int i = 0; i < 3000 && tokens->load() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(tokens->load() >= 3);
  self->send_exit(cluster.decode[0].handle, caf::exit_reason::kill);
  std::string why;
  caf::error got;
  std::move(asked).receive([](completion&) { FAIL("answered with its decode rank dead"); },
                           [&](caf::error& e) { got = e, why = t.sys.render(e); });
  REQUIRE(got);
  CHECK_MESSAGE(static_cast<errc>(got.code()) == errc::rank_unavailable, why);
  CHECK_MESSAGE(why.find("stage place_decode: no decode rank took work within") != std::string::npos, why);
  CHECK_MESSAGE(why.find("(attempt 3 of 3, ") != std::string::npos, why);
  // The rank failure first, then the last re-placement that found no rank.
  CHECK_MESSAGE(why.find("it failed over 2 time(s), first after: request ") != std::string::npos, why);
  CHECK_MESSAGE(why.find("rank decode-0") != std::string::npos, why);
  CHECK_MESSAGE(why.find("; the last after: request ") != std::string::npos, why);
  // The router counted both failovers as they started, and the failure by its code: a request
  // from any client, not the gateway's calls alone (/metrics' baton_router_request_failures_total).
  self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
      .receive(
          [&](cluster_stats& s) {
            CHECK(s.num_failovers == 2);
            REQUIRE(s.failed_codes.size() == 1);
            CHECK(s.failed_codes[0] == "rank_unavailable");
            CHECK(s.failed_counts.at(0) == 1);
          },
          [&](caf::error& e) { FAIL(t.sys.render(e)); });
  self->send_exit(sink, caf::exit_reason::user_shutdown);
}

TEST_CASE("a router that stops answers its requests in flight (shutting_down, naming the router) and their ranks "
          "let go of their KV, instead of leaving the clients a broken promise") {
  test::cluster_system t;
  auto cfg = test::small_cluster();
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 20);  // 200 steps: seconds
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  generate_request req;
  req.prompt = "a long answer, cut short";
  req.max_tokens = 200;
  req.ignore_eos = true;
  auto pending = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req);
  const auto& decode = cluster.decode[0].handle;
  for (int i = 0; i < 5000 && t.stats(decode).num_steps < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(t.stats(decode).num_steps >= 3);
  self->send_exit(cluster.router, caf::exit_reason::user_shutdown);
  std::string why;
  std::move(pending).receive([&](completion&) { FAIL("finished after its router stopped"); },
                             [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("shutting_down") != std::string::npos, why);
  CHECK_MESSAGE(why.find("stage router: the router stopped before the answer") != std::string::npos, why);
  for (int i = 0; i < 5000 && t.stats(decode).num_free_pages != cfg.executor.num_kv_pages; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  CHECK(t.stats(decode).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("a rank whose setup failed (its KV pool refused by the transport) says so to its balancer and draws no "
          "work: every request goes to the ranks that can serve it") {
  test::cluster_system t;
  auto cfg = test::small_cluster();
  cfg.num_prefill_ranks = 2;
  cfg.num_decode_ranks = 2;
  cfg.router.request.max_attempts = 1;  // a placement on a broken rank would fail the request
  auto cluster = start_local_cluster(t.sys, cfg, {}, [](std::unique_ptr<transport::transport> inner,
                                                        const std::string& name) -> std::shared_ptr<transport::transport> {
    if (name == "prefill-1" || name == "decode-0")
      return std::make_shared<transport::failed_transport>("test: no pool registration");
    return std::shared_ptr<transport::transport>{std::move(inner)};
  });
  test::cluster_system::stopper stop{t, cluster};
  for (int i = 0; i < 6; ++i) {
    generate_request req;
    req.prompt = test::prompts[i % 3] + std::to_string(i);
    req.max_tokens = 3;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    CHECK(got->prefill_rank == "prefill-0");
    CHECK(got->decode_rank == "decode-1");
  }
  const auto broken = t.stats(cluster.decode[0].handle).unavailable;
  CHECK_MESSAGE(broken.find("cannot register the KV pool with the transport") != std::string::npos, broken);
  CHECK(t.stats(cluster.prefill[1].handle).unavailable.find("test: no pool registration") != std::string::npos);
  CHECK(t.stats(cluster.decode[1].handle).unavailable.empty());
}

TEST_CASE("a stream's chunks carry a handle that can only cancel: cancel_atom through it stops the generation, the "
          "caller hears cancelled, and the decode rank's pages come back") {
  static_assert(std::is_same_v<decltype(stream_chunk::request), request_cancel_actor>,
                "a client gets no handle to the request actor's own messages (run, timers, the watchdog)");
  test::cluster_system t;
  auto cfg = test::small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  auto tokens = std::make_shared<std::atomic<uint32_t>>(0);
  auto sink = t.sys.spawn([tokens](client_sink_actor::pointer me) -> client_sink_actor::behavior_type {
    return {[tokens, me](stream_chunk& c) {
      if (tokens->fetch_add(static_cast<uint32_t>(c.tokens.size())) == 0) me->send(c.request, cancel_atom::value);
    }};
  });
  generate_request req;
  req.prompt = test::prompts[1];
  req.max_tokens = 400;
  req.ignore_eos = true;
  std::string why;
  self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req, sink)
      .receive([](completion&) { FAIL("answered in full after its cancel"); },
               [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("cancelled") != std::string::npos, why);
  CHECK(tokens->load() < 400);
  bool back = false;
  for (int i = 0; i < 500 && !back; ++i) {
    back = t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(back);
}
