// Issue 8: the sim driver -- roofline step times, trace replay through the production actors
// under virtual time, deterministic reports, goodput, and faults in virtual time.

#include <unistd.h>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <regex>

#include "sims/roofline.hpp"
#include "sims/sim_plot.hpp"
#include "sims/sim_report.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

using namespace baton::sims;

namespace {

/// A small synthetic workload: Poisson arrivals, lognormal lengths.
trace small_trace(uint64_t seed, double rate = 4.0, double duration_s = 20.0) {
  synthetic_spec s;
  s.rate_per_s = rate;
  s.duration_s = duration_s;
  s.input = {length_dist::lognormal, 1500, 1.0, 16, 8192};
  s.output = {length_dist::lognormal, 120, 1.0, 2, 512};
  s.seed = seed;
  return synthetic_trace(s);
}

sim_config small_cluster() {
  sim_config c;
  c.model = "llama-3-8b";
  c.tp = 1;
  c.prefill_instances = 2;
  c.decode_instances = 2;
  return c;
}

trace one_request(uint32_t input, uint32_t output) {
  trace t;
  t.requests.push_back({0, input, output, {}, "only"});
  return t;
}

}  // namespace

TEST_CASE("roofline: decode steps are bandwidth-bound, long prefills compute-bound, with the expected magnitudes") {
  const roofline r{*named_gpu("H200"), *named_model("llama-3-8b"), 1, {}};
  std::string why;
  // One token on an empty context: 16.06 GB of weights plus one token's KV over 4,257 GB/s.
  const double decode = r.step_us({{1, 0}}, &why);
  CHECK(why == "memory");
  CHECK(decode == doctest::Approx(8.03e9 * 2 / 4257e3 + 131072.0 / 4257e3 + 40).epsilon(1e-9));
  // 4,096 new tokens: 2 x 8.03e9 x 4,096 FLOPs plus causal attention over 4,096 x 4,097 / 2 pairs.
  const double prefill = r.step_us({{4096, 0}}, &why);
  CHECK(why == "compute");
  const double pairs = 4096.0 * 4097 / 2;
  CHECK(prefill == doctest::Approx((2 * 8.03e9 * 4096 + 4.0 * 32 * 32 * 128 * pairs) / 790e6 + 40).epsilon(1e-9));
  // A batch of 64 decode steps costs far less than 64 single steps (weights are read once).
  std::vector<step_seq> batch(64, {1, 512});
  CHECK(r.step_us(batch) < 2 * decode);
  // Tensor parallelism: TP2 is faster than TP1 but not twice as fast (all-reduces, overhead).
  const roofline r2{*named_gpu("H200"), *named_model("llama-3-8b"), 2, {}};
  CHECK(r2.step_us({{4096, 0}}) < prefill);
  CHECK(r2.step_us({{4096, 0}}) > prefill / 2);
  // KV sizes from the shapes: Llama-3-70B 320 KiB per token (traces/README.md), MLA 576 values.
  CHECK(named_model("llama-3-70b")->kv_bytes_per_token == 327680);
  CHECK(named_model("deepseek-v3")->kv_bytes_per_token == 61 * 576 * 2);
  CHECK(named_model("deepseek-v3")->active_params() == doctest::Approx(37.4e9).epsilon(0.02));
  // A 70B model on two H200s leaves ~113 GB for KV: ~344K tokens.
  const roofline big{*named_gpu("H200"), *named_model("llama-3-70b"), 2, {}};
  CHECK(big.kv_capacity_tokens() == doctest::Approx(344000).epsilon(0.01));
  // MLA under tensor parallelism: every rank holds the whole latent. DeepSeek-V3 (fp8) on 8
  // H200s leaves ~356 GB, of 70,272 B per token per rank: ~633K tokens, not 8 times that.
  const roofline mla{*named_gpu("H200"), *named_model("deepseek-v3"), 8, {}};
  CHECK(mla.kv_capacity_tokens() == doctest::Approx((8 * 141e9 * 0.9 - 671e9) / (8 * 70272.0)).epsilon(0.01));
  // GQA beyond its KV heads: 16 ranks over 8 heads hold each shard twice.
  const roofline wide{*named_gpu("H200"), *named_model("llama-3-70b"), 16, {}};
  CHECK(wide.kv_capacity_tokens() == doctest::Approx((16 * 141e9 * 0.9 - 70.6e9 * 2) / (2 * 327680.0)).epsilon(0.01));
  CHECK(!named_gpu("A100"));
  CHECK(!named_model("gpt-5"));
}

