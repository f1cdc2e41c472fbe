#include <doctest/doctest.h>

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
