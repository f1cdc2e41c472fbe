// EPLB: redundant copies of hot experts under a slot budget, packed so the hottest EP rank's load
// approaches the mean, and dispatch kept inside a node where a copy is there.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "policies/eplb.hpp"

using namespace baton::policies;

namespace {

/// Zipf(s) tokens per expert, hot experts scattered (not in one static block) by a fixed permutation.
std::vector<double> skewed_load(uint32_t n, double s) {
  std::vector<double> load(n);
  for (uint32_t i = 0; i < n; ++i) load[(i * 37 + 11) % n] = 1e4 / std::pow(i + 1.0, s);
  return load;
}

void check_valid(const expert_placement& p, const eplb_config& cfg, uint32_t experts) {
  REQUIRE(p.rank_experts.size() == cfg.num_ranks);
  REQUIRE(p.replicas.size() == experts);
  for (uint32_t r = 0; r < cfg.num_ranks; ++r) {
    const auto& v = p.rank_experts[r];
    CHECK(v.size() <= cfg.slots_per_rank);
    CHECK(std::adjacent_find(v.begin(), v.end()) == v.end());  // sorted, so duplicates would be adjacent
  }
  for (uint32_t e = 0; e < experts; ++e) {
    CHECK_FALSE(p.replicas[e].empty());
    for (auto r : p.replicas[e]) CHECK(std::find(p.rank_experts[r].begin(), p.rank_experts[r].end(), e) != p.rank_experts[r].end());
  }
}

}  // namespace

TEST_CASE("EPLB: on a skewed routing load the hottest rank drops from 2.2x the mean to within 1%, inside the slot "
          "budget, every expert kept") {
  const uint32_t experts = 64;
  const eplb_config cfg{8, 4, 10};  // 8 ranks on 2 nodes, 80 slots: 16 redundant copies
  REQUIRE(cfg.validate(experts).empty());
  const auto load = skewed_load(experts, 1.0);
  const auto before = static_placement(experts, cfg);
  const auto after = plan_eplb(load, cfg);
  check_valid(before, cfg, experts);
  check_valid(after, cfg, experts);
  const double imb_before = imbalance(rank_loads(before, load)), imb_after = imbalance(rank_loads(after, load));
  MESSAGE("hottest rank / mean: static " << imb_before << ", EPLB " << imb_after);
  CHECK(imb_before > 2.0);
  CHECK(imb_after < 1.01);
  // The total load is conserved: copies split tokens, they do not add any.
  const auto rl = rank_loads(after, load);
  CHECK(std::accumulate(rl.begin(), rl.end(), 0.0) == doctest::Approx(std::accumulate(load.begin(), load.end(), 0.0)));
  // Every spare slot went to copies, and the hottest expert has the most.
  size_t copies = 0;
  for (const auto& v : after.replicas) copies += v.size();
  CHECK(copies == 80);
  const auto hottest = static_cast<uint32_t>(std::max_element(load.begin(), load.end()) - load.begin());
  for (const auto& v : after.replicas) CHECK(after.replicas[hottest].size() >= v.size());
  // Its copies are spread over both nodes: each node dispatches it locally.
  const auto& h = after.replicas[hottest];
  CHECK(std::any_of(h.begin(), h.end(), [](uint32_t r) { return r < 4; }));
  CHECK(std::any_of(h.begin(), h.end(), [](uint32_t r) { return r >= 4; }));
}

TEST_CASE("EPLB: without spare slots it still packs better than contiguous blocks; uniform load stays balanced") {
  const uint32_t experts = 64;
  const eplb_config tight{8, 8, 8};  // no room for copies
  const auto load = skewed_load(experts, 1.0);
  const auto p = plan_eplb(load, tight);
  check_valid(p, tight, experts);
  for (const auto& v : p.replicas) CHECK(v.size() == 1);
  CHECK(imbalance(rank_loads(p, load)) < imbalance(rank_loads(static_placement(experts, tight), load)));
  const std::vector<double> flat(experts, 100.0);
  CHECK(imbalance(rank_loads(plan_eplb(flat, tight), flat)) == doctest::Approx(1.0));
}

TEST_CASE("EPLB: a token goes to a copy on its own node when there is one, spread evenly over those; else to any") {
  expert_placement p;
  p.rank_experts = {{0}, {0}, {1}, {}, {0}, {}, {}, {}};
  p.replicas = {{0, 1, 4}, {2}};
  const eplb_config cfg{8, 4, 2};
  // Ranks 0-3 are node 0: expert 0 has copies on ranks 0 and 1 there.
  uint32_t on[8] = {};
  for (uint64_t h = 0; h < 1000; ++h) ++on[pick_replica(p, 0, 3, h, cfg)];
  CHECK(on[4] == 0);
  CHECK(on[0] == 500);
  CHECK(on[1] == 500);
  // Node 1 (ranks 4-7) has its own copy on rank 4.
  for (uint64_t h = 0; h < 10; ++h) CHECK(pick_replica(p, 0, 6, h, cfg) == 4);
  // Expert 1 lives only on node 0: a token from node 1 crosses.
  CHECK(pick_replica(p, 1, 7, 3, cfg) == 2);
}

TEST_CASE("EPLB: max_redundant caps the copies below the spare slots") {
  const auto load = skewed_load(64, 1.0);
  eplb_config cfg{8, 4, 10};
  cfg.max_redundant = 5;
  const auto p = plan_eplb(load, cfg);
  size_t copies = 0;
  for (const auto& v : p.replicas) copies += v.size();
  CHECK(copies == 69);
}

TEST_CASE("EPLB: a slot budget that cannot hold every expert is refused by name") {
  CHECK(eplb_config{8, 8, 7}.validate(64) == "EPLB: 8 ranks x 7 slots cannot hold 64 experts");
  CHECK(eplb_config{0, 8, 7}.validate(64).find("num_ranks") != std::string::npos);
}

TEST_CASE("EPLB: a config it cannot plan for falls back to one copy per expert, and no ranks means no placement "
          "(it wrote past an empty vector)") {
  eplb_config none;
  none.num_ranks = 0;
  const auto p = plan_eplb({1, 2, 3}, none);
  CHECK(p.rank_experts.empty());
  REQUIRE(p.replicas.size() == 3);
  for (const auto& r : p.replicas) CHECK(r.empty());
  eplb_config tight;
  tight.num_ranks = 2;
  tight.slots_per_rank = 1;  // 2 slots for 3 experts: invalid, static placement instead
  const auto q = plan_eplb({1, 2, 3}, tight);
  REQUIRE(q.rank_experts.size() == 2);
  CHECK(q.rank_experts[0].size() + q.rank_experts[1].size() == 3);
  for (const auto& r : q.replicas) CHECK(r.size() == 1);
}