TEST_CASE("roofline with expert parallelism: dispatch bytes, nodes, imbalance, dual-batch overlap and memory") {
  const auto ds = *named_model("deepseek-v3");
  const auto h200 = *named_gpu("H200");
  roofline one{h200, ds, 1, {}};
  roofline ep{h200, ds, 1, {64, 8}};
  CHECK(ep.gpus() == 64);
  // 6,400 decode tokens (100 per GPU): each sends 8 expert copies of 7,168 fp8 values out and takes
  // 8 bf16 results back, per MoE layer; with 8 nodes, 7/8 of the copies cross the network.
  std::vector<step_seq> batch(6400, {1, 4096});
  const auto b = ep.step(batch);
  const double per_layer = 6400.0 * 8 * 7168 * 3;
  CHECK(b.cross_node_bytes == doctest::Approx(58 * per_layer * 7.0 / 8).epsilon(1e-9));
  CHECK(b.intra_node_bytes == doctest::Approx(58 * per_layer / 8 * 7.0 / 8).epsilon(1e-9));
  CHECK(b.all_to_all_us == doctest::Approx(58 * per_layer / 64 * (7.0 / 8 / 50e3 + 7.0 / 64 / 450e3)).epsilon(1e-9));
  // One node (EP 8): nothing crosses.
  roofline node{h200, ds, 1, {8, 8}};
  CHECK(node.step(batch).cross_node_bytes == 0);
  // Overlap hides the smaller of compute and all-to-all; without it they add.
  roofline serial = ep;
  serial.ep.dual_batch_overlap = false;
  CHECK(serial.step(batch).total_us == doctest::Approx(b.gpu_us + b.all_to_all_us + 40).epsilon(1e-9));
  CHECK(b.total_us == doctest::Approx(std::max(b.gpu_us, b.all_to_all_us) + 40).epsilon(1e-9));
  // The busiest GPU sets the pace: a 2x imbalance slows a routed-compute-bound prefill step.
  roofline hot = node;
  hot.ep.imbalance = 2.0;
  std::vector<step_seq> prefill(8, {8192, 0});
  CHECK(hot.step(prefill).gpu_us > 1.2 * node.step(prefill).gpu_us);
  // Memory: 64 GPUs hold the routed experts once and the dense weights 64 times, and much more KV
  // than one GPU (which cannot hold the 671 GB of weights at all).
  CHECK(one.kv_capacity_tokens() == 0);
  CHECK(ep.kv_capacity_tokens() > 50'000'000);  // ~90M tokens of 69 KB
  roofline copies = ep;
  copies.ep.redundant_experts = 32;
  CHECK(copies.kv_capacity_tokens() < ep.kv_capacity_tokens());
}

