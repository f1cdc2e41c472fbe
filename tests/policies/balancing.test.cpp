// Issue 5: the seed's balancing policies and their alternatives, on the seed's worked examples.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "policies/cost_fit.hpp"
#include "policies/decode_placement.hpp"
#include "policies/placement.hpp"
#include "policies/prefill_placement.hpp"

using namespace baton::policies;

namespace {

/// A GPU-like model where attention dominates long prompts (causal: alpha = beta / 2).
const cost_model gpu_like{0.5e-4, 1.0e-4, 20.0};

/// Engines of one rank each, all moved into `bucket` by demand there.
bucket_allocator all_in_bucket(uint32_t engines, uint32_t bucket) {
  bucket_config cfg;
  cfg.min_move_interval_s = 0;
  cfg.hysteresis_fraction = 0;
  bucket_allocator b{cfg, engines};
  b.record_demand(bucket, 1e9, 0.0);
  while (b.rebalance(0.0)) {
  }
  return b;
}

/// Two buckets (prompts < 100 tokens, and longer) over `engines` one-rank engines, moved by demand
/// until they hold `counts` engines.
bucket_allocator two_buckets(uint32_t engines, const std::vector<uint32_t>& counts, double short_demand,
                             double long_demand) {
  bucket_config cfg;
  cfg.upper_bounds_tokens = {100};
  cfg.min_move_interval_s = 0;
  cfg.hysteresis_fraction = 0;
  bucket_allocator b{cfg, engines};
  b.record_demand(1, long_demand, 0.0);
  b.record_demand(0, short_demand, 0.0);
  for (int i = 0; i < 10 && b.engine_counts() != counts; ++i) b.rebalance(0.0);
  return b;
}

}  // namespace

TEST_CASE("seed 000 example: prefill A (32K, 30K cached) goes to an idle machine, cache affinity keeps it on busy machine 1") {
  auto buckets = all_in_bucket(3, 1);
  REQUIRE(buckets.engine_counts() == std::vector<uint32_t>{0, 3, 0, 0});
  // Machine 1 (index 0) is busy and holds A's 30K prefix; machines 2 and 3 are idle.
  const std::vector<prefill_engine_view> engines = {{1e7, {{4e6}}}, {1e7, {{0}}}, {1e7, {{0}}}};
  auto seed = place_prefill(buckets, engines, gpu_like, 2048, 30720);
  REQUIRE(seed);
  CHECK(seed->bucket == 1);
  CHECK_FALSE(seed->borrowed);
  CHECK(seed->engine == 1);  // an idle machine: the prefix lives in the shared store anyway

  const std::vector<prefill_rank_load> loads = {{12000, 1}, {0, 0}, {0, 0}};
  auto affinity = cache_affinity_prefill(loads, {30720, 0, 0}, /*max_queued_tokens*/ 16384);
  REQUIRE(affinity);
  CHECK(affinity->rank == 0);
  CHECK(affinity->by_affinity);
  CHECK(least_loaded_prefill(loads) == 1u);  // the alternative differs from least-loaded
  // Over the load threshold, affinity gives way to least-loaded.
  auto overloaded = cache_affinity_prefill({{40000, 3}, {0, 0}, {0, 0}}, {30720, 0, 0}, 16384);
  CHECK(overloaded->rank == 1);
  CHECK_FALSE(overloaded->by_affinity);
}

