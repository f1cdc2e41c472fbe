// Issue 15: the elastic P/D planner -- when a rank changes role, and that it cannot oscillate.

#include <doctest/doctest.h>

#include <set>
#include <vector>

#include "policies/restart_backoff.hpp"
#include "policies/role_planner.hpp"

using namespace baton::policies;

namespace {

/// Two prefill and two decode ranks; prefill queues of `queue_ms`, decode steps of `step_ms`.
std::vector<rank_signal> cluster(double queue_ms, double step_ms, double kv = 0.2) {
  return {{"prefill-0", rank_role::prefill, queue_ms, 0, 0, 3},
          {"prefill-1", rank_role::prefill, queue_ms, 0, 0, 2},
          {"decode-0", rank_role::decode, 0, step_ms, kv, 9},
          {"decode-1", rank_role::decode, 0, step_ms, kv, 4}};
}

role_planner_config config() {
  role_planner_config c;  // TTFT 2 s, TBT 100 ms, hot 0.8, cold 0.4, hold 10 s, cooldown 30 s, dwell 120 s
  REQUIRE(c.validate().empty());
  return c;
}

}  // namespace

TEST_CASE("role planner: a hot prefill pool beside a cold decode pool takes the least busy decode rank, after the "
          "condition held for hold_s, and says why with the numbers") {
  role_planner planner{config()};
  const auto hot_prefill = cluster(3000, 20);  // prefill pressure 1.5, decode max(0.2, 0.22) = 0.22
  CHECK(planner.pressure(rank_role::prefill, hot_prefill) == doctest::Approx(1.5));
  CHECK(planner.pressure(rank_role::decode, hot_prefill) == doctest::Approx(0.2 / 0.9));
  CHECK_FALSE(planner.plan(0, hot_prefill));
  CHECK_FALSE(planner.plan(9.9, hot_prefill));  // not held long enough yet
  auto m = planner.plan(10, hot_prefill);
  REQUIRE(m);
  CHECK(m->rank == "decode-1");  // 4 running against decode-0's 9
  CHECK(m->from == rank_role::decode);
  CHECK(m->to == rank_role::prefill);
  CHECK_MESSAGE(m->why.find("prefill pool hot, decode pool cold for 10.0 s: prefill pressure 1.50") == 0, m->why);
  CHECK_MESSAGE(m->why.find("decode-1 has the least work of its pool (4 running)") != std::string::npos, m->why);
}

TEST_CASE("role planner: the condition must hold without a break; both hot, or both cold, move nothing") {
  role_planner planner{config()};
  CHECK_FALSE(planner.plan(0, cluster(3000, 20)));
  CHECK_FALSE(planner.plan(5, cluster(3000, 20)));
  CHECK_FALSE(planner.plan(60, cluster(500, 20)));  // prefill cooled for a minute: the clock stops
  CHECK(planner.smoothed(rank_role::prefill) < 0.8);
  double t = 60;
  while (planner.smoothed(rank_role::prefill) < 0.8) CHECK_FALSE(planner.plan(t += 1, cluster(3000, 20)));
  const double hot_again = t;  // ... and starts again once the average is hot again
  while (!planner.plan(t += 1, cluster(3000, 20))) REQUIRE(t < hot_again + 11);
  CHECK(t == hot_again + 10);
  role_planner other{config()};
  for (double t = 0; t < 300; t += 5) {
    CHECK_FALSE(other.plan(t, cluster(3000, 95)));  // both hot: moving a rank only moves the pain
    CHECK_FALSE(other.plan(t, cluster(100, 10)));   // both cold: nothing to gain
  }
}

TEST_CASE("role planner: KV occupancy alone makes the decode pool hot") {
  role_planner planner{config()};
  const auto full_kv = cluster(200, 30, 0.88);  // steps fast, but KV 88% of 90%
  CHECK(planner.pressure(rank_role::decode, full_kv) == doctest::Approx(0.88 / 0.9));
  CHECK_FALSE(planner.plan(0, full_kv));
  auto m = planner.plan(10, full_kv);
  REQUIRE(m);
  CHECK(m->to == rank_role::decode);
  CHECK(m->rank == "prefill-1");  // 2 running against prefill-0's 3
}

/// Drives a planner second by second for `seconds`, the load prefill-heavy while
/// `prefill_heavy(t)`; each move is applied to the cluster the planner sees next.
template <class Heavy>
std::vector<std::pair<double, role_move>> drive(std::vector<rank_signal>& ranks, double seconds, Heavy prefill_heavy) {
  role_planner planner{config()};
  std::vector<std::pair<double, role_move>> moves;
  for (double t = 0; t < seconds; t += 1) {
    for (auto& r : ranks) {
      r.predicted_queue_ms = prefill_heavy(t) ? 3000 : 100;
      r.step_ms = prefill_heavy(t) ? 20 : 95;
    }
    if (auto m = planner.plan(t, ranks)) {
      for (auto& r : ranks)
        if (r.name == m->rank) r.role = m->to;
      moves.push_back({t, *m});
    }
  }
  return moves;
}

