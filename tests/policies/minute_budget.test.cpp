// An API key's per-minute budgets (policies/minute_budget.hpp): a burst of a minute's budget,
// then the refill rate; tokens charged after the fact may overspend, and calls wait it out.

#include <doctest/doctest.h>

#include "policies/minute_budget.hpp"

using baton::policies::minute_budget;

TEST_CASE("a requests-per-minute budget admits a minute's worth at once, then one per 60/N seconds, and says how "
          "long to wait") {
  auto b = minute_budget::full(6, 100.0);  // 6 a minute: one every 10 s
  double wait = -1;
  for (int i = 0; i < 6; ++i) CHECK(b.admit(100.0, 1, &wait));
  CHECK_FALSE(b.admit(100.0, 1, &wait));
  CHECK(wait == doctest::Approx(10.0));
  CHECK_FALSE(b.admit(105.0, 1, &wait));  // half refilled
  CHECK(wait == doctest::Approx(5.0));
  CHECK(b.admit(110.0, 1, &wait));
  CHECK_FALSE(b.admit(110.0, 1, &wait));
  // Idle for an hour: a minute's budget again, never more.
  for (int i = 0; i < 6; ++i) CHECK(b.admit(4000.0, 1, &wait));
  CHECK_FALSE(b.admit(4000.0, 1, &wait));
  // Time that runs backwards (another thread's earlier reading) refills nothing and breaks nothing.
  CHECK_FALSE(b.admit(3990.0, 1, &wait));
}

TEST_CASE("a tokens-per-minute budget is charged after the answer, may go below zero, and admits again once it "
          "has refilled above zero") {
  auto t = minute_budget::full(600, 0.0);  // 10 tokens a second
  double wait = -1;
  CHECK(t.admit(0.0, 0, &wait));  // a call asks only that the budget is not spent
  t.charge(1.0, 1800);           // its answer: three minutes' worth
  CHECK(t.level_at(1.0) == doctest::Approx(600 - 1800));  // (full: the second's refill went nowhere)
  CHECK_FALSE(t.admit(1.0, 0, &wait));
  CHECK(wait == doctest::Approx(120.0));  // 1200 tokens to refill at 10 a second
  CHECK_FALSE(t.admit(100.0, 0, &wait));
  CHECK(t.admit(122.0, 0, &wait));
}

TEST_CASE("a budget changed by a keys file read again keeps what was spent, capped at the new budget; one set "
          "anew starts full; none is no limit") {
  auto b = minute_budget::full(10, 0.0);
  double wait = -1;
  for (int i = 0; i < 8; ++i) CHECK(b.admit(0.0, 1, &wait));
  b.set_rate(100, 0.0);
  CHECK(b.level_at(0.0) == doctest::Approx(2));  // raised: what was left, refilling faster
  b.set_rate(1, 0.0);
  CHECK(b.level_at(0.0) == doctest::Approx(1));  // lowered: capped
  minute_budget none;
  CHECK(none.admit(0.0, 1e9, &wait));
  none.set_rate(5, 0.0);
  CHECK(none.level_at(0.0) == doctest::Approx(5));
  none.set_rate(0, 1.0);
  CHECK(none.admit(1.0, 1e9, &wait));
}
