// Speculative decoding by prompt lookup on a decode rank (decode_rank_config::speculative_tokens):
// the drafts change how many steps an answer takes, never its tokens or their log-probabilities.

#include <doctest/doctest.h>

#include <future>
#include <string>
#include <vector>

#include "tests/actors/cluster_fixture.hpp"

using namespace baton;
using test::small_cluster;

namespace {

/// What a cluster answered to each of a set of requests, and its decode rank's draft counts.
struct answers {
  std::vector<completion> done;
  rank_stats decode;
  uint64_t sequential_steps = 0;  ///< decode steps of the requests sent one at a time
};

/// The requests: greedy on a prompt that repeats itself (drafts found at once), drawn with
/// penalties, min_tokens, a stop string, log-probabilities -- and three at once, so that rows with
/// and without drafts share steps (with hybrid prefill, local prompts' chunks too).
answers run_all(test::cluster_system& t, const local_cluster_config& cfg) {
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  std::vector<generate_request> reqs;
  generate_request loop;
  loop.prompt = "one two three, one two three, one two three, one two three, one two";
  loop.max_tokens = 40;
  loop.ignore_eos = true;
  reqs.push_back(loop);
  auto drawn = loop;
  drawn.temperature = 0.9f;
  drawn.seed = 11;
  drawn.top_k = 20;
  drawn.top_p = 0.9f;
  drawn.repetition_penalty = 1.3f;
  drawn.presence_penalty = 0.4f;
  drawn.frequency_penalty = 0.3f;
  reqs.push_back(drawn);
  auto warm = loop;
  warm.temperature = 0.7f;
  warm.seed = 3;
  warm.logprobs = true;
  warm.top_logprobs = 3;
  reqs.push_back(warm);
  auto held = loop;
  held.ignore_eos = false;
  held.min_tokens = 12;
  held.max_tokens = 30;
  reqs.push_back(held);
  answers out;
  for (const auto& r : reqs) {
    auto got = t.generate(cluster.router, r);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    out.done.push_back(std::move(*got));
  }
  // A stop string from the middle of the greedy answer (the same with drafts or without).
  auto stopped = loop;
  REQUIRE(out.done[0].text.size() > 20);
  stopped.stop = {out.done[0].text.substr(17, 3)};
  auto cut = t.generate(cluster.router, stopped);
  REQUIRE_MESSAGE(cut, t.sys.render(cut.error()));
  out.done.push_back(std::move(*cut));
  out.sequential_steps = t.stats(cluster.decode[0].handle).num_steps;  // one request at a time: no timing in it
  std::vector<std::future<caf::expected<completion>>> together;
  for (size_t i = 0; i < 3; ++i)
    together.push_back(std::async(std::launch::async, [&, i] { return t.generate(cluster.router, reqs[i]); }));
  for (auto& f : together) {
    auto got = f.get();
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    out.done.push_back(std::move(*got));
  }
  out.decode = t.stats(cluster.decode[0].handle);
  return out;
}

}  // namespace

TEST_CASE("speculative decoding by prompt lookup gives the tokens and log-probabilities decoding one token a step "
          "gives -- greedy, drawn with penalties, min_tokens, stop strings, several sequences a step, hybrid "
          "prefill chunks alongside -- and its drafts are run and some kept") {
  test::cluster_system t;
  for (const bool hybrid : {false, true}) {
    CAPTURE(hybrid);
    auto cfg = small_cluster(hybrid);
    const auto plain = run_all(t, cfg);
    cfg.decode.speculative_tokens = 4;
    const auto spec = run_all(t, cfg);
    CHECK(plain.decode.drafted_tokens == 0);
    REQUIRE(plain.done.size() == spec.done.size());
    for (size_t i = 0; i < plain.done.size(); ++i) {
      CAPTURE(i);
      const auto &a = plain.done[i], &b = spec.done[i];
      CHECK(a.tokens == b.tokens);
      CHECK(a.text == b.text);
      CHECK(a.finish_reason == b.finish_reason);
      REQUIRE(a.logprobs.size() == b.logprobs.size());
      for (size_t k = 0; k < a.logprobs.size(); ++k) {
        CHECK(a.logprobs[k].logprob == b.logprobs[k].logprob);  // bit-equal: the same row's logits
        CHECK(a.logprobs[k].top_tokens == b.logprobs[k].top_tokens);
      }
    }
    CHECK(spec.done[2].logprobs.size() == spec.done[2].tokens.size());
    CHECK(spec.done[4].finish_reason == "stop");
    MESSAGE("drafted " << spec.decode.drafted_tokens << ", accepted " << spec.decode.accepted_tokens
                       << "; steps of the requests sent one at a time " << plain.sequential_steps << " without, "
                       << spec.sequential_steps << " with");
    // The drafts ran, some were kept, and so the same tokens took fewer steps (counted where one
    // request runs at a time: how the three at once share steps depends on timing).
    CHECK(spec.decode.drafted_tokens > 0);
    CHECK(spec.decode.accepted_tokens > 0);
    CHECK(spec.decode.accepted_tokens <= spec.decode.drafted_tokens);
    CHECK(spec.sequential_steps < plain.sequential_steps);
  }
}

TEST_CASE("speculative decoding runs drafts only in steps of at most speculative_max_batch sequences: a compute-bound "
          "step pays for every draft row") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.decode.speculative_tokens = 4;
  cfg.decode.speculative_max_batch = 1;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  generate_request loop;
  loop.prompt = "one two three, one two three, one two three, one two three, one two";
  loop.max_tokens = 300;  // long enough that the three share steps even when their prefills queue (a loaded machine)
  loop.ignore_eos = true;
  std::vector<std::future<caf::expected<completion>>> together;
  for (int i = 0; i < 3; ++i) together.push_back(std::async(std::launch::async, [&] { return t.generate(cluster.router, loop); }));
  std::vector<completion> done;
  for (auto& f : together) {
    auto got = f.get();
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    done.push_back(std::move(*got));
  }
  CHECK(done[0].tokens == done[1].tokens);
  CHECK(done[1].tokens == done[2].tokens);
  size_t alone = 0, shared = 0;
  for (const auto& e : t.events(cluster.decode[0].handle)) {
    if (e.kind != "step") continue;
    if (e.batch_requests.size() > 1) {
      CHECK(e.chunk == 0);  // no draft rows with company
      ++shared;
    } else if (e.chunk > 0) {
      ++alone;
    }
  }
  CHECK(shared > 0);
  MESSAGE(alone << " steps alone with drafts, " << shared << " shared without");
}

TEST_CASE("speculative decoding's settings are checked: at most 16 drafts, 1 <= prompt_lookup_min <= max <= 64") {
  decode_rank_config cfg;
  cfg.speculative_tokens = 17;
  CHECK(cfg.validate() == "decode speculative_tokens must be at most 16, got 17");
  cfg.speculative_tokens = 4;
  cfg.prompt_lookup_min = 5;
  CHECK(cfg.validate() == "decode prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 64, got 5 and 4");
  cfg.prompt_lookup_min = 0;
  CHECK_FALSE(cfg.validate().empty());
  cfg.prompt_lookup_min = 2;
  CHECK(cfg.validate().empty());
}