TEST_CASE("sim with expert parallelism: EPLB cuts the busiest GPU's load and keeps hot experts' dispatch in the node") {
  sim_config cfg;
  cfg.model = "deepseek-v3";
  cfg.prefill_instances = 1;
  cfg.prefill_ep = 8;
  cfg.decode_instances = 1;
  cfg.decode_ep = 32;
  cfg.max_batch = 1024;
  cfg.sample_s = 0;
  trace t;
  for (int i = 0; i < 20; ++i) t.requests.push_back({i * 100'000ll, 2000, 20, {}, std::string{"r"} + std::to_string(i)});
  sim_result off, on;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, t, "ep", &off, &why), why);
  cfg.eplb = true;
  REQUIRE_MESSAGE(run_sim(cfg, t, "ep", &on, &why), why);
  REQUIRE(off.summary.completed == 20);
  REQUIRE(on.summary.completed == 20);
  MESSAGE("imbalance decode " << off.decode_ep_imbalance << " -> " << on.decode_ep_imbalance << ", prefill "
                              << off.prefill_ep_imbalance << " -> " << on.prefill_ep_imbalance << "; cross-node GB "
                              << off.ep_cross_node_gb << " -> " << on.ep_cross_node_gb);
  CHECK(off.decode_ep_imbalance > 1.5);
  CHECK(on.decode_ep_imbalance < 1.1);
  CHECK(on.prefill_ep_imbalance < off.prefill_ep_imbalance);
  // Prefill's EP 8 is one node: its all-to-all never crosses; decode's 32 GPUs are 4 nodes, and
  // EPLB's copies of the hottest experts on every node keep their tokens off the network.
  CHECK(off.ep_cross_node_gb > 0);
  CHECK(on.ep_cross_node_gb < off.ep_cross_node_gb);
  CHECK(on.summary.tpot_ms.mean <= off.summary.tpot_ms.mean);
  cfg.model = "llama-3-70b";
  CHECK_FALSE(run_sim(cfg, t, "ep", &on, &why));
  CHECK(why == "expert parallelism needs a model with routed experts (llama-3-70b has none)");
}

TEST_CASE("sim: one request's TTFT and TBT are the roofline's step times, through the real actors") {
  auto cfg = small_cluster();
  cfg.prefill_instances = 1;
  cfg.decode_instances = 1;
  cfg.model_links = false;  // the handoff is free here; the next test times it
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "one", &r, &why), why);
  REQUIRE(r.summary.completed == 1);
  const roofline roof{*named_gpu("H200"), *named_model("llama-3-8b"), 1, {}};
  // The modelled executor splits a job's time evenly over its 4 layer groups, in whole ns.
  auto job_us = [](double us) { return static_cast<double>(std::llround(us * 1000.0 / 4) * 4) / 1000.0; };
  const auto& o = r.outcomes[0];
  CHECK(static_cast<double>(o.ttft_us) == doctest::Approx(job_us(roof.step_us({{3000, 0}}))).epsilon(1e-4));
  // Decode step k feeds the token at position 3000 + k (the first token came from prefill).
  double last = 0;
  for (uint32_t k = 0; k < 4; ++k) last = job_us(roof.step_us({{1, 3000 + k}}));
  CHECK(static_cast<double>(o.tbt_max_us) == doctest::Approx(last).epsilon(1e-3));
  // A sim stops waiting horizon_s after the last arrival: what is still unanswered then is
  // reported so (a lost reply used to keep the timers, and the sim, going for ever).
  cfg.horizon_s = 0.01;  // the prefill alone takes longer
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "horizon", &r, &why), why);
  CHECK(r.summary.completed == 0);
  CHECK(r.outcomes[0].error == "not answered 0.01 s (horizon_s) after the last arrival");
  cfg.horizon_s = 0;
  CHECK(cfg.validate() == "horizon_s must be > 0 and at most 1e9");
}

