#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <caf/event_based_actor.hpp>

#include "gpu/fault_executor.hpp"
#include "tests/actors/batching_fixture.hpp"

using namespace baton;
using baton::test::check_colocated;
using baton::test::collect_all;
using baton::test::send_request;
using baton::test::small_cluster;
using baton::test::wait_for_steps;

namespace {

/// Four placements of `new_tokens`-token prompts asked of the prefill balancer directly, without
/// load reports in between; the ranks they went to, in order.
std::vector<std::string> four_placements(test::cluster_system& t, caf::scoped_actor& self, const local_cluster& c,
                                         uint32_t new_tokens) {
  std::vector<std::string> placed;
  for (uint64_t i = 0; i < 4; ++i)
    self->request(c.prefill_balancer, std::chrono::seconds{10}, place_atom::value,
                  place_query{100 + i, new_tokens, 0, new_tokens + 6})
        .receive([&](prefill_placement& p) { placed.push_back(p.name); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  return placed;
}

/// Three prefill ranks that split prompts of 128 tokens or more, one decode rank; chunks of 64.
local_cluster_config split_cluster_config() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 3;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_kv_pages = 64;
  cfg.prefill.chunk_tokens = 64;
  cfg.prefill_balancer.policy = "split";
  cfg.prefill_balancer.split_min_tokens = 128;
  return cfg;
}

}  // namespace

TEST_CASE("continuous batching: requests of different lengths share steps, one joins mid-stream, and every "
          "request's tokens and logits equal its single-request run") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  // Context lengths can never coincide: the second prompt is longer than the first, and the late
  // one is shorter than the first's context when it joins (>= 10 + 5 steps).
  const std::vector<std::string> prompts = {"short one", "a noticeably longer prompt than the first", "late"};
  const std::vector<int32_t> max_tokens = {300, 300, 12};
  caf::scoped_actor self{t.sys};
  auto send = [&](size_t i) {
    generate_request req;
    req.prompt = prompts[i];
    req.max_tokens = max_tokens[i];
    req.return_logits = true;
    req.ignore_eos = true;  // the first two must still be decoding when the third joins
    return self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, std::move(req));
  };
  std::vector<decltype(send(0))> handles;
  handles.push_back(send(0));
  handles.push_back(send(1));
  // Wait (bounded) until the first two are decoding together, then send the third.
  wait_for_steps(t, decode, 5);
  handles.push_back(send(2));
  auto done = collect_all(t, handles);

  // The step log: some step ran all three with three different context lengths, and the third
  // request first appears after steps that ran without it.
  const auto log = t.events(decode);
  bool three_together = false;
  size_t first_step_of_third = SIZE_MAX, steps_before = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    const auto& e = log[i];
    if (e.kind != "step") continue;
    std::set<uint64_t> ids(e.batch_requests.begin(), e.batch_requests.end());
    std::set<uint32_t> ctx(e.batch_contexts.begin(), e.batch_contexts.end());
    const bool has_third = ids.count(done[2].request_id) > 0;
    if (has_third && first_step_of_third == SIZE_MAX) first_step_of_third = i;
    if (!has_third && first_step_of_third == SIZE_MAX) ++steps_before;
    if (ids.size() >= 3 && ctx.size() >= 3) three_together = true;
  }
  CHECK_MESSAGE(three_together, "tokens " << done[0].tokens.size() << "/" << done[1].tokens.size() << "/"
                                         << done[2].tokens.size() << ", steps before the third joined " << steps_before);
  CHECK(steps_before >= 5);
  CHECK(first_step_of_third != SIZE_MAX);

  // Batched, every request got exactly what it gets alone on one executor.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (size_t i = 0; i < 3; ++i) {
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), max_tokens[i], cfg.prefill.chunk_tokens, {},
                                       /*ignore_eos*/ true);
    CHECK(done[i].tokens == ref.tokens);
    CHECK(test::same_bits(done[i].step_logits, ref.step_logits));
  }
}