TEST_CASE("seed prefill: a bucket whose own engines are all unavailable lends its prompts to the nearest bucket "
          "that can take them, instead of parking them until they time out") {
  auto buckets = all_in_bucket(3, 1);  // 3 engines, all in bucket 1 (16K-64K)
  REQUIRE(buckets.engine_counts() == std::vector<uint32_t>{0, 3, 0, 0});
  std::vector<prefill_engine_view> engines = {{1e7, {{0, false}}}, {1e7, {{0, false}}}, {1e7, {{0, false}}}};
  // No engine anywhere is available: nothing to place.
  CHECK_FALSE(place_prefill(buckets, engines, gpu_like, 2048, 30720));
  // One of bucket 1's engines comes back: a prompt of bucket 1 uses it, unborrowed.
  engines[2].ranks[0].available = true;
  auto d = place_prefill(buckets, engines, gpu_like, 2048, 30720);
  REQUIRE(d);
  CHECK(d->engine == 2);
  CHECK_FALSE(d->borrowed);
  // A short prompt (bucket 0 has no engines) borrows bucket 1's available one, not an unavailable one.
  d = place_prefill(buckets, engines, gpu_like, 100, 0);
  REQUIRE(d);
  CHECK(d->engine == 2);
  CHECK(d->borrowed);

  // Two buckets with engines: bucket 0 owns one, bucket 1 owns one. Bucket 1's engine is
  // unavailable: a long prompt borrows bucket 0's (before: it found bucket 1's list and stopped).
  auto two = two_buckets(2, {1, 1}, 1e9, 1e9);
  REQUIRE(two.engine_counts() == std::vector<uint32_t>{1, 1});
  const auto long_engine = two.engines_for(1)[0];
  std::vector<prefill_engine_view> views = {{1e7, {{0, true}}}, {1e7, {{0, true}}}};
  views[long_engine].ranks[0].available = false;
  d = place_prefill(two, views, gpu_like, 200, 0);
  REQUIRE(d);
  CHECK(d->engine == 1 - long_engine);
  CHECK(d->borrowed);
}

TEST_CASE("seed prefill: a short prompt that would queue on its bucket's engines takes an idle engine of a "
          "longer-prompt bucket; a long prompt takes a short bucket's idle engine only while that bucket keeps another "
          "idle and it would wait longer than it computes; nothing moves while its own engine is idle") {
  auto two = two_buckets(3, {2, 1}, 2e9, 1e9);
  REQUIRE(two.engine_counts() == std::vector<uint32_t>{2, 1});
  const auto long_engine = two.engines_for(1)[0];
  const auto short_a = two.engines_for(0)[0], short_b = two.engines_for(0)[1];
  std::vector<prefill_engine_view> views(3, prefill_engine_view{1e7, {{0, true}}});
  // Its own bucket has an idle engine: it stays there.
  auto d = place_prefill(two, views, gpu_like, 50, 0);
  REQUIRE(d);
  CHECK(two.engine_buckets()[d->engine] == 0);
  CHECK_FALSE(d->idle_lent);
  // Both short engines are busy, the long one idle: the short prompt goes there, said so.
  views[short_a].ranks[0].predicted_us = 3e5;
  views[short_b].ranks[0].predicted_us = 1e5;
  d = place_prefill(two, views, gpu_like, 50, 0);
  REQUIRE(d);
  CHECK(d->engine == long_engine);
  CHECK(d->idle_lent);
  CHECK_FALSE(d->borrowed);
  CHECK(d->explain("prefill-3").find("an idle engine of a longer bucket) -> engine ") != std::string::npos);
  CHECK(d->explain("prefill-3").find("-> prefill-3 (predicted load") != std::string::npos);
  // The long engine has work too: back to the least-loaded short engine (level 2-3 as before).
  views[long_engine].ranks[0].predicted_us = 1.0;
  d = place_prefill(two, views, gpu_like, 50, 0);
  REQUIRE(d);
  CHECK(d->engine == short_b);
  CHECK_FALSE(d->idle_lent);
  // A long prompt queued on its engine never takes an idle short engine: long prompts stay off
  // the engines that keep short prompts' TTFT low.
  views[short_a].ranks[0].predicted_us = 0;
  views[long_engine].ranks[0].predicted_us = 5e5;
  d = place_prefill(two, views, gpu_like, 500, 0);
  REQUIRE(d);
  CHECK(d->engine == long_engine);
  CHECK_FALSE(d->idle_lent);
  // Both short engines idle: the short bucket can lend one, but only to a long prompt that would
  // wait longer than it computes.
  views[short_b].ranks[0].predicted_us = 0;
  const double own = gpu_like.prefill_us(500, 0);
  views[long_engine].ranks[0].predicted_us = own / 2;
  d = place_prefill(two, views, gpu_like, 500, 0);
  REQUIRE(d);
  CHECK(d->engine == long_engine);
  CHECK_FALSE(d->idle_lent);
  views[long_engine].ranks[0].predicted_us = 2 * own;
  d = place_prefill(two, views, gpu_like, 500, 0);
  REQUIRE(d);
  CHECK(two.engine_buckets()[d->engine] == 0);
  CHECK(d->idle_lent);
  CHECK(d->lent_by_shorter);
  CHECK(d->explain("prefill-0").find("an idle engine of a shorter bucket, which keeps another idle") != std::string::npos);
  views[short_b].ranks[0].predicted_us = 1e5;  // one idle short engine left: kept for short prompts
  views[short_a].ranks[0].predicted_us = 0;
  d = place_prefill(two, views, gpu_like, 500, 0);
  REQUIRE(d);
  CHECK(d->engine == long_engine);
  CHECK_FALSE(d->idle_lent);
  views[short_b].ranks[0].predicted_us = 0;
  // An unavailable idle engine lends nothing.
  views[long_engine].ranks[0] = {0, false};
  views[short_a].ranks[0].predicted_us = 3e5;
  d = place_prefill(two, views, gpu_like, 50, 0);
  REQUIRE(d);
  CHECK(d->engine == short_b);
  CHECK_FALSE(d->idle_lent);
}