TEST_CASE("role planner: a load that flips faster than the dwell time cannot make ranks oscillate") {
  // Every 15 s the load flips between prefill-heavy and decode-heavy, for an hour.
  auto ranks = cluster(3000, 20);
  auto moves = drive(ranks, 3600, [](double t) { return static_cast<int>(t / 15) % 2 == 0; });
  // Averaged over a minute, a load flipping every 15 s is neither hot nor cold: nothing moves,
  // but for the first phase, which is all the planner has seen when it holds for 10 s.
  REQUIRE(moves.size() <= 1);
  if (!moves.empty()) CHECK(moves[0].first == 10);
  // A lasting shift does move ranks, never faster than the cooldown nor a rank again within its
  // dwell time: 20 minutes prefill-heavy, then 20 decode-heavy.
  ranks = cluster(3000, 20);
  moves = drive(ranks, 2400, [](double t) { return t < 1200; });
  REQUIRE(moves.size() >= 2);
  CHECK(moves.front().second.to == rank_role::prefill);
  CHECK(moves.front().first == 10);
  CHECK(moves.back().second.to == rank_role::decode);
  CHECK(moves.back().first > 1200);
  for (size_t i = 1; i < moves.size(); ++i) CHECK(moves[i].first - moves[i - 1].first >= 30);  // cooldown
  for (size_t i = 0; i < moves.size(); ++i)
    for (size_t j = i + 1; j < moves.size(); ++j)
      if (moves[j].second.rank == moves[i].second.rank) {
        CHECK(moves[j].first - moves[i].first >= 120);  // dwell
        break;
      }
  // The pools never drop below their minimum of one.
  size_t prefill = 0;
  for (const auto& r : ranks) prefill += r.role == rank_role::prefill;
  CHECK(prefill >= 1);
  CHECK(prefill <= 3);
  CHECK(moves.size() <= 3600 / 30);
}

TEST_CASE("role planner: the last rank of a pool never moves, and a config that cannot work says why") {
  role_planner planner{config()};
  std::vector<rank_signal> one_decode = {{"prefill-0", rank_role::prefill, 5000, 0, 0, 1},
                                         {"decode-0", rank_role::decode, 0, 10, 0.1, 0}};
  for (double t = 0; t < 100; t += 5) CHECK_FALSE(planner.plan(t, one_decode));
  role_planner_config bad;
  bad.cold = 0.9;
  CHECK(bad.validate() == "role planner needs 0 <= cold < hot");
  bad = {};
  bad.min_decode = 0;
  CHECK(bad.validate() == "role planner pools need at least one rank each");
}

TEST_CASE("role planner: with the max signal one hot prefill rank makes the pool hot; the mean waits for the pool") {
  // prefill-0's queue is at 1.6 s (pressure 0.8 against the 2 s target), prefill-1 idle: the
  // mean (0.4) is not hot, the max (0.8) is, as a p90 TTFT would be.
  std::vector<rank_signal> ranks = cluster(0, 20);
  ranks[0].predicted_queue_ms = 1600;
  role_planner mean{config()};
  CHECK(mean.pressure(rank_role::prefill, ranks) == doctest::Approx(0.4));
  CHECK_FALSE(mean.plan(0, ranks));
  CHECK_FALSE(mean.plan(10, ranks));
  auto c = config();
  c.pool_signal = "max";
  REQUIRE(c.validate().empty());
  role_planner tail{c};
  CHECK(tail.pressure(rank_role::prefill, ranks) == doctest::Approx(0.8));
  CHECK_FALSE(tail.plan(0, ranks));
  auto m = tail.plan(10, ranks);
  REQUIRE(m);
  CHECK(m->to == rank_role::prefill);
  CHECK_MESSAGE(m->why.find("(max predicted queue / TTFT target 2000 ms") != std::string::npos, m->why);
  c.pool_signal = "p99";
  CHECK(c.validate() == "role planner pool_signal \"p99\" is unknown (mean or max)");
}

