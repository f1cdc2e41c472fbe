// Issue 15: elastic P/D in a live cluster -- elastic instances move between prefill and decode
// as the load shifts, and every request completes with the tokens of a static run.

#include <doctest/doctest.h>

#include <thread>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;

namespace {

size_t registered(caf::scoped_actor& self, const prefill_balancer_actor& pb) {
  size_t n = 0;
  self->request(pb, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { n = l.size(); }, [](caf::error&) {});
  return n;
}
size_t registered(caf::scoped_actor& self, const decode_balancer_actor& db) {
  size_t n = 0;
  self->request(db, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { n = l.size(); }, [](caf::error&) {});
  return n;
}

std::vector<role_change> changes(caf::scoped_actor& self, const elastic_controller_actor& c) {
  std::vector<role_change> out;
  self->request(c, std::chrono::seconds{5}, events_atom::value).receive([&](std::vector<role_change>& l) { out = std::move(l); }, [](caf::error&) {});
  return out;
}

/// 1 fixed prefill + 1 fixed decode rank + 2 elastic instances (elastic-0 prefills, elastic-1
/// decodes), with targets that make load phases unambiguous: any queued prompt is far over a
/// 1 ms TTFT target; decode pressure comes from KV alone (steps never near a 1,000 s TBT).
local_cluster_config eager_elastic_config() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.num_elastic_ranks = 2;
  cfg.elastic_prefill_at_start = 1;
  cfg.executor.num_kv_pages = 1024;  // 16K tokens per instance
  cfg.prefill.chunk_tokens = 32;
  auto& p = cfg.elastic.planner;
  p.ttft_target_ms = 1;
  p.tbt_target_ms = 1e6;
  p.kv_full = 1.0;
  p.smooth_s = 0;
  p.hold_s = 0;
  p.cooldown_s = 0.3;
  p.dwell_s = 1;
  cfg.elastic.interval_ms = 20;
  return cfg;
}

size_t done_changes(const std::vector<role_change>& log) {
  return static_cast<size_t>(std::count_if(log.begin(), log.end(), [](auto& c) { return c.state == "done"; }));
}

}  // namespace

TEST_CASE("elastic P/D: a prefill-heavy load turns a decode instance into a prefill one, a decode-heavy load turns "
          "one back, and every request gets the tokens of a static run") {
  test::cluster_system t;
  auto cfg = eager_elastic_config();
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  for (int i = 0; i < 1000 && (registered(self, cluster.prefill_balancer) < 2 || registered(self, cluster.decode_balancer) < 2); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(registered(self, cluster.prefill_balancer) == 2);  // prefill-0 and elastic-0
  REQUIRE(registered(self, cluster.decode_balancer) == 2);   // decode-0 and elastic-1

  auto send = [&](std::string prompt, int32_t max_tokens) {
    generate_request req;
    req.prompt = std::move(prompt);
    req.max_tokens = max_tokens;
    req.ignore_eos = true;
    return self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, std::move(req));
  };
  // Phase 1, prefill-heavy: 40 prompts of 100 tokens, one token each (a few % of decode KV),
  // after 4 long generations, some of which decode on elastic-1 when it is moved.
  std::vector<std::string> prompts;
  std::vector<decltype(send("", 1))> handles;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back("a long story, part " + std::to_string(i));
    handles.push_back(send(prompts.back(), 300));
  }
  for (int i = 0; i < 40; ++i) {
    std::string s;
    for (int k = 0; k < 99; ++k) s.push_back(static_cast<char>('a' + (i * 7 + k * 3) % 26));
    prompts.push_back(s);
    handles.push_back(send(s, 1));
  }
  std::vector<completion> done(handles.size());
  for (size_t i = 0; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 1 request " << i << ": " << t.sys.render(e)); });
  auto log = changes(self, cluster.elastic_controller);
  for (int i = 0; i < 500 && done_changes(log) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
    log = changes(self, cluster.elastic_controller);
  }
  REQUIRE(done_changes(log) >= 1);
  CHECK(log[0].rank == "elastic-1");
  CHECK(log[0].from == "decode");
  CHECK(log[0].to == "prefill");
  CHECK_MESSAGE(log[0].why.find("prefill pool hot, decode pool cold") == 0, log[0].why);
  // Phase 2, decode-heavy: 10 short prompts with 1,400 tokens each reserve 85% of decode-0's KV.
  const size_t phase2 = handles.size();
  for (int i = 0; i < 10; ++i) {
    prompts.push_back("decode heavy " + std::to_string(i));
    handles.push_back(send(prompts.back(), 1400));
  }
  done.resize(handles.size());
  for (size_t i = phase2; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 2 request " << i << ": " << t.sys.render(e)); });
  log = changes(self, cluster.elastic_controller);
  REQUIRE(done_changes(log) >= 2);
  const auto& back = *std::find_if(log.begin() + 1, log.end(), [](auto& c) { return c.state == "done"; });
  CHECK(back.from == "prefill");
  CHECK(back.to == "decode");
  CHECK_MESSAGE(back.why.find("decode pool hot, prefill pool cold") == 0, back.why);
  for (const auto& c : log) MESSAGE(c.at_s << " s: " << c.rank << " " << c.from << " -> " << c.to << " (" << c.state << ", " << c.drain_s << " s): " << c.why);
  // Nothing lost or duplicated: every request answered once, by ranks that were serving then;
  // the tokens are those of the prompt run alone.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{17}, size_t{43}, handles.size() - 1}) {
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), done[i].tokens.size(), 32, {}, true);
    CHECK_MESSAGE(done[i].tokens == ref.tokens, "request " << i);
  }
  for (size_t i = phase2; i < handles.size(); ++i) CHECK(done[i].tokens.size() == 1400);
  // No request was recomputed: a decode rank that left decode handed its sequences over with
  // their KV (migrate_on_drain).
  uint32_t migrations = 0;
  for (const auto& c : done) {
    CHECK(c.failovers == 0);
    migrations += c.migrations;
  }
  MESSAGE(migrations << " decode sequences moved with their KV during role changes");
  CHECK(migrations > 0);
  CHECK(t.stats(cluster.elastic[1].decode).migrated_out == migrations);
  // The moved instances' actors say what they did.
  auto saw = [&](const auto& rank, const char* kind) {
    const auto ev = t.events(rank);
    return std::any_of(ev.begin(), ev.end(), [&](auto& e) { return e.kind == kind; });
  };
  CHECK(saw(cluster.elastic[1].decode, "role_standby"));
  CHECK(saw(cluster.elastic[1].prefill, "role_active"));
}

