// One placement decision (CHECK excluded) for clusters of 16, 256 and 1,024 ranks: the seed's
// 4-level prefill placement (levels 1-3 plus the bucket bookkeeping every decision does), the
// seed's 2D decode placement and the least-loaded baselines, next to the ceiling any policy
// that reads every rank's load chases: a bare scan for the minimum of n doubles.
// Loads change randomly between decisions (seeded), as reports would change them.
// Usage: baton_bench_placement [--ranks-per-engine N] [--decisions N]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "policies/decode_placement.hpp"
#include "policies/placement.hpp"
#include "policies/prefill_placement.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::policies;
using clock_type = std::chrono::steady_clock;

namespace {

volatile size_t sink;  // keeps results alive

template <class F>
double median_ns(int decisions, F&& decide) {
  std::vector<double> ns(decisions);
  for (int i = 0; i < decisions; ++i) {
    const auto t0 = clock_type::now();
    sink = decide(i);
    ns[i] = std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
  }
  std::nth_element(ns.begin(), ns.begin() + decisions / 2, ns.end());
  return ns[decisions / 2];
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t rpe = 8;
  uint32_t decisions_flag = 20001;
  baton::deploy::flag_set flags;
  flags.add("--ranks-per-engine", &rpe, "prefill ranks per engine (seed's 2D placement)");
  flags.add("--decisions", &decisions_flag, "decisions timed per row (the median is printed)");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--ranks-per-engine N] [--decisions N]")) return *rc;
  if (rpe == 0 || decisions_flag == 0 || decisions_flag > 100000000)
    return std::fprintf(stderr, "baton_bench_placement: --ranks-per-engine must be >= 1, --decisions 1 to 1e8\n"), 2;
  const int decisions = static_cast<int>(decisions_flag);
  const cost_model cost{0.2205, 0.4303, 105.0, 1262.0};
  std::printf("one placement decision, median of %d (ns); prefill engines of %u ranks\n", decisions, rpe);
  std::printf("%7s %12s %12s %12s %12s %12s\n", "ranks", "scan-ceiling", "seed-prefill", "least-loaded", "seed-2D",
              "ll-decode");
  for (uint32_t n : {16u, 256u, 1024u}) {
    std::mt19937_64 rng{n};
    std::uniform_real_distribution<double> load_us{0.0, 5e5};
    std::uniform_int_distribution<uint32_t> running{0, 64};
    std::uniform_int_distribution<uint64_t> prompt{16, 300000};

    std::vector<double> flat(n);
    for (auto& x : flat) x = load_us(rng);
    const double scan = median_ns(decisions, [&](int i) {
      flat[i % n] = load_us(rng);
      return static_cast<size_t>(std::min_element(flat.begin(), flat.end()) - flat.begin());
    });

    const uint32_t engines_n = (n + rpe - 1) / rpe;
    std::vector<prefill_engine_view> engines(engines_n);
    for (uint32_t r = 0; r < n; ++r) {
      engines[r / rpe].quota_us = 1e6;
      engines[r / rpe].ranks.push_back({load_us(rng), true});
    }
    bucket_config bc;
    bucket_allocator buckets{bc, engines_n};
    double now_s = 0;
    const double seed = median_ns(decisions, [&](int i) {
      const uint32_t r = static_cast<uint32_t>(i) % n;
      engines[r / rpe].ranks[r % rpe].predicted_us = load_us(rng);
      const uint64_t len = prompt(rng);
      now_s += 0.01;
      buckets.rebalance(now_s);
      auto d = place_prefill(buckets, engines, cost, len, 0);
      if (d) buckets.record_demand(d->bucket, d->predicted_us, now_s);
      return d ? static_cast<size_t>(d->engine) * rpe + d->rank : 0;
    });

    std::vector<prefill_rank_load> pl(n);
    for (auto& x : pl) x = {static_cast<uint64_t>(load_us(rng)), running(rng), true};
    const double ll = median_ns(decisions, [&](int i) {
      pl[i % n].queued_tokens = static_cast<uint64_t>(load_us(rng));
      return least_loaded_prefill(pl).value_or(0);
    });

    const uint64_t cap = 1 << 20;
    std::vector<decode_rank_view> dv(n);
    for (auto& x : dv) {
      const uint64_t kv = rng() % cap;
      x = {running(rng), kv, cap - kv, cap, true};
    }
    decode_2d_config d2;
    const double two_d = median_ns(decisions, [&](int i) {
      auto& x = dv[i % n];
      x.kv_tokens = rng() % cap;
      x.kv_free_tokens = cap - x.kv_tokens;
      auto d = place_decode_2d(dv, prompt(rng) % 65536, d2);
      return d ? d->rank : 0;
    });

    std::vector<decode_rank_load> dl(n);
    for (auto& x : dl) x = {running(rng), static_cast<uint32_t>(rng() % 65536), 65536, true};
    const double lld = median_ns(decisions, [&](int i) {
      dl[i % n].num_free_pages = static_cast<uint32_t>(rng() % 65536);
      return least_loaded_decode(dl, 64).value_or(0);
    });
    std::printf("%7u %12.0f %12.0f %12.0f %12.0f %12.0f\n", n, scan, seed, ll, two_d, lld);
  }
  return 0;
}