TEST_CASE("role planner: a starved length bucket asks for a rank while the prefill pool's mean is cold; the same "
          "load in one bucket does not") {
  // Three short-prompt ranks nearly idle and one long-prompt rank with a 4 s queue: the pool's mean
  // pressure is (3 x 0.05 + 2.0) / 4 = 0.54, below hot (0.8); the long bucket's is 2.0.
  auto ranks = [](uint32_t long_bucket) {
    std::vector<rank_signal> r{{"prefill-0", rank_role::prefill, 100, 0, 0, 1},
                               {"prefill-1", rank_role::prefill, 100, 0, 0, 1},
                               {"prefill-2", rank_role::prefill, 100, 0, 0, 1},
                               {"prefill-3", rank_role::prefill, 4000, 0, 0, 1},
                               {"decode-0", rank_role::decode, 0, 20, 0.2, 9},
                               {"decode-1", rank_role::decode, 0, 20, 0.2, 4}};
    r[3].bucket = long_bucket;
    return r;
  };
  role_planner bucketed{config()}, flat{config()};
  CHECK(bucketed.pressure(rank_role::prefill, ranks(2)) == doctest::Approx(2.0));
  CHECK(flat.pressure(rank_role::prefill, ranks(0)) == doctest::Approx(0.5375));
  std::optional<role_move> m;
  for (double t = 0; t <= 300 && !m; t += 5) {
    m = bucketed.plan(t, ranks(2));
    CHECK_FALSE(flat.plan(t, ranks(0)));
  }
  REQUIRE(m);
  CHECK(m->to == rank_role::prefill);
  CHECK(m->rank == "decode-1");
  CHECK_MESSAGE(m->why.find("the prefill pressure is length bucket 2's, the hottest of 2 (2.00 now over its 1 rank)") !=
                    std::string::npos,
                m->why);
  // The tail signal sees the same rank without buckets.
  auto tail_cfg = config();
  tail_cfg.pool_signal = "max";
  role_planner tail{tail_cfg};
  CHECK(tail.pressure(rank_role::prefill, ranks(0)) == doctest::Approx(2.0));
}

TEST_CASE("restart backoff: a node that fails at once, again and again, waits twice as long each time up to the "
          "cap; one that ran a while starts over at the base; 0 never waits") {
  baton::policies::restart_backoff b;  // 500 ms, at most 30 s, settled after 60 s
  uint32_t wait = 0;
  std::vector<uint32_t> waits;
  for (int i = 0; i < 9; ++i) waits.push_back(wait = b.next_delay_ms(wait, 100));
  CHECK(waits == std::vector<uint32_t>{500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000});
  CHECK(b.next_delay_ms(16000, 59999) == 30000);
  CHECK(b.next_delay_ms(16000, 60000) == 500);  // it had served a minute: not a crash loop
  b.base_ms = 0;
  CHECK(b.next_delay_ms(0, 0) == 0);
  CHECK(b.next_delay_ms(8000, 10) == 0);
  b.base_ms = 40000;  // a base above the cap: the cap wins
  CHECK(b.next_delay_ms(0, 0) == 30000);
  CHECK(b.next_delay_ms(30000, 0) == 30000);
}

TEST_CASE("restart backoff: a node that served ten minutes since its last restart has its restarts back; one that "
          "failed sooner keeps what it used; forgive 0 never gives them back") {
  baton::policies::restart_backoff b;
  CHECK(b.restarts_used(3, 599999) == 3);
  CHECK(b.restarts_used(3, 600000) == 0);
  CHECK(b.restarts_used(0, 10) == 0);
  b.forgive_ms = 0;
  CHECK(b.restarts_used(2, uint64_t{1} << 40) == 2);
}

TEST_CASE("retry backoff: each retry waits twice the last up to a cap, stretched by up to half by the request's hash "
          "(so requests that failed together spread out, at the cap too); 0 never waits") {
  baton::policies::retry_backoff b;  // 50 ms, at most 1 s
  for (uint64_t id : {1ull, 2ull, 77ull, 123456789ull}) {
    CAPTURE(id);
    for (uint32_t attempt = 1; attempt <= 4; ++attempt) {
      const uint32_t base = 50u << (attempt - 1);
      CHECK(b.delay_ms(attempt, id) >= base);
      CHECK(b.delay_ms(attempt, id) < base + base / 2);
      CHECK(b.delay_ms(attempt, id) == b.delay_ms(attempt, id));  // a pure function of its inputs
    }
    CHECK(b.delay_ms(10, id) >= 1000);  // capped, then stretched: still spread out
    CHECK(b.delay_ms(10, id) < 1500);
    CHECK(b.delay_ms(0, id) == 0);
  }
  std::set<uint32_t> spread;
  for (uint64_t id = 0; id < 100; ++id) spread.insert(b.delay_ms(1, id));
  CHECK(spread.size() > 10);  // not one wait for all
  std::set<uint32_t> spread_capped;
  for (uint64_t id = 0; id < 100; ++id) spread_capped.insert(b.delay_ms(8, id));
  CHECK(spread_capped.size() > 10);  // also once the doubling has reached the cap
  b.base_ms = 0;
  CHECK(b.delay_ms(3, 1) == 0);
}

TEST_CASE("role planner: a rank that stepped aside does not count toward its pool's minimum, so the last rank "
          "that serves a role is not moved away") {
  auto c = config();
  c.min_decode = 1;
  role_planner planner{c};
  auto ranks = cluster(3000, 20);  // hot prefill, cold decode: decode-1 would move
  ranks[3].open = false;           // decode-1 stepped aside (a broken expert group): decode-0 alone serves
  for (double t = 0; t <= 60; t += 5) CHECK_FALSE(planner.plan(t, ranks));
  role_planner both_open{c};
  bool moved = false;
  for (double t = 0; t <= 60 && !moved; t += 5) moved = both_open.plan(t, cluster(3000, 20)).has_value();
  CHECK(moved);  // the control: with both serving, one moves
}