TEST_CASE("sim timeline: each rank's occupied fraction per interval is its jobs' time, and its queues are sampled") {
  // One 3,000-token prompt at 0 s and another 12 s later, on one prefill and one decode
  // instance, sampled every 5 s: the prefill rank is busy for one prefill in the first and the
  // third interval, idle in the second; the decode rank runs the first's 4,000 tokens throughout.
  auto cfg = small_cluster();
  cfg.prefill_instances = 1;
  cfg.decode_instances = 1;
  cfg.model_links = false;
  cfg.sample_s = 5;
  trace t;
  t.requests.push_back({0, 3000, 4000, {}, "a"});
  t.requests.push_back({12'000'000, 3000, 5, {}, "b"});
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, t, "two", &r, &why), why);
  REQUIRE(r.summary.completed == 2);
  REQUIRE(r.timeline.ranks.size() == 2);
  const auto& p = r.timeline.ranks[0];
  const auto& d = r.timeline.ranks[1];
  CHECK(p.rank == "prefill-0");
  CHECK(d.rank == "decode-0");
  REQUIRE(p.busy.size() >= 3);
  const double prefill_s = roofline{*named_gpu("H200"), *named_model("llama-3-8b"), 1, {}}.step_us({{3000, 0}}) / 1e6;
  CHECK(p.busy[0] == doctest::Approx(prefill_s / 5).epsilon(0.01));
  CHECK(p.busy[1] == 0);
  CHECK(p.busy[2] == doctest::Approx(prefill_s / 5).epsilon(0.01));
  CHECK(d.running[0] == 1);  // "a" decodes 4,000 tokens: well past the third sample
  CHECK(d.kv_used[0] > 0);
  CHECK(d.busy[1] > 0.9);    // a decode rank with a sequence steps back to back
  CHECK(r.json.find("\"timeline\"") != std::string::npos);
  // Off: no timeline in the report.
  cfg.sample_s = 0;
  REQUIRE(run_sim(cfg, t, "two", &r, &why));
  CHECK(r.json.find("\"timeline\"") == std::string::npos);
}

TEST_CASE("sim: the KV handoff takes the modelled link's time: the last layer group's bytes over the NIC") {
  auto cfg = small_cluster();
  cfg.prefill_instances = 1;
  cfg.decode_instances = 1;
  std::string why;
  sim_result free_links, timed;
  cfg.model_links = false;
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "one", &free_links, &why), why);
  cfg.model_links = true;
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "one", &timed, &why), why);
  // 3,000 tokens fill 47 pages of 64; a layer group is a quarter of Llama-3-8B's 128 KiB per
  // token; 50 GB/s; the prefill rank polls on a 1 ms grid.
  const double group_bytes = 47.0 * 64 * 131072 / 4;
  const double transfer_us = group_bytes / 50e3 + 5;
  const double extra_us = static_cast<double>(timed.outcomes[0].ttft_us - free_links.outcomes[0].ttft_us);
  CHECK(extra_us >= transfer_us - 1);
  CHECK(extra_us <= transfer_us + 1001);
  CHECK(timed.kv_transfer_gb == doctest::Approx(4 * group_bytes / 1e9).epsilon(1e-6));
  CHECK(free_links.kv_transfer_gb == 0);
}

TEST_CASE("sim: a link degraded in virtual time slows the handoffs through it from then on") {
  auto cfg = small_cluster();
  cfg.prefill_instances = 1;
  cfg.decode_instances = 1;
  std::string why;
  sim_result timed, degraded;
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "one", &timed, &why), why);
  cfg.faults.push_back({0, "decode-0", 1.0});  // from the start: 1 GB/s into decode-0
  REQUIRE_MESSAGE(run_sim(cfg, one_request(3000, 5), "one", &degraded, &why), why);
  // Each layer group (98.6 MB, see above) now takes ~99 ms instead of 2: the four queue one
  // after another, the first behind the first quarter of the prefill.
  const double group_ms = 47.0 * 64 * 131072 / 4 / 1e6;
  const double extra_ms = static_cast<double>(degraded.outcomes[0].ttft_us - timed.outcomes[0].ttft_us) / 1e3;
  CHECK(extra_ms >= 3 * group_ms);
  CHECK(extra_ms <= 4 * group_ms + 2);
  CHECK(degraded.json.find("\"fault decode-0\": \"link at 1 GB/s") != std::string::npos);
  cfg.faults = {{0, "decode-0", -1}};
  CHECK(cfg.validate() == "fault on decode-0 degrades its link to a negative rate");
  for (double g : {std::nan(""), std::numeric_limits<double>::infinity()}) {  // NaN killed the rank instead
    CAPTURE(g);
    cfg.faults = {{0, "decode-0", g}};
    CHECK(cfg.validate() == "fault on decode-0 degrades its link to a rate that is not a finite number (degrade_gbps)");
  }
  cfg.faults = {{0, "store-0", 0}};
  CHECK(cfg.validate().rfind("fault names no rank 'store-0'", 0) == 0);  // no store here
}