TEST_CASE("seed 000 example: cost of 2K new tokens on a 30K prefix is below an eighth of 32K uncached") {
  // Causal attention makes alpha = beta / 2 in any executor; with a GPU-like gamma:
  CHECK(gpu_like.prefill_us(2048, 30720) < gpu_like.prefill_us(32768, 0) / 8);
  // With gamma alone (no attention cost) the ratio would be 2K/32K = 1/16; with attention alone
  // (1 + 2·15)/256 ≈ 1/8.3: any mix of the two satisfies the seed's claim.
  const cost_model attention_only{0.5, 1.0, 0.0};
  CHECK(attention_only.prefill_us(2048, 30720) < attention_only.prefill_us(32768, 0) / 8);
}

TEST_CASE("seed 000 example: decode 2D sends a short request to GPU B and a long one to GPU A") {
  const uint64_t cap = 512 * 1024;
  // GPU A: 20 requests, 40K KV in all. GPU B: 5 requests, 200K KV.
  const std::vector<decode_rank_view> ranks = {{20, 40960, cap - 40960, cap}, {5, 204800, cap - 204800, cap}};
  decode_2d_config cfg;
  auto shrt = place_decode_2d(ranks, 1024, cfg);
  REQUIRE(shrt);
  CHECK(shrt->rank == 1);
  CHECK_FALSE(shrt->long_context);
  auto lng = place_decode_2d(ranks, 40960, cfg);
  REQUIRE(lng);
  CHECK(lng->rank == 0);
  CHECK(lng->long_context);
  CHECK(lng->explain("decode-7").find("long context -> decode-7 (") != std::string::npos);
}

TEST_CASE("decode 2D never exceeds KV capacity and keeps short requests off nearly full ranks") {
  decode_2d_config cfg;
  // Rank 0 has fewest running but would be over the 90% watermark; rank 1 takes the request.
  std::vector<decode_rank_view> ranks = {{1, 950, 50 + 64, 1064}, {9, 100, 900, 1000}};
  CHECK(place_decode_2d(ranks, 64, cfg)->rank == 1);
  // If only the full rank fits, it is still used (under capacity).
  ranks[1].available = false;
  CHECK(place_decode_2d(ranks, 64, cfg)->rank == 0);
  // No rank has room: no placement.
  CHECK_FALSE(place_decode_2d(ranks, 200, cfg));
  CHECK_FALSE(place_decode_2d({}, 1, cfg));
  CHECK(decode_2d_config{0, 0.9}.validate().find("long_context_tokens") != std::string::npos);
  // Ranks that allocate differently need different room for one request: rank 0 on demand (the
  // prompt + headroom, 128 tokens), rank 1 the whole sequence (4096) with 128 free. Rank 1 runs
  // fewer but cannot hold it: rank 0 (sizing both by rank 0's need sent it to rank 1, whose
  // reservation then failed).
  std::vector<decode_rank_view> mixed = {{5, 1000, 4000, 8192, true, 128}, {0, 0, 128, 8192, true, 4096}};
  auto d = place_decode_2d(mixed, 4096, cfg);
  REQUIRE(d);
  CHECK(d->rank == 0);
  CHECK_FALSE(d->long_context);  // 4096 < 8192: by the whole sequence, not by the room asked
}

