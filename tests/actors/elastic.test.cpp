// Issue 15: elastic P/D in a live cluster -- elastic instances move between prefill and decode
// as the load shifts, and every request completes with the tokens of a static run.

#include <doctest/doctest.h>

#include <thread>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/actors/elastic_phases.hpp"

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

/// 1 fixed prefill + 1 fixed decode rank + 2 elastic instances (elastic-0 prefills, elastic-1
/// decodes), with the eager planner of the shared phases.
local_cluster_config eager_elastic_config() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.num_elastic_ranks = 2;
  cfg.elastic_prefill_at_start = 1;
  cfg.executor.num_kv_pages = 1024;  // 16K tokens per instance
  cfg.prefill.chunk_tokens = 32;
  test::eager_elastic_planner(&cfg.elastic);
  return cfg;
}

/// Waits (bounded) until each balancer knows two ranks: a fixed rank and one elastic instance's side.
void await_two_each(caf::scoped_actor& self, const local_cluster& cluster) {
  for (int i = 0; i < 1000 && (registered(self, cluster.prefill_balancer) < 2 || registered(self, cluster.decode_balancer) < 2); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
}

/// `n` one-token prompts (answered by prefill ranks alone), all in flight at once: a prefill-heavy
/// load that keeps the prefill queue hot for the planner's hold time; waits for every answer.
void one_token_burst(test::cluster_system& t, caf::scoped_actor& self, const router_actor& router, int n) {
  std::vector<decltype(self->request(router, std::chrono::seconds{120}, generate_atom::value, generate_request{}))> handles;
  for (int i = 0; i < n; ++i) {
    generate_request req;
    req.prompt = std::string(99, static_cast<char>('a' + i % 26));
    req.max_tokens = 1;
    handles.push_back(self->request(router, std::chrono::seconds{120}, generate_atom::value, std::move(req)));
  }
  for (auto& h : handles) h.receive([](completion&) {}, [&](caf::error& e) { FAIL(t.sys.render(e)); });
}

/// An elastic instance's ranks as its node's directory entry lists them.
node_ranks ranks_of(const elastic_instance& e) {
  node_ranks out;
  out.prefill.push_back(e.prefill);
  out.decode.push_back(e.decode);
  out.names.push_back(e.name);
  return out;
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
  await_two_each(self, cluster);
  REQUIRE(registered(self, cluster.prefill_balancer) == 2);  // prefill-0 and elastic-0
  REQUIRE(registered(self, cluster.decode_balancer) == 2);   // decode-0 and elastic-1

  const auto got = test::run_elastic_phases(t.sys, self, cluster.router, cluster.elastic_controller, cfg, "elastic-1");
  CHECK(t.stats(cluster.elastic[1].decode).migrated_out == got.migrations);
  // The moved instances' actors say what they did.
  auto saw = [&](const auto& rank, const char* kind) {
    const auto ev = t.events(rank);
    return std::any_of(ev.begin(), ev.end(), [&](auto& e) { return e.kind == kind; });
  };
  CHECK(saw(cluster.elastic[1].decode, "role_standby"));
  CHECK(saw(cluster.elastic[1].prefill, "role_active"));
}

TEST_CASE("elastic P/D: a controller interval of 0 is refused by name (its timer would spin)") {
  auto cfg = eager_elastic_config();
  cfg.elastic.interval_ms = 0;
  CHECK(cfg.validate() == "elastic interval_ms (--elastic-interval-ms) must be > 0");
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
  await_two_each(self, cluster);
  std::vector<decltype(self->request(cluster.router, std::chrono::seconds{1}, generate_atom::value, generate_request{}))> handles;
  // Prompts of one token each (answered by prefill ranks alone) keep the prefill queue hot past
  // the planner's hold time; a few long generations keep the decode side busy.
  for (int i = 0; i < 80; ++i) {
    generate_request req;
    req.prompt = std::string(99, static_cast<char>('a' + i % 26));
    req.max_tokens = i < 4 ? 200 : 1;
    req.ignore_eos = true;
    handles.push_back(self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, std::move(req)));
  }
  for (auto& h : handles) h.receive([](completion&) {}, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  auto log = test::role_changes(self, cluster.elastic_controller);
  REQUIRE_FALSE(log.empty());
  CHECK(log[0].state == "abandoned");
  CHECK(test::done_changes(log) == 0);
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

TEST_CASE("elastic P/D: the ranks of a node that drains are never moved again (the controller forgets them)") {
  test::cluster_system t;
  auto cfg = eager_elastic_config();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  await_two_each(self, cluster);
  // As a node agent tells it when its node drains: elastic-1 (the decode-side instance, the only
  // one a prefill-heavy load could move) leaves.
  self->send(cluster.elastic_controller, drain_atom::value, ranks_of(cluster.elastic[1]));
  one_token_burst(t, self, cluster.router, 40);
  std::this_thread::sleep_for(std::chrono::milliseconds{200});  // ten planning rounds
  CHECK(test::role_changes(self, cluster.elastic_controller).empty());
}

TEST_CASE("elastic P/D: a node given up for gone that comes back serves again: the side a move had drained is open "
          "again, and its instance is moved again") {
  test::cluster_system t;
  auto cfg = eager_elastic_config();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  await_two_each(self, cluster);
  REQUIRE(registered(self, cluster.decode_balancer) == 2);
  const auto& inst = cluster.elastic[1];  // serves decode
  const auto ranks = ranks_of(inst);
  // A move to prefill drained its decode side; then its node went silent, and the node
  // directory gave it up (mark_gone) ...
  self->send(cluster.decode_balancer, drain_atom::value, inst.decode);
  self->send(cluster.decode_balancer, forget_atom::value, inst.decode);
  self->send(cluster.prefill_balancer, forget_atom::value, inst.prefill);
  self->send(cluster.elastic_controller, drain_atom::value, ranks);
  for (int i = 0; i < 1000 && registered(self, cluster.decode_balancer) != 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(registered(self, cluster.decode_balancer) == 1);
  // ... and its heartbeats came back: the directory lets its ranks back, draining as they were,
  // asks them to report, and tells the controller.
  self->send(cluster.decode_balancer, rejoin_atom::value, inst.decode, true);
  self->send(cluster.prefill_balancer, rejoin_atom::value, inst.prefill, true);
  self->send(inst.decode, health_atom::value);
  self->send(inst.prefill, health_atom::value);
  self->send(cluster.elastic_controller, rejoin_atom::value, ranks);
  for (int i = 0; i < 1000 && registered(self, cluster.decode_balancer) != 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(registered(self, cluster.decode_balancer) == 2);
  // Open again: the balancer's last word on it is not "still draining" (the rank's report and
  // the controller's undrain may come in either order).
  std::string last;
  for (int i = 0; i < 500; ++i) {
    std::vector<placement_record> events;
    self->request(cluster.decode_balancer, std::chrono::seconds{5}, events_atom::value)
        .receive([&](std::vector<placement_record>& r) { events = std::move(r); }, [](caf::error&) {});
    for (const auto& e : events)
      if (e.rank == "elastic-1" && (e.why.rfind("rejoined", 0) == 0 || e.why.rfind("undrained", 0) == 0)) last = e.why;
    if (last == "rejoined" || last.rfind("undrained", 0) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  CHECK_MESSAGE((last == "rejoined" || last.rfind("undrained", 0) == 0), last);
  // A prefill-heavy load moves it, as any decode instance (a forgotten one never moves): bursts
  // until the planner has seen one hot for its hold time (bounded: a loaded machine may drain one
  // before a planning round looks).
  std::vector<role_change> log;
  for (int burst = 0; burst < 8 && log.empty(); ++burst) {
    one_token_burst(t, self, cluster.router, 120);
    for (int i = 0; i < 50 && log.empty(); ++i) {
      log = test::role_changes(self, cluster.elastic_controller);
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
  }
  REQUIRE_FALSE(log.empty());
  CHECK(log[0].rank == "elastic-1");
}
