// Issue 8: the shared block store in the sim -- the real block index with modelled block
// servers (sims/modelled_block_server.hpp): write-back, loads by another prefill instance, the
// storage node's bandwidth as virtual time, and determinism.

#include <doctest/doctest.h>

#include "sims/roofline.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

using namespace baton::sims;

namespace {

/// Request "a" at 0 s, then "b" with the same three 512-token blocks at 30 s (a finished long
/// before): round robin sends b to the other prefill instance, whose local tier is empty.
trace same_prefix_twice() {
  trace t;
  t.requests.push_back({0, 1536, 4, {7, 8, 9}, "a"});
  t.requests.push_back({30'000'000, 1536, 4, {7, 8, 9}, "b"});
  return t;
}

sim_config two_prefill_instances(bool store) {
  sim_config c;
  c.model = "llama-3-70b";
  c.tp = 2;
  c.prefill_instances = 2;
  c.decode_instances = 1;
  c.prefill_policy = "round_robin";
  c.store = store;
  return c;
}

/// How much later the second request's first token comes with `slow` than with the default
/// store, and the load those bytes are at 0.5 GB/s (1,024 tokens of Llama-3-70B KV: 336 MB).
std::pair<double, double> load_delay_s(const sim_config& slow, sim_result* s) {
  std::string why;
  sim_result f;
  REQUIRE_MESSAGE(run_sim(two_prefill_instances(true), same_prefix_twice(), "t", &f, &why), why);
  REQUIRE_MESSAGE(run_sim(slow, same_prefix_twice(), "t", s, &why), why);
  REQUIRE(s->outcomes[1].cached_tokens == 1024);
  CHECK(s->outcomes[0].ttft_us == f.outcomes[0].ttft_us);  // the first request loads nothing
  return {static_cast<double>(s->outcomes[1].ttft_us - f.outcomes[1].ttft_us) / 1e6,
          1024.0 * named_model("llama-3-70b")->kv_bytes_per_token / 0.5e9};
}

}  // namespace

TEST_CASE("sim store: a prefix written back by one request is loaded by another prefill instance, and its TTFT drops") {
  std::string why;
  sim_result off, on;
  REQUIRE_MESSAGE(run_sim(two_prefill_instances(false), same_prefix_twice(), "t", &off, &why), why);
  REQUIRE_MESSAGE(run_sim(two_prefill_instances(true), same_prefix_twice(), "t", &on, &why), why);
  REQUIRE(on.summary.completed == 2);
  CHECK(off.outcomes[1].prefill_rank != off.outcomes[0].prefill_rank);
  CHECK(off.outcomes[1].cached_tokens == 0);  // the other instance's local tier is empty
  CHECK(on.outcomes[1].prefill_rank != on.outcomes[0].prefill_rank);
  // Blocks 0 and 1 are loaded; the last block holds the prompt's last token, which is computed.
  CHECK(on.outcomes[1].cached_tokens == 1024);
  CHECK(on.outcomes[1].ttft_us < off.outcomes[1].ttft_us);
  CHECK(on.json.find("\"store\": \"2 modelled servers") == std::string::npos);  // 4 by default
  CHECK(on.json.find("\"store\": \"4 modelled servers") != std::string::npos);
}

TEST_CASE("sim store: a slow storage node, or a slow PCIe link into the reader, delays the load by its bytes over "
          "the bandwidth") {
  auto slow_node = two_prefill_instances(true);
  slow_node.store_gbps = 0.5;
  auto slow_pcie = two_prefill_instances(true);
  slow_pcie.pcie_gbps = 0.25;  // per GPU; the TP2 instance loads at 0.5 GB/s
  for (const auto& slow : {slow_node, slow_pcie}) {
    sim_result s;
    // The prefill computes while the prefix streams in, so the delay is at most the load.
    const auto [extra_s, load_s] = load_delay_s(slow, &s);
    MESSAGE("load " << load_s << " s, TTFT grew by " << extra_s << " s");
    CHECK(extra_s > 0.5 * load_s);
    CHECK(extra_s <= load_s * 1.01);
    if (slow.pcie_gbps > 0) CHECK(s.json.find("PCIe 0.5") != std::string::npos);
  }
}

TEST_CASE("sim store: the Mooncake trace with the store hits more than the local tiers alone, deterministically") {
  trace t;
  std::string why;
  trace_options o;
  o.window_s = 300;
  const std::string path = BATON_SOURCE_DIR "/traces/mooncake_conversation_trace.jsonl";
  REQUIRE_MESSAGE(load_trace(path, o, &t, &why), why);
  sim_config c;
  c.model = "llama-3-70b";
  c.prefill_instances = 5;
  c.decode_instances = 3;
  sim_result local, store1, store2;
  REQUIRE_MESSAGE(run_sim(c, t, "mooncake", &local, &why), why);
  c.store = true;
  REQUIRE_MESSAGE(run_sim(c, t, "mooncake", &store1, &why), why);
  REQUIRE_MESSAGE(run_sim(c, t, "mooncake", &store2, &why), why);
  CHECK(store1.summary.completed == t.requests.size());
  MESSAGE("hit ratio: local tiers " << local.summary.cache_hit_ratio << ", with the store " << store1.summary.cache_hit_ratio);
  CHECK(store1.summary.cache_hit_ratio > local.summary.cache_hit_ratio + 0.05);
  CHECK(store1.json == store2.json);
  // A block server lost at 100 s: its blocks become misses (the index drops it), its keys are
  // written to the next live servers from then on, and nothing fails.
  c.faults.push_back({100, "store-1"});
  sim_result lost;
  REQUIRE_MESSAGE(run_sim(c, t, "mooncake", &lost, &why), why);
  CHECK(lost.summary.completed == t.requests.size());
  CHECK(lost.summary.failed == 0);
  MESSAGE("hit ratio with store-1 lost at 100 s: " << lost.summary.cache_hit_ratio);
  CHECK(lost.summary.cache_hit_ratio < store1.summary.cache_hit_ratio);
  CHECK(lost.summary.cache_hit_ratio > local.summary.cache_hit_ratio);
}