TEST_CASE("load spreads over 2 prefill and 2 decode ranks, and placement follows the reported loads") {
  test::cluster_system t;
  local_cluster_config cfg;  // defaults: 2 + 2 ranks
  cfg.executor.num_kv_pages = 128;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  REQUIRE(t.wait_registered(cluster));
  // Placement alone, without reports in between: the balancer counts its own placements, so
  // consecutive prompts alternate between the two idle ranks.
  const auto placed = four_placements(t, self, cluster, 256);
  // Ranks register in whichever order they start; the placements alternate between the two.
  REQUIRE(placed.size() == 4);
  CHECK(placed[0] != placed[1]);
  CHECK(placed[2] == placed[0]);
  CHECK(placed[3] == placed[1]);
  // Reports bring the balancer's view back to the ranks' real (idle) state.
  self->send(cluster.prefill_balancer, load_atom::value, rank_load{"prefill-0", 0, 0, 128, 128}, cluster.prefill[0].handle);
  self->send(cluster.prefill_balancer, load_atom::value, rank_load{"prefill-1", 0, 0, 128, 128}, cluster.prefill[1].handle);

  // A burst through the whole cluster: prompts long enough (~300 tokens) that each takes far
  // longer to prefill than to place, so both ranks of each kind get work.
  std::vector<decltype(self->request(cluster.router, caf::infinite, generate_atom::value, generate_request{}))> burst;
  for (int i = 0; i < 8; ++i) {
    generate_request req;
    req.prompt = std::string(300, 'a' + i);
    req.max_tokens = 6;
    burst.push_back(self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req));
  }
  std::map<std::string, int> per_rank;
  for (auto& h : burst)
    h.receive([&](completion& c) { ++per_rank[c.prefill_rank], ++per_rank[c.decode_rank]; },
              [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(per_rank["prefill-0"] >= 1);
  CHECK(per_rank["prefill-1"] >= 1);
  CHECK(per_rank["decode-0"] >= 1);
  CHECK(per_rank["decode-1"] >= 1);

  // A rank that reports itself busy gets no new work until it reports otherwise.
  auto busy = rank_load{"prefill-0", 1000000, 50, 128, 128};
  busy.predicted_us = 1e9;
  self->send(cluster.prefill_balancer, load_atom::value, busy, cluster.prefill[0].handle);
  auto full = rank_load{"decode-1", 0, 0, 0, 64};  // no free pages
  self->send(cluster.decode_balancer, load_atom::value, full, cluster.decode[1].handle);
  for (int i = 0; i < 3; ++i) {
    generate_request req;
    req.prompt = "after the reports";
    req.max_tokens = 2;
    auto got = t.generate(cluster.router, req);
    REQUIRE(got);
    CHECK(got->prefill_rank == "prefill-1");
    CHECK(got->decode_rank == "decode-0");
  }
}

TEST_CASE("placement policies are chosen by name, and every decision is explained in the completion and the balancer's log") {
  {
    local_cluster_config bad;
    bad.prefill_balancer.policy = "fastest";
    CHECK(bad.validate().find("prefill balancer policy must be seed, least_loaded, round_robin, cache_affinity or split, got 'fastest'") !=
          std::string::npos);
    bad = {};
    bad.decode_balancer.policy = "random";
    CHECK(bad.validate().find("got 'random'") != std::string::npos);
  }
  for (const std::string policy : {"seed", "round_robin", "least_loaded"}) {
    CAPTURE(policy);
    test::cluster_system t;
    local_cluster_config cfg;
    cfg.executor.num_kv_pages = 128;
    cfg.prefill_balancer.policy = policy;
    cfg.decode_balancer.policy = policy;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    caf::scoped_actor self{t.sys};
    REQUIRE(t.wait_registered(cluster));
    // Four placements without reports in between: each policy spreads them over both ranks.
    const auto placed = four_placements(t, self, cluster, 64);
    // Ranks register in whichever order they start; the placements alternate between the two.
    REQUIRE(placed.size() == 4);
    CHECK(placed[0] != placed[1]);
    CHECK(placed[2] == placed[0]);
    CHECK(placed[3] == placed[1]);
    generate_request req;
    req.prompt = "explain yourself";
    req.max_tokens = 3;
    auto got = t.generate(cluster.router, req);
    REQUIRE(got);
    CHECK_MESSAGE(got->prefill_placement_why.rfind(policy, 0) == 0, got->prefill_placement_why);
    CHECK_MESSAGE(got->decode_placement_why.rfind(policy == "seed" ? "seed 2D: short context" : policy, 0) == 0,
                  got->decode_placement_why);
    std::vector<placement_record> log;
    self->request(cluster.prefill_balancer, std::chrono::seconds{10}, events_atom::value)
        .receive([&](std::vector<placement_record>& l) { log = std::move(l); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    REQUIRE(log.size() == 5);
    CHECK(log[0].request_id == 100);
    CHECK(log.back().request_id == got->request_id);
    CHECK(log.back().rank == got->prefill_rank);
    CHECK(log.back().why == got->prefill_placement_why);
  }
}

TEST_CASE("prefill balancer: a draining rank takes no new prompt, a rank that went down is forgotten at once, and "
          "a rank whose report names a standing failure takes nothing until a report clears it, under every policy") {
  for (const std::string policy : {"seed", "round_robin", "least_loaded", "cache_affinity", "split"}) {
    CAPTURE(policy);
    test::cluster_system t;
    local_cluster_config cfg;
    cfg.num_prefill_ranks = 4;
    cfg.num_decode_ranks = 1;
    cfg.executor.num_kv_pages = 128;
    cfg.prefill_balancer.policy = policy;
    cfg.prefill_balancer.split_min_tokens = 32;  // split: the 64-token prompts would be split
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    caf::scoped_actor self{t.sys};
    REQUIRE(t.wait_registered(cluster));
    self->send(cluster.prefill_balancer, drain_atom::value, cluster.prefill[0].handle);  // its node drains
    self->send_exit(cluster.prefill[1].handle, caf::exit_reason::kill);                  // its process died
    // prefill-3 reports what a rank whose executor can run nothing reports (its real report
    // would come from its executor's standing failure, tests/actors/disaggregation.test.cpp).
    auto report_of_3 = [&](const std::string& unavailable) {
      std::vector<rank_load> loads;
      self->request(cluster.prefill_balancer, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](std::vector<rank_load>& l) { loads = std::move(l); }, [](caf::error&) {});
      for (auto& l : loads)
        if (l.name == "prefill-3") {
          l.unavailable = unavailable;
          l.bucket = 0;
          self->send(cluster.prefill_balancer, load_atom::value, l, cluster.prefill[3].handle);
        }
    };
    report_of_3("expert parallelism: expert shard 1 of 2: its process ended");
    size_t ranks = 4;
    for (int i = 0; i < 1000 && ranks != 3; ++i) {
      self->request(cluster.prefill_balancer, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](std::vector<rank_load>& l) { ranks = l.size(); }, [](caf::error&) {});
      if (ranks != 3) std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    REQUIRE(ranks == 3);  // the dead one is gone from the balancer's view, the others stay
    const auto placed = four_placements(t, self, cluster, 64);
    CHECK(placed == std::vector<std::string>(4, "prefill-2"));
    generate_request req;  // and through the whole cluster: no attempt lost on the dead rank
    req.prompt = "after the fault";
    req.max_tokens = 3;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    CHECK(got->prefill_rank == "prefill-2");
    CHECK(got->failovers == 0);
    // Once its report clears, prefill-3 takes prompts again (under split, as one of the parts).
    report_of_3("");
    std::set<std::string> took;
    for (uint64_t i = 0; i < 4; ++i)
      self->request(cluster.prefill_balancer, std::chrono::seconds{10}, place_atom::value, place_query{200 + i, 64, 0, 70})
          .receive(
              [&](prefill_placement& p) {
                took.insert(p.name);
                took.insert(p.part_names.begin(), p.part_names.end());
              },
              [&](caf::error& e) { FAIL(t.sys.render(e)); });
    CHECK(took.count("prefill-3") == 1);
    CHECK(took.count("prefill-0") == 0);
  }
}

TEST_CASE("hybrid PD: short prompts are prefilled on the decode rank in chunks riding with decode steps, long ones "
          "on the prefill pool, and every request's tokens and logits equal its colocated run") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.hybrid_prefill_below_tokens = 40;
  cfg.decode.local_prefill_chunk_tokens = 16;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  auto send = [&](const std::string& prompt, int32_t max_tokens) {
    return send_request(self, cluster.router, prompt, max_tokens);
  };
  const std::vector<std::string> prompts = {
      "a short one",                                                     // 12 tokens: hybrid
      "thirty-odd tokens, prefilled locally",                            // 37 tokens: hybrid, 3 chunks
      "a prompt long enough to go to the prefill pool instead, surely",  // 63 tokens: disaggregated
  };
  std::vector<decltype(send(prompts[0], 1))> handles;
  handles.push_back(send(prompts[0], 200));
  wait_for_steps(t, decode, 5);  // the first request is decoding: the next chunks ride with it
  handles.push_back(send(prompts[1], 10));
  handles.push_back(send(prompts[2], 10));
  auto done = collect_all(t, handles);
  CHECK(done[0].prefill_rank == "decode-0");
  CHECK(done[1].prefill_rank == "decode-0");
  CHECK(done[2].prefill_rank == "prefill-0");
  CHECK(done[1].prefill_placement_why.rfind("hybrid PD: 37 < 40", 0) == 0);
  CHECK(done[2].prefill_placement_why.rfind("seed", 0) == 0);
  // The second prompt's three chunks each rode in a step that also advanced the first request.
  const auto events = t.events(decode);
  std::vector<uint32_t> chunks;
  for (size_t i = 0; i < events.size(); ++i)
    if (events[i].kind == "local_chunk" && events[i].request_id == done[1].request_id) {
      chunks.push_back(events[i].chunk);
      REQUIRE(i > 0);
      CHECK(events[i - 1].kind == "step");
      CHECK(std::count(events[i - 1].batch_requests.begin(), events[i - 1].batch_requests.end(), done[0].request_id) == 1);
    }
  CHECK(chunks == std::vector<uint32_t>{0, 1, 2});
  check_colocated(cfg, prompts, done);
  // Every lease was released: the decode rank's pages are all free again.
  CHECK(t.stats(decode).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("hybrid PD packs several local prompts into one step's token budget, decode rows included, and starts "
          "none beyond max_batch_size running sequences") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.hybrid_prefill_below_tokens = 64;
  cfg.decode.local_prefill_chunk_tokens = 48;
  cfg.decode.max_batch_size = 2;
  // Deterministic arrival: the decode rank's jobs start 400 ms late (a fault executor), and a
  // blocker prompt that wants one token (its prefill ends it) occupies the first step while the
  // three prompts queue behind it; the next step then finds the rank idle with all of them queued.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto make_exec = [&cfg, weights](const std::string&) -> std::shared_ptr<gpu::executor> {
    return gpu::make_fault_slow_executor(gpu::make_cpu_executor(cfg.model, weights, cfg.executor), 400);
  };
  auto cluster = start_local_cluster(t.sys, cfg, make_exec);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  const std::vector<std::string> prompts = {"twenty tokens, give or take", "another prompt, similar",
                                            "the third waits its turn"};
  auto blocker = send_request(self, cluster.router, "a blocker, one token", 1);
  // The others go once the blocker's chunk is on the (slow) executor: they arrive during its step.
  auto blocker_running = [&] {
    for (const auto& e : t.events(decode))
      if (e.kind == "local_chunk") return true;
    return false;
  };
  for (int i = 0; i < 2000 && !blocker_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(blocker_running());
  std::vector<decltype(send_request(self, cluster.router, prompts[0], 1))> handles;
  for (const auto& p : prompts) handles.push_back(send_request(self, cluster.router, p, 6));
  std::vector<decltype(blocker)> first{blocker};
  REQUIRE(collect_all(t, first).size() == 1);
  auto done = collect_all(t, handles);
  // Some step carried chunks of two prompts; no step carried three (max_batch_size 2 running).
  const auto events = t.events(decode);
  size_t most = 0;
  for (size_t i = 0; i < events.size();) {
    size_t j = i;
    if (events[i].kind == "step") ++j;  // a step's decode rows come first, then its chunks
    size_t chunks = 0;
    while (j < events.size() && events[j].kind == "local_chunk") ++chunks, ++j;
    most = std::max(most, chunks);
    i = std::max(j, i + 1);
  }
  CHECK(most == 2);
  for (const auto& d : done) CHECK(d.prefill_rank == "decode-0");
  check_colocated(cfg, prompts, done);
}

TEST_CASE("dynamic prefill split: a long prompt computed in parts on three prefill ranks, each part's KV "
          "streamed to the later parts layer by layer, gives the colocated tokens and logits") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  std::string text;
  for (int i = 0; i < 399; ++i) text.push_back(static_cast<char>('a' + (i * 11) % 26));  // 400 tokens
  generate_request req;
  req.prompt = text;
  req.max_tokens = 8;
  req.return_logits = true;
  req.ignore_eos = true;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK_MESSAGE(got->prefill_placement_why.rfind("split: 400 tokens into [0, ", 0) == 0, got->prefill_placement_why);
  int ranks_with_part = 0;
  for (const auto& r : cluster.prefill) {
    const auto ev = t.events(r.handle);
    ranks_with_part += std::any_of(ev.begin(), ev.end(), [](auto& e) { return e.kind == "split_part"; });
  }
  CHECK(ranks_with_part == 3);
  check_colocated(cfg, {text}, {*got}, 64);
  // A short prompt is not split.
  req.prompt = "short";
  auto small = t.generate(cluster.router, req);
  REQUIRE(small);
  CHECK(small->prefill_placement_why.rfind("split: not split", 0) == 0);
  for (const auto& r : cluster.prefill) CHECK(t.stats(r.handle).num_running == 0);
}

TEST_CASE("dynamic prefill split: when the rank of an earlier part goes down mid-prefill, the request is re-placed "
          "at once (it watches every part's rank, not only the last one's) and still gives the colocated tokens") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  cfg.router.request.prefill_timeout_ms = 120000;  // past the client's 60 s: only the watch can move it
  cfg.decode.kv_quarantine_ms = 2000;  // the dead part never says it is done: its lease's pages wait this long
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto make_exec = [&cfg, weights](const std::string& name) -> std::shared_ptr<gpu::executor> {
    std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    // Prefill jobs start 150 ms late, so the parts are still computing when one's rank goes.
    return name.rfind("prefill", 0) == 0 ? gpu::make_fault_slow_executor(exec, 150) : exec;
  };
  auto cluster = start_local_cluster(t.sys, cfg, make_exec);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  std::string text;
  for (int i = 0; i < 399; ++i) text.push_back(static_cast<char>('a' + (i * 7) % 26));  // 400 tokens
  std::vector<decltype(send_request(self, cluster.router, text, 6))> handles;
  handles.push_back(send_request(self, cluster.router, text, 6));
  // The rank that computes the first part (not the last part's, which the request watched before).
  std::optional<size_t> first_part;
  for (int i = 0; i < 2000 && !first_part; ++i) {
    for (size_t r = 0; r < cluster.prefill.size() && !first_part; ++r)
      for (const auto& e : t.events(cluster.prefill[r].handle))
        if (e.kind == "split_part" && e.chunk == 0) first_part = r;
    if (!first_part) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  REQUIRE(first_part);
  const auto gone = cluster.prefill[*first_part].name;
  caf::anon_send_exit(cluster.prefill[*first_part].handle, caf::exit_reason::kill);
  auto done = collect_all(t, handles);
  REQUIRE(done.size() == 1);
  CHECK(done[0].failovers == 1);
  CHECK_MESSAGE(done[0].failover_why.find("rank " + gone + ", stage prefill: the rank went down") != std::string::npos,
                done[0].failover_why);
  check_colocated(cfg, {text}, done, 64);
  // The first attempt's lease is not lost: its pages come back (once its living parts said they
  // were done, and the dead one's time ran out).
  bool back = false;
  for (int i = 0; i < 1000 && !back; ++i) {
    back = t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(back);
  // The first attempt's living parts were stopped when the request let go (a later part waited
  // for the dead part's KV, which never comes): each rank ends with no prompt and every page
  // back, its held pages released once the dead part's puts could no longer land.
  for (size_t r = 0; r < cluster.prefill.size(); ++r) {
    if (r == *first_part) continue;
    CAPTURE(cluster.prefill[r].name);
    bool idle = false;
    for (int i = 0; i < 1000 && !idle; ++i) {
      const auto s = t.stats(cluster.prefill[r].handle);
      idle = s.num_running == 0 && s.num_free_pages == cfg.executor.num_kv_pages;
      if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    CHECK(idle);
  }
}

namespace {

/// Stands in for a part's prefill rank that never computes: records what the real parts tell it.
struct silent_part_log {
  std::mutex m;
  std::vector<split_peer> peers;
  std::vector<split_abort> aborts;
  /// Waits (bounded) until the part under test has told this stand-in where its pages are: it runs.
  bool told_once() {
    for (int i = 0; i < 5000; ++i) {
      {
        std::lock_guard<std::mutex> lock{m};
        if (peers.size() == 1) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    return false;
  }
};

caf::actor spawn_silent_part(caf::actor_system& sys, std::shared_ptr<silent_part_log> log) {
  return sys.spawn([log](caf::event_based_actor*) -> caf::behavior {
    return {
        [log](split_peer& p) {
          std::lock_guard<std::mutex> lock{log->m};
          log->peers.push_back(std::move(p));
        },
        [log](split_abort& a) {
          std::lock_guard<std::mutex> lock{log->m};
          log->aborts.push_back(std::move(a));
        },
        [](split_layer&) {},
    };
  });
}

/// A split order for request `rid` of `tokens` tokens in two halves, over a fresh lease of
/// `decode`; part `index` is `rank`'s, the other `ghost`'s.
prefill_order half_split_order(caf::scoped_actor& self, test::cluster_system& t, const decode_rank_actor& decode,
                               uint64_t rid, uint32_t tokens, uint32_t index, const caf::actor& rank,
                               const caf::actor& ghost) {
  prefill_order o;
  o.request_id = rid;
  for (uint32_t i = 0; i < tokens; ++i) o.tokens.push_back(static_cast<int32_t>(1 + i % 200));
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{rid, tokens + 8, 60000, tokens})
      .receive([&](kv_lease_grant& g) { o.grant = std::move(g); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  o.decode = decode;
  o.part_index = index;
  o.part_bounds = {0, tokens / 2, tokens};
  o.part_ranks = index == 0 ? std::vector<caf::actor>{rank, ghost} : std::vector<caf::actor>{ghost, rank};
  o.part_names = index == 0 ? std::vector<std::string>{"prefill-1", "prefill-ghost"}
                            : std::vector<std::string>{"prefill-ghost", "prefill-1"};
  return o;
}

}  // namespace

TEST_CASE("dynamic prefill split: a part whose peer never shows up fails after split_wait_ms, naming the peer and "
          "what it never did, tells the peer to stop, and gives its pages back") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  cfg.prefill.split_wait_ms = 300;
  cfg.prefill.kv_send_timeout_ms = 50;  // a failed later part holds its pages 2x this
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  auto log = std::make_shared<silent_part_log>();
  auto ghost = spawn_silent_part(t.sys, log);
  const auto rank = caf::actor_cast<caf::actor>(cluster.prefill[1].handle);
  const auto& decode = cluster.decode[0].handle;
  const std::string expected[] = {
      // Part 1: the earlier part never sends its KV (our computation never starts).
      "request 71, rank prefill-1, stage split: part 1 of 2: part 0 (rank prefill-ghost) sent no KV within 300 ms",
      // Part 0: computed, but the later part never said where its pages are.
      "request 72, rank prefill-1, stage split: part 0 of 2: part 1 (rank prefill-ghost) never said where its "
      "pages are within 300 ms",
  };
  for (uint32_t index : {1u, 0u}) {
    CAPTURE(index);
    const uint64_t rid = 71 + (1 - index);
    auto order = half_split_order(self, t, decode, rid, 128, index, rank, ghost);
    const uint64_t lease = order.grant.lease_id;
    const auto aborts_before = [&] {
      std::lock_guard<std::mutex> lock{log->m};
      return log->aborts.size();
    }();
    std::string err;
    self->request(cluster.prefill[1].handle, std::chrono::seconds{30}, std::move(order))
        .receive([&](prefill_result&) { FAIL("a part with a silent peer succeeded"); },
                 [&](caf::error& e) { err = t.sys.render(e); });
    CHECK_MESSAGE(err.find("deadline_exceeded") != std::string::npos, err);
    CHECK_MESSAGE(err.find(expected[1 - index]) != std::string::npos, err);
    // The abort to the other part travels on its own: it may reach the stand-in after the answer.
    for (int i = 0; i < 500; ++i) {
      {
        std::lock_guard<std::mutex> lock{log->m};
        if (log->aborts.size() > aborts_before) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    {
      std::lock_guard<std::mutex> lock{log->m};
      // A later part told the earlier one where its pages are, under this attempt's lease.
      if (index == 1) {
        REQUIRE(log->peers.size() == 1);
        CHECK(log->peers[0].lease_id == lease);
        CHECK(log->peers[0].part_index == 1);
      }
      // The failure went to the other part, with its code and words.
      REQUIRE(log->aborts.size() > aborts_before);
      CHECK(log->aborts.back().request_id == rid);
      CHECK(log->aborts.back().lease_id == lease);
      CHECK(log->aborts.back().code == static_cast<uint8_t>(errc::deadline_exceeded));
      CHECK(log->aborts.back().why == expected[1 - index]);
    }
    bool idle = false;
    for (int i = 0; i < 500 && !idle; ++i) {
      const auto s = t.stats(cluster.prefill[1].handle);
      idle = s.num_running == 0 && s.num_free_pages == cfg.executor.num_kv_pages;
      if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    CHECK(idle);
  }
  caf::anon_send_exit(ghost, caf::exit_reason::user_shutdown);
}

TEST_CASE("dynamic prefill split: a part told that another failed stops with that failure's code, naming the part; "
          "an abort under another lease is not its own") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  cfg.prefill.split_wait_ms = 60000;  // the backstop stays out of it, however slow the machine
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  auto log = std::make_shared<silent_part_log>();
  auto ghost = spawn_silent_part(t.sys, log);
  const auto rank = caf::actor_cast<caf::actor>(cluster.prefill[1].handle);
  const auto& decode = cluster.decode[0].handle;
  auto order = half_split_order(self, t, decode, 73, 128, 1, rank, ghost);
  const uint64_t lease = order.grant.lease_id;
  auto pending = self->request(cluster.prefill[1].handle, std::chrono::seconds{30}, std::move(order));
  REQUIRE(log->told_once());
  // An abort of another attempt (another lease) is not ours.
  caf::anon_send(rank, split_abort{73, lease + 1000, 0, static_cast<uint8_t>(errc::transfer_failed), "not ours"});
  caf::anon_send(rank, split_abort{73, lease, 0, static_cast<uint8_t>(errc::transfer_failed), "the put went nowhere"});
  std::string err;
  pending.receive([&](prefill_result&) { FAIL("a part whose peer failed succeeded"); },
                  [&](caf::error& e) { err = t.sys.render(e); });
  CHECK_MESSAGE(err.find("transfer_failed") != std::string::npos, err);
  CHECK_MESSAGE(err.find("request 73, rank prefill-1, stage split: part 0 failed: the put went nowhere") != std::string::npos, err);
  caf::anon_send_exit(ghost, caf::exit_reason::user_shutdown);
}

TEST_CASE("dynamic prefill split: a later part told that an earlier part gave a put into its pages up unsettled holds "
          "them for late_put_quarantine_ms, not twice the send timeout (the put may still land), also when told after it "
          "answered") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  cfg.prefill.split_wait_ms = 60000;
  cfg.prefill.kv_send_timeout_ms = 200;        // the usual hold: 0.4 s
  cfg.prefill.late_put_quarantine_ms = 60000;     // the quarantine: past this test's end
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  const auto rank = caf::actor_cast<caf::actor>(cluster.prefill[1].handle);
  const auto count = [&](const char* kind, uint64_t rid) {
    const auto ev = t.events(cluster.prefill[1].handle);
    return std::count_if(ev.begin(), ev.end(), [&](const rank_event& e) { return e.kind == kind && e.request_id == rid; });
  };
  enum class told { no, with_the_abort, after_the_answer };
  for (const auto how : {told::no, told::with_the_abort, told::after_the_answer}) {
    CAPTURE(static_cast<int>(how));
    const uint64_t rid = 74 + static_cast<uint64_t>(how);
    auto log = std::make_shared<silent_part_log>();
    auto ghost = spawn_silent_part(t.sys, log);
    auto order = half_split_order(self, t, cluster.decode[0].handle, rid, 128, 1, rank, ghost);
    const uint64_t lease = order.grant.lease_id;
    auto pending = self->request(cluster.prefill[1].handle, std::chrono::seconds{30}, std::move(order));
    REQUIRE(log->told_once());
    split_abort abort{rid, lease, 0, static_cast<uint8_t>(errc::transfer_failed), "a put given up"};
    abort.abandoned = how == told::with_the_abort;
    caf::anon_send(rank, abort);
    pending.receive([&](prefill_result&) { FAIL("a part whose peer failed succeeded"); }, [](caf::error&) {});
    for (int i = 0; i < 500 && count("pages_held", rid) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    CHECK(count("pages_held", rid) == 1);
    if (how == told::after_the_answer) {  // the earlier part gave its put up after this part had answered
      abort.abandoned = true;
      caf::anon_send(rank, abort);
    }
    // Waited well past the usual hold (0.4 s): back without the word, still held with it.
    for (int i = 0; i < 150 && count("pages_unheld", rid) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    CHECK(count("pages_unheld", rid) == (how == told::no ? 1 : 0));
    caf::anon_send_exit(ghost, caf::exit_reason::user_shutdown);
  }
}

TEST_CASE("dynamic prefill split: an order whose parts do not add up is refused, naming what is wrong") {
  test::cluster_system t;
  auto cfg = split_cluster_config();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  auto ghost = spawn_silent_part(t.sys, std::make_shared<silent_part_log>());
  const auto rank = caf::actor_cast<caf::actor>(cluster.prefill[1].handle);
  const auto refusal = [&](prefill_order o) {
    std::string err;
    self->request(cluster.prefill[1].handle, std::chrono::seconds{10}, std::move(o))
        .receive([&](prefill_result&) { FAIL("a broken split order ran"); }, [&](caf::error& e) { err = t.sys.render(e); });
    CHECK_MESSAGE(err.find("bad_request") != std::string::npos, err);
    return err;
  };
  const auto base = half_split_order(self, t, cluster.decode[0].handle, 81, 128, 1, rank, ghost);
  auto o = base;
  o.part_index = 2;
  CHECK(refusal(o).find("part_index 2 is past the 2 parts") != std::string::npos);
  o = base;
  o.part_bounds = {0, 64};
  CHECK(refusal(o).find("part_bounds has 2 entries, 2 parts need 3") != std::string::npos);
  o = base;
  o.part_bounds = {0, 64, 100};
  CHECK(refusal(o).find("part_bounds run from 0 to 100, not from 0 to the prompt's 128 tokens") != std::string::npos);
  o = base;
  o.part_bounds = {0, 0, 128};
  CHECK(refusal(o).find("part_bounds do not increase: entry 0 is 0, the next 0") != std::string::npos);
  o = base;
  o.part_names.pop_back();
  CHECK(refusal(o).find("part_names has 1 names for 2 parts") != std::string::npos);
  o = base;
  o.part_ranks[0] = caf::actor{};
  CHECK(refusal(o).find("part_ranks[0] (prefill-ghost) is no actor") != std::string::npos);
  // Nothing of them stayed: the rank holds no prompt and has every page.
  const auto s = t.stats(cluster.prefill[1].handle);
  CHECK(s.num_running == 0);
  CHECK(s.num_free_pages == cfg.executor.num_kv_pages);
  caf::anon_send_exit(ghost, caf::exit_reason::user_shutdown);
}
