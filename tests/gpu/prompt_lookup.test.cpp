// Speculative decoding's drafts by prompt lookup (gpu/prompt_lookup.hpp), and the CPU executor's
// picks after every row that check them: each the pick a step of its own would make.

#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "gpu/prompt_lookup.hpp"
#include "gpu/weights.hpp"

using namespace baton;
using gpu::propose_by_lookup;

TEST_CASE("prompt lookup drafts what followed the longest, then latest, earlier occurrence of the history's last "
          "tokens; a loop is drafted whole; nothing without a match") {
  using v = std::vector<int32_t>;
  // "1 2 3 4 5 ... 1 2 3": the 3-gram 1 2 3 occurred, followed by 4 5 6.
  CHECK(propose_by_lookup(v{1, 2, 3, 4, 5, 6, 9, 1, 2, 3}, 2, 4, 3) == v{4, 5, 6});
  CHECK(propose_by_lookup(v{1, 2, 3, 4, 5, 6, 9, 1, 2, 3}, 2, 4, 2) == v{4, 5});  // at most max_draft
  // The longest match wins over a later shorter one: "2 3" occurs latest before 8, but "1 2 3" before 4.
  CHECK(propose_by_lookup(v{1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3}, 2, 4, 1) == v{4});
  // Among equals, the latest: "2 3" is followed by 4, then later by 8.
  CHECK(propose_by_lookup(v{2, 3, 4, 0, 2, 3, 8, 7, 2, 3}, 2, 4, 1) == v{8});
  // Too short a match: 3 alone occurred (min 2 asks for two tokens).
  CHECK(propose_by_lookup(v{5, 3, 4, 6, 3}, 2, 4, 3).empty());
  CHECK(propose_by_lookup(v{5, 3, 4, 6, 3}, 1, 4, 3) == v{4, 6, 3});
  // A loop: the match runs into the tail, and the draft goes on around it.
  CHECK(propose_by_lookup(v{9, 7, 7, 7}, 2, 4, 5) == v{7, 7, 7, 7, 7});
  CHECK(propose_by_lookup(v{1, 2, 1, 2, 1, 2}, 2, 4, 5) == v{1, 2, 1, 2, 1});
  // Nothing to find.
  CHECK(propose_by_lookup(v{}, 1, 4, 3).empty());
  CHECK(propose_by_lookup(v{4}, 1, 4, 3).empty());
  CHECK(propose_by_lookup(v{1, 2, 3, 4}, 1, 4, 3).empty());
  CHECK(propose_by_lookup(v{1, 2, 1, 2}, 2, 4, 0).empty());
  CHECK(propose_by_lookup(v{1, 2, 1, 2}, 3, 2, 4).empty());  // min above max
}