TEST_CASE("elastic P/D: an instance's two actors share one fate -- the side that dies takes the other with it") {
  test::cluster_system t;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.num_elastic_ranks = 1;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  self->monitor(cluster.elastic[0].prefill);
  self->send_exit(cluster.elastic[0].decode, caf::exit_reason::kill);
  bool down = false;
  self->receive([&](caf::down_msg& dm) { down = dm.source == caf::actor_cast<caf::actor_addr>(cluster.elastic[0].prefill); },
                caf::after(std::chrono::seconds{10}) >> [] {});
  CHECK(down);
  // The fixed ranks serve on.
  generate_request req;
  req.prompt = "still serving";
  req.max_tokens = 3;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->prefill_rank == "prefill-0");
}

TEST_CASE("elastic P/D: a move not drained in time is abandoned, and the rank serves on in its old role") {
  test::cluster_system t;
  auto cfg = eager_elastic_config();
  cfg.elastic.drain_timeout_ms = 0;     // every drain is too slow: each move is abandoned
  cfg.elastic.migrate_on_drain = false; // and nothing hands its sequences over
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  for (int i = 0; i < 1000 && (registered(self, cluster.prefill_balancer) < 2 || registered(self, cluster.decode_balancer) < 2); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  std::vector<decltype(self->request(cluster.router, std::chrono::seconds{1}, generate_atom::value, generate_request{}))> handles;
  for (int i = 0; i < 30; ++i) {
    generate_request req;
    req.prompt = std::string(99, static_cast<char>('a' + i % 26));
    req.max_tokens = i < 4 ? 200 : 1;  // a few long ones keep the decode side busy
    req.ignore_eos = true;
    handles.push_back(self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, std::move(req)));
  }
  for (auto& h : handles) h.receive([](completion&) {}, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  auto log = changes(self, cluster.elastic_controller);
  REQUIRE_FALSE(log.empty());
  CHECK(log[0].state == "abandoned");
  CHECK(done_changes(log) == 0);
  // The abandoned rank's balancer places on it again.
  std::vector<placement_record> placed;
  self->request(cluster.decode_balancer, std::chrono::seconds{5}, events_atom::value)
      .receive([&](std::vector<placement_record>& r) { placed = std::move(r); }, [](caf::error&) {});
  CHECK(std::any_of(placed.begin(), placed.end(), [&](auto& r) { return r.rank == log[0].rank && r.why.find("undrained") == 0; }));
}

TEST_CASE("elastic P/D: the prefill balancer's stats give each rank's length bucket, the signal the controller reads for the "
          "planner") {
  test::cluster_system t;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 2;
  cfg.num_decode_ranks = 1;
  cfg.prefill_balancer.buckets.upper_bounds_tokens = {64};  // prompts of 64 tokens and more: bucket 1
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  for (int i = 0; i < 1000 && registered(self, cluster.prefill_balancer) < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(registered(self, cluster.prefill_balancer) == 2);
  // Only long prompts: bucket 1 holds all the demand, so the allocator gives it an engine at once.
  for (uint64_t i = 0; i < 3; ++i)
    self->request(cluster.prefill_balancer, std::chrono::seconds{10}, place_atom::value, place_query{1 + i, 100, 0, 110})
        .receive([](prefill_placement&) {}, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  std::vector<rank_load> loads;
  self->request(cluster.prefill_balancer, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](std::vector<rank_load>& l) { loads = std::move(l); }, [](caf::error&) {});
  REQUIRE(loads.size() == 2);
  CHECK(std::count_if(loads.begin(), loads.end(), [](const rank_load& l) { return l.bucket == 1; }) >= 1);
  for (const auto& l : loads) CHECK(l.bucket <= 1);
}