TEST_CASE("sim: the same trace and configuration give a byte-identical report; the seed matters only where "
          "something is sampled") {
  const auto cfg = small_cluster();
  const auto t = small_trace(7);
  REQUIRE(t.requests.size() > 40);
  sim_result a, b;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, t, "synthetic", &a, &why), why);
  REQUIRE_MESSAGE(run_sim(cfg, t, "synthetic", &b, &why), why);
  CHECK(a.summary.completed == t.requests.size());
  CHECK(a.json == b.json);
  CHECK(a.events == b.events);
  // Replaying a trace samples nothing: another seed changes only the recorded seed.
  auto other = cfg;
  other.seed = 99;
  sim_result c;
  REQUIRE(run_sim(other, t, "synthetic", &c, &why));
  const std::regex seed_line{"\"seed\": \"[0-9]+\""};
  CHECK(std::regex_replace(a.json, seed_line, "") == std::regex_replace(c.json, seed_line, ""));
  // Synthetic arrivals are drawn from the seed: another seed, another workload, another report.
  sim_result d;
  REQUIRE(run_sim(cfg, small_trace(8), "synthetic", &d, &why));
  CHECK(std::regex_replace(a.json, seed_line, "") != std::regex_replace(d.json, seed_line, ""));
}

TEST_CASE("sim: shared prefixes (Mooncake hash ids) hit the prefill ranks' local tiers") {
  trace t;
  for (int i = 0; i < 20; ++i)  // every request shares blocks 0 and 1 (a system prompt), then its own
    t.requests.push_back({i * 200000, 1536, 8, {0, 1, static_cast<uint64_t>(100 + i)}, std::string("r").append(std::to_string(i))});
  auto cfg = small_cluster();
  cfg.prefill_instances = 1;
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, t, "shared", &r, &why), why);
  REQUIRE(r.summary.completed == 20);
  CHECK(r.outcomes[0].cached_tokens == 0);
  for (size_t i = 1; i < 20; ++i) CHECK(r.outcomes[i].cached_tokens == 1024);
  CHECK(r.summary.cache_hit_ratio == doctest::Approx(19.0 * 1024 / (20 * 1536)));
  CHECK(r.outcomes[1].ttft_us < r.outcomes[0].ttft_us);  // the cached prefix is not computed again
  // The ids name 512-token blocks whatever the store's block size: with blocks of 1024, two
  // prompts sharing only their first id share no whole block (they shared 1024 tokens before).
  trace two;
  two.requests.push_back({0, 1024, 4, {0, 1}, "a"});
  two.requests.push_back({200000, 1024, 4, {0, 2}, "b"});
  two.requests.push_back({400000, 1536, 4, {0, 1, 3}, "c"});
  cfg.block_tokens = 1024;
  REQUIRE_MESSAGE(run_sim(cfg, two, "block size", &r, &why), why);
  CHECK(r.outcomes[1].cached_tokens == 0);
  CHECK(r.outcomes[2].cached_tokens == 1024);  // ids 0, 1: the whole first block of "a"
}

