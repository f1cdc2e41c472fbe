#include <doctest/doctest.h>

#include "actors/config.hpp"
#include "policies/placement.hpp"

using namespace baton::policies;

TEST_CASE("least-loaded prefill placement picks the fewest queued tokens and skips unavailable ranks") {
  CHECK_FALSE(least_loaded_prefill({}));
  CHECK(least_loaded_prefill({{500, 1}, {100, 3}, {100, 2}}) == 2u);
  CHECK(least_loaded_prefill({{0, 0}, {0, 0}}) == 0u);  // ties: lowest index
  CHECK(least_loaded_prefill({{0, 0, false}, {900, 9}}) == 1u);
  CHECK_FALSE(least_loaded_prefill({{0, 0, false}}));
}

TEST_CASE("least-loaded decode placement never exceeds KV capacity") {
  const std::vector<decode_rank_load> ranks = {{1, 10, 64}, {5, 60, 64}, {1, 30, 64}};
  CHECK(least_loaded_decode(ranks, 4) == 2u);   // fewest running, then most free pages
  CHECK(least_loaded_decode(ranks, 40) == 1u);  // only rank 1 can hold 40 pages
  CHECK_FALSE(least_loaded_decode(ranks, 61));
}

TEST_CASE("priority classes: a prefill rank refuses batch_max_bypass 0, which would serve batch prompts first") {
  // What 0 means to the queue: no interactive item may pass a waiting batch one.
  priority_classes<int> q{0};
  q.push(1, /*batch*/ true);
  q.push(2, false);
  CHECK(q.pop() == 1);
  baton::prefill_rank_config c;
  REQUIRE(c.validate().empty());
  c.batch_max_bypass = 0;
  CHECK(c.validate() == "prefill batch_max_bypass must be >= 1 (0 would put batch prompts before interactive ones)");
  c.batch_max_bypass = 1;
  CHECK(c.validate().empty());
}