TEST_CASE("time-budget chunking: chunks shrink as the context grows and every step fits the budget") {
  const double budget = 50'000;  // 50 ms steps
  const auto chunks = plan_chunks(gpu_like, 0, 128 * 1024, budget);
  uint64_t done = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    CHECK(gpu_like.prefill_us(chunks[i], done) <= budget);
    if (i + 1 < chunks.size()) {  // full chunks: the largest that fits, so the next token would not
      CHECK(gpu_like.prefill_us(chunks[i] + 1, done) > budget);
      if (i > 0) CHECK(chunks[i] <= chunks[i - 1]);
    }
    done += chunks[i];
  }
  CHECK(done == 128 * 1024);
  INFO("chunks: " << chunks.front() << " ... " << chunks[chunks.size() - 2] << ", " << chunks.size());
  CHECK(chunks.front() > 1.5 * chunks[chunks.size() - 2]);  // visibly shrinking along the prompt
  // The cap applies, and a budget too small for one token still makes progress.
  CHECK(plan_chunks(gpu_like, 0, 100, budget, 16) == std::vector<uint32_t>{16, 16, 16, 16, 16, 16, 4});
  CHECK(largest_chunk(gpu_like, 0, 5, 1e-6) == 1);
  CHECK(largest_chunk(gpu_like, 0, 0, budget) == 0);
  // A budget without end, or one whose root lies beyond 2^64 tokens: all that remains.
  CHECK(largest_chunk(gpu_like, 0, 100, std::numeric_limits<double>::infinity()) == 100);
  CHECK(largest_chunk(cost_model{0, 0, 1e-12, 0}, 0, 100, 1e12) == 100);
}

TEST_CASE("time-budget chunking: the ranks of one engine get chunks of equal predicted time") {
  const double budget = 40'000;
  // Four ranks at very different points of their prompts.
  const std::vector<rank_head> heads = {{100000, 0}, {100000, 8000}, {100000, 40000}, {100000, 120000}};
  const auto chunks = engine_step_chunks(gpu_like, heads, budget);
  double lo = 1e300, hi = 0;
  for (size_t i = 0; i < heads.size(); ++i) {
    const double t = gpu_like.prefill_us(chunks[i], heads[i].context);
    CHECK(t <= budget);
    // One more token would overrun: each rank is within one token's cost of the budget.
    CHECK(gpu_like.prefill_us(chunks[i] + 1, heads[i].context) > budget);
    lo = std::min(lo, t);
    hi = std::max(hi, t);
  }
  CHECK(chunks[0] > chunks[3]);
  CHECK(hi - lo < 0.01 * budget);
}

TEST_CASE("dynamic prefill split: one long prompt over three idle ranks in parts of equal predicted time") {
  const auto parts = split_prefill(gpu_like, 0, 32768, 3);
  REQUIRE(parts.size() == 3);
  CHECK(parts[0] + parts[1] + parts[2] == 32768);
  CHECK(parts[0] > parts[1]);
  CHECK(parts[1] > parts[2]);  // later parts attend to a longer context
  const double t0 = gpu_like.prefill_us(parts[0], 0), t1 = gpu_like.prefill_us(parts[1], parts[0]),
               t2 = gpu_like.prefill_us(parts[2], parts[0] + parts[1]);
  const double whole = gpu_like.prefill_us(32768, 0);
  for (double t : {t0, t1, t2}) CHECK(std::abs(t - whole / 3) < 0.01 * whole);
  // Least-loaded would give the whole prompt to one idle rank: the slowest part is ~1/3 of that.
  CHECK(std::max({t0, t1, t2}) < 0.35 * whole);
  CHECK(split_prefill(gpu_like, 0, 2, 5).size() == 2);
}