TEST_CASE("sim: a decode rank and a prefill rank killed mid-trace: every request is accounted for") {
  // Five minutes of the Mooncake conversation trace on 16 H200s (Llama-3-70B, TP2, 5 prefill + 3
  // decode instances); decode-1 dies at 100 s, prefill-0 at 150 s. Requests that lose a rank are
  // re-placed -- some onto a prefill rank that still holds their earlier attempt (a regression:
  // it used to refuse them as duplicates).
  trace t;
  std::string why;
  trace_options o;
  o.window_s = 300;
  REQUIRE_MESSAGE(load_trace(BATON_SOURCE_DIR "/traces/mooncake_conversation_trace.jsonl", o, &t, &why), why);
  sim_config cfg;
  cfg.prefill_instances = 5;
  cfg.decode_instances = 3;
  cfg.faults = {{100.0, "decode-1"}, {150.0, "prefill-0"}};
  sim_result r;
  REQUIRE_MESSAGE(run_sim(cfg, t, "faults", &r, &why), why);
  CHECK(r.summary.requests == t.requests.size());
  CHECK_MESSAGE(r.summary.completed == t.requests.size(), r.json);  // re-placed, none lost
  CHECK(r.summary.failovers >= 10);
  size_t after = 0;  // requests that arrived after the kills went only to the survivors
  for (const auto& x : r.outcomes)
    if (x.arrival_us > 151'000'000) {
      ++after;
      CHECK(x.decode_rank != "decode-1");
      CHECK(x.prefill_rank != "prefill-0");
    }
  CHECK(after > 100);
  cfg.faults = {{1.0, "decode-7"}};
  CHECK_FALSE(run_sim(cfg, t, "faults", &r, &why));
  CHECK(why.find("decode-7") != std::string::npos);
}

TEST_CASE("sim: the colocated baseline prefills on the decode instances in chunks") {
  auto cfg = small_cluster();
  cfg.colocated = true;
  cfg.colocated_chunk_tokens = 512;
  const auto t = small_trace(5);
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(cfg, t, "colocated", &r, &why), why);
  CHECK(r.summary.completed == t.requests.size());
  for (const auto& o : r.outcomes) CHECK(o.prefill_rank == o.decode_rank);
  // Colocated DeepSeek-V3 on wide EP: the (unused) prefill pool of tp x H200 cannot hold the
  // weights, which must not refuse the run (it did: "an instance holds 0 KV tokens").
  sim_config ds;
  ds.model = "deepseek-v3";
  ds.colocated = true;
  ds.decode_instances = 1;
  ds.decode_ep = 16;
  ds.tp = 1;
  ds.sample_s = 0;
  REQUIRE_MESSAGE(run_sim(ds, one_request(500, 4), "colocated ep", &r, &why), why);
  CHECK(r.summary.completed == 1);
}

TEST_CASE("sim: goodput is the highest rate scale with 90% within both SLOs, found by bisection") {
  auto cfg = small_cluster();
  cfg.model = "llama-3-70b";  // two prefill instances of 2 x H200 saturate near 15 prompts/s here
  cfg.tp = 2;
  cfg.slos = {1000, 60};
  std::vector<std::pair<double, double>> runs;
  std::string why;
  const double g = find_goodput(cfg, [](double scale) { return small_trace(11, 2.0 * scale, 15.0); }, 0.5, 16, 5, 0.9,
                                &runs, &why);
  REQUIRE_MESSAGE(why.empty(), why);
  REQUIRE(g > 0.5);
  REQUIRE(g < 16);
  for (const auto& [scale, attainment] : runs) {
    CAPTURE(scale);
    if (scale <= g) CHECK(attainment >= 0.9);
  }
  CHECK(std::any_of(runs.begin(), runs.end(), [&](auto& r) { return r.first > g && r.second < 0.9; }));
}

