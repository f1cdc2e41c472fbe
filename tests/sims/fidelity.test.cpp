// Issue 8, fidelity: step times from per-layer profile tables measured inside vLLM, and the
// colocated baseline replaying the measured vLLM runs of traces/vllm_measured/ with one
// parameter set for both GPUs (only the profile tables, the GPUs' memory and each run's recorded
// max_num_seqs differ; nothing is fitted to the request files).

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

#include "sims/profile_table.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

using namespace baton::sims;

namespace {

const std::string measured = BATON_SOURCE_DIR "/traces/vllm_measured/";

std::vector<step_seq> decodes(uint32_t n, uint32_t context) { return std::vector<step_seq>(n, step_seq{1, context}); }

/// The colocated vLLM-like configuration both runs share.
sim_config vllm_like(const std::string& gpu, uint32_t max_num_seqs, const std::string& profile) {
  sim_config c;
  c.model = "llama-3-8b";
  c.tp = 1;
  c.colocated = true;
  c.decode_instances = 1;
  c.prefill_gpu = c.decode_gpu = gpu;
  c.max_batch = max_num_seqs;
  c.colocated_chunk_tokens = 2048;  // max_num_batched_tokens
  c.page_tokens = 16;               // vLLM's block size
  c.kv_on_demand_tokens = 16;       // blocks allocated as sequences grow
  c.profile = measured + "profiles/" + profile;
  return c;
}

}  // namespace

TEST_CASE("profile tables: a step sums the measured layers as the traces' README does, and measured rows come back "
          "exactly") {
  std::string why;
  auto rtx = profile_table::load(measured + "profiles/rtx4090_llama-3.1-8b_tp1", &why);
  REQUIRE_MESSAGE(rtx, why);
  auto pro = profile_table::load(measured + "profiles/rtxpro6000_llama-3.1-8b_tp1", &why);
  REQUIRE_MESSAGE(pro, why);
  // Rows of the attention table, exactly (first data rows of the files, and a mixed one).
  CHECK(rtx->attention_us(0, 0, 1, 16) == doctest::Approx(9.31067));
  CHECK(rtx->attention_us(2048, 0, 0, 0) == doctest::Approx(336.126));
  CHECK(rtx->attention_us(1024, 0, 32, 1024) == doctest::Approx(443.446));
  CHECK(pro->attention_us(0, 0, 1, 16) == doctest::Approx(8.35233));
  // Between rows: between its neighbours.
  const double mid = rtx->attention_us(0, 0, 48, 1024);
  CHECK(mid > rtx->attention_us(0, 0, 32, 1024));
  CHECK(mid < rtx->attention_us(0, 0, 64, 1024));
  // The README's figures from the same tables: a single-sequence decode step ~16.8 ms on the
  // RTX 4090; 128 decodes at 1,024 KV tokens ~40 ms and ~25 ms; a 2,048-token chunk ~193 ms and ~83 ms.
  CHECK(rtx->step_us(decodes(1, 1024), 32) / 1e3 == doctest::Approx(16.8).epsilon(0.05));
  CHECK(rtx->step_us(decodes(128, 1023), 32) / 1e3 == doctest::Approx(40).epsilon(0.05));
  CHECK(pro->step_us(decodes(128, 1023), 32) / 1e3 == doctest::Approx(25).epsilon(0.05));
  CHECK(rtx->step_us({{2048, 0}}, 32) / 1e3 == doctest::Approx(193).epsilon(0.05));
  CHECK(pro->step_us({{2048, 0}}, 32) / 1e3 == doctest::Approx(83).epsilon(0.05));
}

TEST_CASE("profile tables: a missing file or a malformed line is an error naming it") {
  std::string dir = "/tmp/baton-profile-test-";
  dir += std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0755);
  const std::string prefix = dir + "/gpu_model_tp1";
  std::string why;
  CHECK_FALSE(profile_table::load(prefix, &why));
  CHECK_MESSAGE(why.find("gpu_model_tp1_dense.csv: cannot open") != std::string::npos, why);
  std::ofstream{prefix + "_dense.csv"} << "layer,tokens,time_us\nembedding,1,2.5\nfinal_layernorm,1,x\n";
  CHECK_FALSE(profile_table::load(prefix, &why));
  CHECK_MESSAGE(why.find("_dense.csv:3: expected 1 name and 2 non-negative numbers") != std::string::npos, why);
  std::ofstream{prefix + "_dense.csv"} << "layer,tokens,time_us\nembedding,1,2.5\nfinal_layernorm,1,3\n";
  std::ofstream{prefix + "_attention.csv"} << "prefill_chunk,kv_prefill,n_decode,kv_decode\n";
  CHECK_FALSE(profile_table::load(prefix, &why));
  CHECK_MESSAGE(why.find("_attention.csv:1: expected the header") != std::string::npos, why);
  std::ofstream{prefix + "_attention.csv"} << "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,9\n";
  std::ofstream{prefix + "_per_sequence.csv"} << "layer,sequences,time_us\nlm_head,1,1000\nsampler,1,50\n";
  CHECK_FALSE(profile_table::load(prefix, &why));  // no prefill rows
  CHECK_MESSAGE(why.find("needs rows without a prefill chunk and rows of a chunk without decodes") != std::string::npos, why);
  for (const char* f : {"_dense.csv", "_attention.csv", "_per_sequence.csv"}) std::remove((prefix + f).c_str());
  ::rmdir(dir.c_str());
  // A profile of another TP degree than the cluster's is refused.
  sim_config c;
  c.model = "llama-3-8b";
  c.tp = 2;
  c.profile = "somewhere/rtx4090_llama-3.1-8b_tp1";
  CHECK(c.validate() == "the profile somewhere/rtx4090_llama-3.1-8b_tp1 was measured at TP 1, not --tp 2");
}