TEST_CASE("round robin differs from least-loaded and skips unavailable ranks") {
  uint64_t cursor = 1;
  const std::vector<prefill_rank_load> loads = {{0, 0}, {900, 3}, {50, 1}};
  CHECK(least_loaded_prefill(loads) == 0u);
  CHECK(round_robin({true, true, true}, cursor) == 1u);
  CHECK(round_robin({true, false, true}, cursor) == 2u);
  CHECK(round_robin({true, false, true}, cursor) == 0u);
  CHECK_FALSE(round_robin({false, false}, cursor));
}

TEST_CASE("hybrid PD prefills short prompts on the decode rank") {
  // Three prefill ranks idle; least-loaded would pick one, hybrid keeps a 300-token prompt local.
  CHECK(least_loaded_prefill({{0, 0}, {0, 0}, {0, 0}}) == 0u);
  CHECK(prefill_on_decode_rank(300, 1024));
  CHECK_FALSE(prefill_on_decode_rank(4096, 1024));
  CHECK_FALSE(prefill_on_decode_rank(1, 0));
}

TEST_CASE("priority classes: a batch request waits behind at most N interactive arrivals") {
  for (uint32_t n : {0u, 1u, 3u, 8u}) {
    priority_classes<int> q{n};
    q.push(-1, /*batch*/ true);
    for (int i = 0; i < 20; ++i) q.push(i, false);
    int served_before = 0;
    while (auto x = q.pop()) {
      if (*x == -1) break;
      ++served_before;
    }
    CHECK(served_before == static_cast<int>(n));
  }
  // Interactive first when the batch head has not waited its turn.
  priority_classes<int> q{2};
  q.push(1, true);
  q.push(2, false);
  CHECK(q.pop() == 2);
  CHECK(q.pop() == 1);
  CHECK_FALSE(q.pop());
}

TEST_CASE("policy names parse, and unknown names are refused") {
  CHECK(parse_prefill_policy("seed") == prefill_policy::seed);
  CHECK(parse_prefill_policy("cache_affinity") == prefill_policy::cache_affinity);
  CHECK_FALSE(parse_prefill_policy("fastest"));
  CHECK(parse_decode_policy("round_robin") == decode_policy::round_robin);
  CHECK(to_string(decode_policy::seed) == "seed");
}

TEST_CASE("least-squares fit recovers known alpha, beta, gamma from noisy samples, judged on held-out points") {
  const cost_model truth{3e-5, 7e-5, 45.0, 800.0};
  std::mt19937_64 rng{42};
  std::normal_distribution<double> noise{0.0, 0.03};  // 3% timing noise
  std::vector<prefill_sample> fit_set, held_out;
  for (uint64_t q : {16, 64, 256, 1024, 4096})
    for (uint64_t c : {0, 512, 4096, 16384, 65536}) {
      const double t = truth.prefill_us(q, c) * (1.0 + noise(rng));
      ((fit_set.size() + held_out.size()) % 4 == 3 ? held_out : fit_set).push_back({q, c, t});
    }
  REQUIRE(held_out.size() >= 3);
  std::string why;
  auto fit = fit_cost_model(fit_set, &why);
  REQUIRE_MESSAGE(fit, why);
  CHECK(fit->alpha_us == doctest::Approx(truth.alpha_us).epsilon(0.10));
  CHECK(fit->beta_us == doctest::Approx(truth.beta_us).epsilon(0.10));
  CHECK(fit->gamma_us == doctest::Approx(truth.gamma_us).epsilon(0.05));
  CHECK(fit->delta_us == doctest::Approx(truth.delta_us).epsilon(0.25));
  const auto err = evaluate(*fit, held_out);
  CHECK(err.count == held_out.size());
  CHECK(err.mean_rel < 0.06);
  // A grid without cached tokens cannot tell beta apart: a clear refusal, not garbage.
  std::vector<prefill_sample> no_c;
  for (uint64_t q : {16, 64, 256, 1024}) no_c.push_back({q, 0, truth.prefill_us(q, 0)});
  CHECK_FALSE(fit_cost_model(no_c, &why));
  CHECK(why.find("do not determine") != std::string::npos);
  // Without a fixed cost in the data, delta comes out near zero (or is pinned there).
  std::vector<prefill_sample> seed_form;
  for (uint64_t q : {16, 64, 256, 1024})
    for (uint64_t c : {0, 1024, 8192}) seed_form.push_back({q, c, cost_model{3e-5, 7e-5, 45.0}.prefill_us(q, c)});
  auto f0 = fit_cost_model(seed_form);
  REQUIRE(f0);
  CHECK(std::abs(f0->delta_us) < 1.0);
  CHECK(f0->alpha_us == doctest::Approx(3e-5).epsilon(0.01));
  CHECK_FALSE(fit_cost_model({{1, 1, -5.0}, {2, 2, 1.0}, {3, 3, 1.0}}, &why));
  CHECK(why.find("non-positive") != std::string::npos);
}

