// Issue 15: a draining decode rank hands its running sequences, KV and all, to another decode
// rank; they continue there from the moved KV (no recompute) with the tokens they would have had.

#include <doctest/doctest.h>

#include <thread>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;

TEST_CASE("a drained decode rank moves its running sequences with their KV; they finish elsewhere with the same "
          "tokens, no recompute") {
  test::cluster_system t;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 2;
  cfg.executor.num_kv_pages = 512;
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  const auto& leaving = cluster.decode[1].handle;

  constexpr int n = 6, max_tokens = 400;
  std::vector<std::string> prompts;
  std::vector<decltype(self->request(cluster.router, std::chrono::seconds{1}, generate_atom::value, generate_request{}))> handles;
  for (int i = 0; i < n; ++i) {
    generate_request req;
    req.prompt = "moving sequence number " + std::to_string(i) + (i % 2 ? " with more words in it" : "");
    req.max_tokens = max_tokens;
    req.ignore_eos = true;
    prompts.push_back(req.prompt);
    handles.push_back(self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, std::move(req)));
  }
  // Once the leaving rank decodes some of them (bounded wait), drain it and move them.
  bool running = false;
  for (int i = 0; i < 2000 && !running; ++i) {
    running = t.stats(leaving).num_running > 0;
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  REQUIRE(running);
  self->send(cluster.decode_balancer, drain_atom::value, leaving);
  self->send(leaving, migrate_atom::value);

  std::vector<completion> done(n);
  for (int i = 0; i < n; ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("request " << i << ": " << t.sys.render(e)); });
  const auto st = t.stats(leaving);
  CHECK(st.migrated_out > 0);
  CHECK(st.migrate_failed == 0);
  CHECK(st.num_running == 0);
  uint32_t moved = 0;
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(done[i].failovers == 0);  // nothing was recomputed
    CHECK(done[i].tokens.size() == max_tokens);
    moved += done[i].migrations;
    if (done[i].migrations) CHECK(done[i].decode_rank == cluster.decode[0].name);
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), max_tokens, 64, {}, true);
    CHECK(done[i].tokens == ref.tokens);
  }
  CHECK(moved == st.migrated_out);
  MESSAGE(moved << " of " << n << " sequences moved, KV and all");
}