TEST_CASE("sim: configurations that cannot run say why") {
  sim_result r;
  std::string why;
  auto cfg = small_cluster();
  cfg.model = "gpt-5";
  CHECK_FALSE(run_sim(cfg, one_request(10, 2), "x", &r, &why));
  CHECK(why.find("unknown model 'gpt-5'") != std::string::npos);
  cfg = small_cluster();
  cfg.decode_gpu = "A100";
  CHECK_FALSE(run_sim(cfg, one_request(10, 2), "x", &r, &why));
  CHECK(why.find("unknown GPU 'A100'") != std::string::npos);
  cfg = small_cluster();
  cfg.kv_tokens = 1000;
  CHECK_FALSE(run_sim(cfg, one_request(4000, 2), "x", &r, &why));
  CHECK(why.find("holds 1000 KV tokens") != std::string::npos);
  // Ranks get whole pages: 4,000 tokens are 62 pages of 64, too few for 3,992 (it passed, and the
  // request could never be placed).
  cfg.kv_tokens = 4000;
  CHECK_FALSE(run_sim(cfg, one_request(3990, 2), "x", &r, &why));
  CHECK(why == "an instance holds 4000 KV tokens (62 pages of 64; llama-3-8b on 1 x H200), the longest request needs "
               "3992 (63 pages)");
  // A rank counts its pages in a uint32_t: 2^32 of them are refused, not cut to 0.
  cfg.kv_tokens = (uint64_t{UINT32_MAX} + 1) * 64;
  CHECK_FALSE(run_sim(cfg, one_request(10, 2), "x", &r, &why));
  CHECK(why == "an instance's 274877906944 KV tokens (llama-3-8b on 1 x H200) make 4294967296 pages of 64, more than a "
               "rank counts (4294967295)");
  // A prefill rank holds only its prompt: a small prefill GPU (an RTX 4090 keeps ~42K tokens of
  // Llama-3-8B beside the weights) limits the prompt, not the output.
  cfg = small_cluster();
  cfg.prefill_instances = 1;
  cfg.decode_instances = 1;
  cfg.prefill_gpu = "RTX4090";
  cfg.sample_s = 0;
  cfg.horizon_s = 0.01;  // whether it may run is the point, not the 50,000 decode steps
  CHECK_FALSE(run_sim(cfg, one_request(50000, 2), "x", &r, &why));
  CHECK(why.find("x RTX4090), the longest prompt needs 50000") != std::string::npos);
  CHECK_MESSAGE(run_sim(cfg, one_request(1000, 50000), "x", &r, &why), why);
}