TEST_CASE("decode step model fit recovers a known base, per-sequence and per-token cost") {
  const decode_cost_model truth{900.0, 35.0, 0.02};
  std::mt19937_64 rng{7};
  std::normal_distribution<double> noise{0.0, 0.02};
  std::vector<decode_sample> s;
  for (uint64_t n : {1, 4, 16, 64})
    for (uint64_t ctx : {256, 4096, 65536}) s.push_back({n, n * ctx, truth.step_us(n, n * ctx) * (1 + noise(rng))});
  auto fit = fit_decode_cost_model(s);
  REQUIRE(fit);
  CHECK(fit->step_base_us == doctest::Approx(truth.step_base_us).epsilon(0.10));
  CHECK(fit->per_seq_us == doctest::Approx(truth.per_seq_us).epsilon(0.15));
  CHECK(fit->per_context_token_us == doctest::Approx(truth.per_context_token_us).epsilon(0.10));
  CHECK(fit->usable());
  // Steps that shrink as the batch grows (noise over a narrow range) would fit a negative
  // per-sequence cost, and large batches would cost nothing: that term is held at 0 instead.
  std::vector<decode_sample> shrinking;
  for (uint64_t n : {1, 2, 4, 8, 16})
    for (uint64_t ctx : {256, 4096}) shrinking.push_back({n, n * ctx, 1000.0 - 5.0 * n + 0.01 * n * ctx});
  auto bounded = fit_decode_cost_model(shrinking);
  REQUIRE(bounded);
  CHECK(bounded->usable());
  CHECK(bounded->per_seq_us == 0);
  CHECK(bounded->step_us(1024, 0) > 0);
  CHECK_FALSE(decode_cost_model{500, -20, 0.05}.usable());
}

TEST_CASE("bucket engine counts follow a shift in demand and come back") {
  bucket_config cfg;  // defaults: 120 s between moves, 300 s half-life
  bucket_allocator b{cfg, 8};
  CHECK(b.engine_counts() == std::vector<uint32_t>{8, 0, 0, 0});
  CHECK(b.bucket_of(16383) == 0);
  CHECK(b.bucket_of(16384) == 1);
  CHECK(b.bucket_of(300000) == 3);
  // Phase 1 (1 h): only short prompts.
  double t = 0;
  for (; t < 3600; t += 1) {
    b.record_demand(0, 2e5, t);
    b.rebalance(t);
  }
  const auto short_phase = b.engine_counts();
  CHECK(short_phase[0] >= 7);
  // Phase 2 (1 h): long prompts (64K-256K) dominate, short ones continue at a tenth.
  for (; t < 7200; t += 1) {
    b.record_demand(2, 2e6, t);
    b.record_demand(0, 2e5, t);
    b.rebalance(t);
  }
  const auto long_phase = b.engine_counts();
  CHECK(long_phase[2] >= 6);
  CHECK(long_phase[0] >= 1);  // the short bucket keeps an engine: never starved
  // Phase 3: back to short prompts only.
  for (; t < 12600; t += 1) {
    b.record_demand(0, 2e5, t);
    b.rebalance(t);
  }
  CHECK(b.engine_counts()[0] >= 7);
  // A bucket without engines borrows its nearest neighbour's.
  bool borrowed = false;
  auto e = b.engines_for(3, &borrowed);
  CHECK(borrowed);
  CHECK_FALSE(e.empty());
  CHECK(bucket_config{{100, 50}}.validate().find("increasing") != std::string::npos);
}