TEST_CASE("fidelity: one parameter set predicts both measured Llama-3.1-8B vLLM runs, TPOT mean within 10% and "
          "TTFT p50 within 25%") {
  struct run {
    const char* name;
    const char* gpu;
    uint32_t max_num_seqs;  // as each run was configured (traces/README.md)
  };
  for (const run r : {run{"rtx4090", "RTX4090", 256}, run{"rtxpro6000", "RTXPRO6000", 128}}) {
    const std::string name = r.name;
    CAPTURE(name);
    trace t;
    std::string why;
    REQUIRE_MESSAGE(load_trace(measured + r.name + "_llama-3.1-8b_requests.jsonl", {}, &t, &why), why);
    sim_result res;
    REQUIRE_MESSAGE(run_sim(vllm_like(r.gpu, r.max_num_seqs, std::string{r.name} + "_llama-3.1-8b_tp1"), t, r.name,
                            &res, &why),
                    why);
    CHECK(res.summary.completed == 300);
    const double tpot = res.summary.tpot_ms.mean / res.measured_tpot_ms.mean - 1;
    const double ttft = res.summary.ttft_ms.p50 / res.measured_ttft_ms.p50 - 1;
    MESSAGE(name << ": TPOT mean " << res.summary.tpot_ms.mean << " ms vs measured " << res.measured_tpot_ms.mean
                   << " (" << 100 * tpot << "%), TTFT p50 " << res.summary.ttft_ms.p50 << " ms vs measured "
                   << res.measured_ttft_ms.p50 << " (" << 100 * ttft << "%)");
    CHECK(std::abs(tpot) <= 0.10);
    CHECK(std::abs(ttft) <= 0.25);
    CHECK(res.json.find("\"ttft_p50_error\"") != std::string::npos);
  }
}

TEST_CASE("fidelity: the measured percentiles are over the requests the sim completed, as the simulated ones are") {
  sim_config c;
  c.model = "llama-3-8b";
  c.tp = 1;
  c.prefill_instances = 1;
  c.decode_instances = 1;
  c.model_links = false;
  c.sample_s = 0;
  c.horizon_s = 0.5;  // "a" completes in milliseconds; "b"'s 5,000 decode steps take ~20 s
  trace t;
  t.requests.push_back({0, 100, 2, {}, "a", 0.010, 0.020, 0.030});
  t.requests.push_back({0, 100, 5000, {}, "b", 1.0, 1.0, 100.0});
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(c, t, "one done", &r, &why), why);
  REQUIRE(r.summary.completed == 1);
  CHECK(!r.outcomes[1].ok);
  // "b"'s measured times, whose simulated ones never came, would pull the errors (it counted them).
  CHECK(r.measured_ttft_ms.count == r.summary.ttft_ms.count);
  CHECK(r.measured_tpot_ms.count == r.summary.tpot_ms.count);
  CHECK(r.measured_e2e_ms.count == r.summary.e2e_ms.count);
  CHECK(r.measured_ttft_ms.mean == doctest::Approx(10));
  CHECK(r.measured_tpot_ms.mean == doctest::Approx(20));
  CHECK(r.measured_e2e_ms.mean == doctest::Approx(30));
}

TEST_CASE("sim: step times from a fitted cost-model profile (`baton profile` output)") {
  sim_config c;
  c.model = "llama-3-8b";
  c.tp = 1;
  c.prefill_instances = 1;
  c.decode_instances = 1;
  c.model_links = false;
  c.use_cost_profile = true;
  c.prefill_cost.alpha_us = 1e-6;  // cost(q, c) = 1e-6 q^2 + 50 q + 2,000 us
  c.prefill_cost.gamma_us = 50;
  c.prefill_cost.delta_us = 2000;
  c.decode_cost = {8000, 10, 0.5};  // 8 ms + 10 us per sequence + 0.5 us per context token
  c.cost_profile_name = "test";
  trace t;
  t.requests.push_back({0, 3000, 3, {}, "only"});
  sim_result r;
  std::string why;
  REQUIRE_MESSAGE(run_sim(c, t, "one", &r, &why), why);
  REQUIRE(r.summary.completed == 1);
  const auto& o = r.outcomes[0];
  CHECK(static_cast<double>(o.ttft_us) == doctest::Approx(1e-6 * 3000 * 3000 + 50 * 3000 + 2000).epsilon(1e-4));
  // The second decode step feeds position 3001: one sequence over 3,002 context tokens.
  CHECK(static_cast<double>(o.tbt_max_us) == doctest::Approx(8000 + 10 + 0.5 * 3002).epsilon(1e-3));
  CHECK(r.json.find("\"step_times\": \"cost models test\"") != std::string::npos);
  c.profile = "x_tp1";
  CHECK(c.validate() == "give a profile table or a cost profile, not both");
}
