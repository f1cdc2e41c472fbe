// Issue 15 in the sims: the elastic controller and its planner in the loop, under virtual time.

#include <doctest/doctest.h>

#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

using namespace baton::sims;

TEST_CASE("sim elastic: a prefill-heavy stretch moves elastic instances to prefill, every request is served, and the "
          "report lists each move with its reason, the same on every run") {
  // Ten minutes of arrivals: 2,048-token prompts, 16-token outputs, at a rate one prefill
  // instance cannot keep up with; 1 fixed prefill + 1 fixed decode + 4 elastic (all decoding).
  synthetic_spec s;
  s.rate_per_s = 6;
  s.duration_s = 600;
  s.input = {length_dist::fixed, 2048, 1, 2048, 2048};
  s.output = {length_dist::fixed, 16, 1, 16, 16};
  const auto t = synthetic_trace(s);
  sim_config c;
  c.model = "llama-3-70b";
  c.tp = 2;
  c.prefill_instances = 1;
  c.decode_instances = 1;
  c.elastic_instances = 4;
  c.elastic_prefill_at_start = 0;
  sim_result a, b;
  std::string why;
  REQUIRE_MESSAGE(run_sim(c, t, "prefill heavy", &a, &why), why);
  REQUIRE(a.summary.completed == t.requests.size());
  REQUIRE_FALSE(a.role_changes.empty());
  for (const auto& m : a.role_changes) MESSAGE(m);
  CHECK(a.role_changes[0].find("decode -> prefill (done") != std::string::npos);
  CHECK(a.role_changes[0].find("prefill pool hot, decode pool cold") != std::string::npos);
  CHECK(a.json.find("\"role change 001\"") != std::string::npos);
  // The same cluster without elastic instances' help: one prefill instance falls behind.
  sim_config fixed = c;
  fixed.elastic_instances = 0;
  fixed.decode_instances = 5;
  sim_result f;
  REQUIRE_MESSAGE(run_sim(fixed, t, "prefill heavy", &f, &why), why);
  MESSAGE("TTFT p50: elastic " << a.summary.ttft_ms.p50 << " ms, static 1:5 " << f.summary.ttft_ms.p50 << " ms");
  CHECK(a.summary.ttft_ms.p50 < f.summary.ttft_ms.p50);
  REQUIRE_MESSAGE(run_sim(c, t, "prefill heavy", &b, &why), why);
  CHECK(a.json == b.json);
  c.elastic_prefill_at_start = 5;
  CHECK(c.validate() == "elastic_prefill_at_start exceeds elastic_instances");
  // Intervals that round to 0 µs would stop virtual time (the sim never ended): refused.
  c.elastic_prefill_at_start = 0;
  c.elastic_interval_s = 1e-4;
  CHECK(c.validate() == "elastic_interval_s must be between 0.001 and 1e6");
  c.elastic_interval_s = 1;
  c.sample_s = 1e-7;
  CHECK(c.validate() == "sample_s must be 0 (off) or between 0.001 and 1e6");
  c.sample_s = 0;
  CHECK(c.validate().empty());
}