TEST_CASE("under steady Poisson load, at most one engine move per bucket per virtual hour after warm-up") {
  bucket_allocator b{bucket_config{}, 16};
  std::mt19937_64 rng{2026};
  std::exponential_distribution<double> gap{4.0};  // 4 requests per second
  std::discrete_distribution<int> which{70, 20, 8, 2};
  const uint64_t lengths[] = {4000, 30000, 120000, 400000};
  std::map<std::pair<int, uint32_t>, int> moves_per_hour_bucket;
  double t = 0;
  while (t < 6 * 3600) {
    t += gap(rng);
    const int k = which(rng);
    b.record_demand(b.bucket_of(lengths[k]), gpu_like.prefill_us(lengths[k], 0), t);
    if (auto m = b.rebalance(t); m && t >= 3600) {  // the first hour is warm-up
      ++moves_per_hour_bucket[{static_cast<int>(t / 3600), m->from_bucket}];
      ++moves_per_hour_bucket[{static_cast<int>(t / 3600), m->to_bucket}];
    }
  }
  for (const auto& [key, n] : moves_per_hour_bucket) CHECK_MESSAGE(n <= 1, "hour " << key.first << " bucket " << key.second);
  // The counts did move from the initial 16/0/0/0 toward the demand shares (about 1.2, 2.7,
  // 5.2, 6.7 engines), and every bucket with demand owns an engine.
  const auto counts = b.engine_counts();
  INFO(counts[0] << " " << counts[1] << " " << counts[2] << " " << counts[3]);
  CHECK(counts[0] <= 2);
  CHECK(counts[3] >= 5);
  for (auto n : counts) CHECK(n >= 1);
}

TEST_CASE("elastic P/D: a rank joining or leaving the prefill pool keeps the buckets' engines and demand; the new "
          "engine joins the bucket most short of its share") {
  bucket_config cfg;
  bucket_allocator b{cfg, 4};
  double t = 0;
  for (; t < 3600; t += 1) {  // long prompts (16K-64K) carry three quarters of the demand
    b.record_demand(1, 3e5, t);
    b.record_demand(0, 1e5, t);
    b.rebalance(t);
  }
  const auto before = b.engine_counts();
  REQUIRE(before[0] + before[1] == 4);
  const double d0 = b.demand(0, t), d1 = b.demand(1, t);
  // Shares: 1 and 3 engines of 4; with a 5th engine 1.25 and 3.75: bucket 1 is the shorter.
  b.resize(5, t);
  auto grown = b.engine_counts();
  CHECK(grown[0] == before[0]);
  CHECK(grown[1] == before[1] + 1);
  CHECK(b.engine_buckets().back() == 1);
  CHECK(b.engines_for(1).back() == 4);
  CHECK(b.demand(0, t) == d0);
  CHECK(b.demand(1, t) == d1);
  // Shrinking: the highest-numbered engine leaves; the others keep their buckets.
  const auto kept = std::vector<uint32_t>(b.engine_buckets().begin(), b.engine_buckets().begin() + 3);
  b.resize(3, t);
  CHECK(b.engine_buckets() == kept);
  uint32_t total = 0;
  for (auto n : b.engine_counts()) total += n;
  CHECK(total == 3);
  // An engine leaving from the middle: the ones after it keep their buckets, one number lower
  // (here 0 0 1 -> 0 1, where dropping the last engine would give 0 0).
  const auto three = b.engine_buckets();
  REQUIRE(three[1] != three[2]);
  b.remove_engine(1);
  CHECK(b.engine_buckets() == std::vector<uint32_t>{three[0], three[2]});
  for (uint32_t k = 0; k < b.num_buckets(); ++k) {
    bool borrowed = false;
    const auto& engines = b.engines_for(k, &borrowed);
    for (auto e : engines) CHECK((borrowed || b.engine_buckets()[e] == k));
  }
  // No demand yet: newcomers go to bucket 0.
  bucket_allocator fresh{cfg, 1};
  fresh.resize(3, 0);
  CHECK(fresh.engine_counts() == std::vector<uint32_t>{3, 0, 0, 0});
}
