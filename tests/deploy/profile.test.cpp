// The profile file (`baton profile` output) and the seed's cost example on the committed CPU
// profile of the built-in model.

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>

#include "deploy/profile_file.hpp"

using namespace baton;

namespace {

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/baton-profile-test-" + name + ".json";
  std::ofstream{path} << text;
  return path;
}

}  // namespace

TEST_CASE("seed 000 example on the committed CPU profile: cost(2K new on a 30K prefix) < cost(32K uncached) / 8") {
  deploy::executor_profile p;
  std::string why;
  REQUIRE_MESSAGE(deploy::read_profile(BATON_SOURCE_DIR "/deploy/profiles/cpu_builtin_1thread.json", &p, &why), why);
  const double a = p.prefill.prefill_us(2048, 30720), b = p.prefill.prefill_us(32768, 0);
  INFO("cost(A) = " << a << " us, cost(B) = " << b << " us");
  CHECK(a < b / 8);
  // The profile is only trusted if it predicted its own held-out points well.
  CHECK(p.prefill_held_out.count >= 3);
  CHECK(p.prefill_held_out.mean_rel < 0.15);
}

TEST_CASE("profile files round-trip and malformed ones are refused with a sentence naming the problem") {
  deploy::executor_profile p;
  p.executor = "cpu x1 threads";
  p.prefill = {0.2, 0.4, 100.0, 1000.0};
  p.decode = {900.0, 100.0, 1.0};
  p.prefill_samples = {{16, 0, 3000.0}};
  const std::string path = "/tmp/baton-profile-test-roundtrip.json";
  REQUIRE(deploy::write_profile(path, p).empty());
  deploy::executor_profile back;
  std::string why;
  REQUIRE_MESSAGE(deploy::read_profile(path, &back, &why), why);
  CHECK(back.prefill.delta_us == 1000.0);
  CHECK(back.decode.per_seq_us == 100.0);
  CHECK(back.prefill_samples.size() == 1);

  CHECK_FALSE(deploy::read_profile("/tmp/baton-no-such-profile.json", &back, &why));
  CHECK(why.find("cannot open") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("garbage", "{not json"), &back, &why));
  CHECK(why.find("not valid JSON") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("format", R"({"format": "other"})"), &back, &why));
  CHECK(why.find("baton-profile-1") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(
      write_temp("missing", R"({"format": "baton-profile-1", "prefill": {"alpha_us": 1, "beta_us": 1}})"), &back, &why));
  CHECK(why.find("prefill.gamma_us") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("negative", R"({"format": "baton-profile-1",
      "prefill": {"alpha_us": -1, "beta_us": 1, "gamma_us": 1, "delta_us": 0},
      "decode": {"step_base_us": 1, "per_seq_us": 1, "per_context_token_us": 1}})"),
                                   &back, &why));
  CHECK(why.find("not usable") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("negative-decode", R"({"format": "baton-profile-1",
      "prefill": {"alpha_us": 1, "beta_us": 1, "gamma_us": 1, "delta_us": 0},
      "decode": {"step_base_us": 500, "per_seq_us": -20, "per_context_token_us": 0.05}})"),
                                   &back, &why));
  CHECK(why.find("decode coefficients are not usable") != std::string::npos);
  // 1e300 overflowed the sims' integer step times (steps that took no time); -1 points was cast
  // to size_t.
  CHECK_FALSE(deploy::read_profile(write_temp("huge", R"({"format": "baton-profile-1",
      "prefill": {"alpha_us": 1, "beta_us": 1, "gamma_us": 1e300, "delta_us": 0},
      "decode": {"step_base_us": 1, "per_seq_us": 1, "per_context_token_us": 1}})"),
                                   &back, &why));
  CHECK(why.find("prefill.gamma_us must be a number within +-1e9, got 1e+300") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("points", R"({"format": "baton-profile-1",
      "prefill": {"alpha_us": 1, "beta_us": 1, "gamma_us": 1, "delta_us": 0, "held_out_points": -1},
      "decode": {"step_base_us": 1, "per_seq_us": 1, "per_context_token_us": 1}})"),
                                   &back, &why));
  CHECK(why.find("prefill.held_out_points must be a whole number >= 0") != std::string::npos);
  CHECK_FALSE(deploy::read_profile(write_temp("badsample", R"({"format": "baton-profile-1",
      "prefill": {"alpha_us": 1, "beta_us": 1, "gamma_us": 1, "delta_us": 0},
      "decode": {"step_base_us": 1, "per_seq_us": 1, "per_context_token_us": 1},
      "prefill_samples": [{"q": "sixteen"}]})"),
                                   &back, &why));
  CHECK(why.find("profile file") != std::string::npos);
}