TEST_CASE("sim report: percentiles interpolate, Mooncake's TBT is the slowest tenth of a request's intervals") {
  const auto p = percentiles_of({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  CHECK(p.p50 == doctest::Approx(5.5));
  CHECK(p.p90 == doctest::Approx(9.1));
  CHECK(p.max == 10);
  request_outcome o;
  std::vector<int64_t> tbt(20, 10);
  tbt[3] = 100;
  tbt[7] = 50;
  summarize_intervals(tbt, &o);
  CHECK(o.tbt_slow10_us == doctest::Approx(75));  // the 2 slowest of 20
  CHECK(o.tbt_max_us == 100);
  CHECK(o.tbt_mean_us == doctest::Approx((18 * 10 + 150) / 20.0));
}

TEST_CASE("sim report: the cache hit ratio is over completed requests, and a non-finite number is null in the JSON") {
  request_outcome done, failed;
  done.ok = true;
  done.input_tokens = 1000;
  done.output_tokens = 1;
  done.cached_tokens = 500;
  done.prefill_rank = "prefill-0";
  failed.input_tokens = 1000;  // a failed request reports no cached tokens
  failed.error = "not answered";
  const auto s = summarize({done, failed}, slo{});
  CHECK(s.failed == 1);
  CHECK(s.cache_hit_ratio == doctest::Approx(0.5));  // it was 0.25: the failed prompt counted as a miss
  // JSON has no NaN or infinity: "nan" did not parse back and report_json threw; nor may a
  // string that is not UTF-8.
  const std::map<std::string, std::string> config = {{"name", "bad \xff byte"}};
  const std::map<std::string, double> extra = {{"a", std::nan("")}, {"b", std::numeric_limits<double>::infinity()}};
  std::string j;
  REQUIRE_NOTHROW(j = report_json(config, s, extra));
  CHECK(j.find("\"a\": null") != std::string::npos);
  CHECK(j.find("\"b\": null") != std::string::npos);
  CHECK(j.find("bad \xef\xbf\xbd byte") != std::string::npos);  // U+FFFD in its place
}

TEST_CASE("sim plots: a CDF climbs to 1 over sorted values, and the SVG draws one polyline per series") {
  std::vector<double> v;
  for (int i = 1000; i > 0; --i) v.push_back(i);
  const auto c = cdf_of("x", v, 50);
  REQUIRE(c.points.size() == 50);
  CHECK(c.points.front().first == 1);
  CHECK(c.points.back().first == 1000);
  CHECK(c.points.back().second == doctest::Approx(1.0));
  for (size_t i = 1; i < c.points.size(); ++i) {
    CHECK(c.points[i].first >= c.points[i - 1].first);
    CHECK(c.points[i].second > c.points[i - 1].second);
  }
  const auto svg = svg_plot("a <title>", "x", "y", {c, cdf_of("y", {1, 2, 3})}, 500);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  CHECK(svg.find("a &lt;title&gt;") != std::string::npos);  // escaped
  size_t lines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++lines;
  CHECK(lines == 2);
}

TEST_CASE("sim: a trace longer than the virtual clock counts is refused with a sentence (it ended with every request "
          "failed and no reason)") {
  auto t = one_request(100, 10);
  t.requests.push_back({int64_t{10'000'000'000} * 1'000'000, 100, 10, {}, "centuries later"});  // 1e10 s: ~317 years
  sim_result r;
  std::string why;
  CHECK_FALSE(run_sim(small_cluster(), t, "long", &r, &why));
  CHECK(why == "long: its last arrival (10000000000 s) plus horizon_s passes what the sims' clock counts (9e9 s)");
}

TEST_CASE("sim config: policy names, SLOs and link rates are refused by validate(), before any run; KV pools past this "
          "machine's memory in the sim's words") {
  // The balancers parsed their names only when a run started them: compare ran its earlier
  // variants first. split parses, and is refused for sims: it is not offered.
  auto cfg = small_cluster();
  cfg.prefill_policy = "leastloaded";
  CHECK(cfg.validate() == "prefill_policy must be seed, least_loaded, round_robin or cache_affinity, got 'leastloaded'");
  cfg = small_cluster();
  cfg.decode_policy = "fastest";
  CHECK(cfg.validate() == "decode_policy must be seed, least_loaded or round_robin, got 'fastest'");
  cfg = small_cluster();
  cfg.prefill_policy = "split";
  CHECK(cfg.validate().find("the split prefill policy is not supported in sims yet") == 0);
  cfg = small_cluster();
  cfg.slos = {0, 100};
  CHECK(cfg.validate() == "the SLOs (ttft_ms, tbt_ms) must be > 0");
  cfg = small_cluster();
  cfg.nic_gbps = -3;  // ran as the default rate, as 0 does
  CHECK(cfg.validate() == "nic_gbps and pcie_gbps must be >= 0 (0: the GPU's own rate)");
  // A rank of 1,562,499,999 pages of carrier KV (4 KB each): terabytes in one allocation. The
  // cluster refused it in `baton local`'s words ("lower --kv-pages"); the sim says it first,
  // naming its own field. (The pools together are not held to memory: never written, they take
  // address space only.)
  cfg = small_cluster();
  cfg.kv_tokens = 99'999'999'999;
  const auto e = kv_memory_problem(cfg);
  CHECK_MESSAGE(e.find("a decode rank's KV pool of 1562499999 pages (99999999999 KV tokens per instance; ") == 0, e);
  CHECK(e.find("in one allocation, more than this machine's") != std::string::npos);
  CHECK(e.find("give a smaller kv_tokens") != std::string::npos);
  CHECK(e.find("kv-pages") == std::string::npos);
  sim_result r;
  std::string why;
  CHECK(run_problem(cfg, one_request(10, 2), "x") == e);
  CHECK_FALSE(run_sim(cfg, one_request(10, 2), "x", &r, &why));
  CHECK(why == e);
  cfg.kv_tokens = 0;  // the roofline's capacity: ~850K tokens an H200, about 200 MB of carrier KV in all
  CHECK(kv_memory_problem(cfg).empty());
  // Pools of 40% of this machine's memory each, 160% together: taken (each is one allocation
  // that fits; none is written).
  const uint64_t memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  cfg.kv_tokens = memory * 4 / 10 / 4096 * cfg.page_tokens;
  CHECK_MESSAGE(kv_memory_problem(cfg).empty(), kv_memory_problem(cfg));
}