TEST_CASE("the CPU executor's picks after every row of a drafted sequence are the picks of one step per token: greedy, "
          "drawn with penalties, with log-probabilities; a wrong draft's rows pick what follows the draft") {
  gpu::model_config cfg;  // the built-in model
  gpu::cpu_executor_config ec;
  ec.num_threads = 1;
  ec.num_kv_pages = 64;
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg, 7));
  auto exec = gpu::make_cpu_executor(cfg, weights, ec);
  REQUIRE(exec->picks_every_row());
  auto& kv = exec->kv();
  const std::vector<int32_t> prompt = {1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};

  for (const float temperature : {0.0f, 0.8f}) {
    CAPTURE(temperature);
    gpu::sampling_config sc;
    sc.temperature = temperature;
    sc.seed = 5;
    if (temperature > 0) {
      sc.repetition_penalty = 1.2f;
      sc.frequency_penalty = 0.3f;
      sc.output_from = static_cast<uint32_t>(prompt.size());
    }
    // Reference: the prompt, then one step per token, each pick fed back.
    auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(64));
    std::vector<int32_t> seq = prompt, picks;
    const auto pick_at = [&](uint32_t position, const std::vector<int32_t>& history) {
      gpu::seq_sampling s{sc, position, {}, true, 3};
      if (sc.penalised()) s.history = history;
      return s;
    };
    std::vector<gpu::token_logprobs> lps;
    {
      gpu::forward_seq first{1, prompt, 0, pages, false};
      first.sample = pick_at(static_cast<uint32_t>(prompt.size()), seq);
      auto out = gpu::run_blocking(*exec, gpu::forward_job{1, {first}});
      REQUIRE(out.error.empty());
      picks.push_back(out.tokens[0]);
    }
    for (int k = 0; k < 5; ++k) {
      const auto pos = static_cast<uint32_t>(seq.size());
      seq.push_back(picks.back());
      gpu::forward_seq step{1, {picks.back()}, pos, pages, false};
      step.sample = pick_at(pos + 1, seq);
      auto out = gpu::run_blocking(*exec, gpu::forward_job{2, {step}, gpu::forward_job::decode});
      REQUIRE(out.error.empty());
      picks.push_back(out.tokens[0]);
      lps.push_back(out.logprobs.at(0));
    }
    // One step: the first pick as input, the next three reference picks as drafts (all right), so
    // the rows pick picks[1..3] and the last row picks[4].
    const auto pos = static_cast<uint32_t>(prompt.size());
    gpu::forward_seq drafted{1, {picks[0], picks[1], picks[2], picks[3]}, pos, pages, false};
    // Row picks carry no history: each reads the last pick's, cut after its own row.
    for (size_t r = 0; r < 3; ++r) drafted.row_samples.push_back(pick_at(pos + static_cast<uint32_t>(r) + 1, {}));
    std::vector<int32_t> history = prompt;
    history.insert(history.end(), drafted.tokens.begin(), drafted.tokens.end());
    drafted.sample = pick_at(pos + 4, history);
    auto out = gpu::run_blocking(*exec, gpu::forward_job{3, {drafted}, gpu::forward_job::decode});
    REQUIRE(out.error.empty());
    REQUIRE(out.row_tokens.size() == 1);
    CHECK(out.row_tokens[0] == std::vector<int32_t>{picks[1], picks[2], picks[3]});
    CHECK(out.tokens[0] == picks[4]);
    REQUIRE(out.row_logprobs[0].size() == 3);
    for (size_t r = 0; r < 3; ++r) {
      CHECK(out.row_logprobs[0][r].logprob == lps[r].logprob);
      CHECK(out.row_logprobs[0][r].top_tokens == lps[r].top_tokens);
    }
    CHECK(out.logprobs.at(0).logprob == lps[3].logprob);
    // A wrong first draft: row 0 still picks picks[1] (it reads only the input), and the rows
    // after it read the wrong token -- the rank drops them.
    const int32_t wrong = picks[1] == 3 ? 4 : 3;
    drafted.tokens = {picks[0], wrong};
    drafted.row_samples.resize(1);
    drafted.sample = pick_at(pos + 2, {});
    drafted.sample->history = prompt;
    drafted.sample->history.insert(drafted.sample->history.end(), {picks[0], wrong});
    out = gpu::run_blocking(*exec, gpu::forward_job{4, {drafted}, gpu::forward_job::decode});
    REQUIRE(out.error.empty());
    CHECK(out.row_tokens[0] == std::vector<int32_t>{picks[1]});
    kv.kv_page_free(pages);
  }
  // A sequence with row picks of the wrong count is refused, naming it.
  auto pages = *kv.kv_page_alloc(1);
  gpu::forward_seq bad{42, {1, 2, 3}, 0, pages, false};
  bad.sample = gpu::seq_sampling{};
  bad.row_samples.resize(1);
  auto out = gpu::run_blocking(*exec, gpu::forward_job{5, {bad}});
  CHECK(out.error.find("sequence 42: 1 row picks for 3 rows") != std::string::npos);
  bad.tokens = {1, 2};
  bad.row_samples[0].history = {1};
  out = gpu::run_blocking(*exec, gpu::forward_job{6, {bad}});
  CHECK(out.error.find("sequence 42: a row pick with its own grammar or history") != std::string::npos);
  kv.kv_page_free(pages);
}
