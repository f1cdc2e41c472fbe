// Sampling through a cluster (prefill rank -> KV handoff -> decode rank): the knobs a request
// turns pick the same tokens as one executor does alone, and what a request asks to know about
// its tokens (log-probabilities) is what that executor's logits say.

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <regex>
#include <algorithm>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <caf/typed_event_based_actor.hpp>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "gpu/json_schema_grammar.hpp"
#include "transport/fault_proxy.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;
using test::chunk_tokens;
using test::encode;
using test::small_cluster;

namespace {

/// What one executor alone says of each prompt token given those before it: entry i is token
/// i's log-probability and its `top` alternatives (entry 0 is left empty).
std::vector<gpu::token_logprobs> prefix_logprobs(const local_cluster_config& cfg, const std::vector<int32_t>& prompt,
                                                 uint32_t top) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  auto& kv = exec->kv();
  std::vector<gpu::token_logprobs> out(prompt.size());
  for (size_t i = 1; i < prompt.size(); ++i) {
    auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(static_cast<uint32_t>(i)));
    auto ref = gpu::run_blocking(*exec, gpu::forward_job{i, {gpu::forward_seq{1, {prompt.begin(), prompt.begin() + i}, 0, pages, true}}});
    kv.kv_page_free(pages);
    REQUIRE(ref.error.empty());
    out[i] = gpu::logprobs_of(ref.logits[0], prompt[i], top);
  }
  return out;
}

}  // namespace

TEST_CASE("top-k, top-p and penalties sample the same tokens disaggregated as colocated; stop tokens and strings "
          "end generation early") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const std::string prompt = "sampling with every knob turned";
  generate_request req;
  req.prompt = prompt;
  req.max_tokens = 16;
  req.temperature = 0.9f;
  req.seed = 11;
  req.top_k = 20;
  req.top_p = 0.9f;
  req.repetition_penalty = 1.3f;
  req.presence_penalty = 0.4f;
  req.frequency_penalty = 0.3f;
  req.ignore_eos = true;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  const gpu::sampling_config sc{0.9f, 11, 20, 0.9f, 1.3f, 0.4f, 0.3f};
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  auto ref = gpu::generate_colocated(*exec, encode(cfg, prompt), 16, chunk_tokens, sc, true);
  CHECK(got->tokens == ref.tokens);
  // The penalties matter: without them the same seed samples something else.
  auto plain = gpu::generate_colocated(*exec, encode(cfg, prompt), 16, chunk_tokens, {0.9f, 11, 20, 0.9f}, true);
  CHECK(plain.tokens != ref.tokens);

  // Stop token: the greedy run's 4th token stops generation right there.
  generate_request greedy;
  greedy.prompt = prompt;
  greedy.max_tokens = 12;
  greedy.ignore_eos = true;
  auto full = t.generate(cluster.router, greedy);
  REQUIRE(full);
  REQUIRE(full->tokens.size() == 12);
  auto stopped = greedy;
  stopped.stop_token_ids = {full->tokens[3]};
  auto s1 = t.generate(cluster.router, stopped);
  REQUIRE(s1);
  CHECK(s1->finish_reason == "stop");
  // What stopped it, for vLLM's stop_reason: the token; a run to its length names nothing.
  CHECK(s1->stop_token == full->tokens[3]);
  CHECK(s1->stop_string.empty());
  CHECK(full->stop_token == -1);
  CHECK(full->stop_string.empty());
  const auto first_hit = std::find(full->tokens.begin(), full->tokens.end(), full->tokens[3]) - full->tokens.begin();
  CHECK(s1->tokens.size() == static_cast<size_t>(first_hit) + 1);
  // Stop string: the text ends before it.
  auto by_text = greedy;
  const std::string needle = full->text.substr(5, 2);
  by_text.stop = {"\x01never in the text", needle};
  auto s2 = t.generate(cluster.router, by_text);
  REQUIRE(s2);
  CHECK(s2->finish_reason == "stop");
  CHECK(s2->stop_string == needle);  // the one that matched, not the first listed
  CHECK(s2->stop_token == -1);
  CHECK(s2->text == full->text.substr(0, full->text.find(needle)));
  // include_stop_str_in_output keeps the stop string; and a stop token's text, which is cut off
  // without it (the text of the tokens before it, as a run that ends there gives).
  by_text.include_stop_str_in_output = true;
  auto s3 = t.generate(cluster.router, by_text);
  REQUIRE(s3);
  CHECK(s3->finish_reason == "stop");
  CHECK(s3->text == full->text.substr(0, full->text.find(needle) + needle.size()));
  auto upto = [&](size_t n) {
    if (n == 0) return std::string{};
    auto shorter = greedy;
    shorter.max_tokens = static_cast<uint32_t>(n);
    auto r = t.generate(cluster.router, shorter);
    REQUIRE(r);
    return r->text;
  };
  CHECK(s1->text == upto(static_cast<size_t>(first_hit)));
  stopped.include_stop_str_in_output = true;
  auto s4 = t.generate(cluster.router, stopped);
  REQUIRE(s4);
  CHECK(s4->tokens == s1->tokens);
  CHECK(s4->text == upto(static_cast<size_t>(first_hit) + 1));
  CHECK(s4->text != s1->text);
  // Every lease comes back (a stopped request's release reaches the decode rank asynchronously).
  for (int i = 0; i < 1000 && t.stats(cluster.decode[0].handle).num_free_pages != cfg.executor.num_kv_pages; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("min_tokens holds the stop tokens back through prefill and decode, and stop strings until it is reached; "
          "min_p draws the colocated run's tokens; out-of-range values are refused by name") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  generate_request greedy;
  greedy.prompt = "the shortest answer is not allowed";
  greedy.max_tokens = 12;
  greedy.ignore_eos = true;
  auto full = t.generate(cluster.router, greedy);
  REQUIRE_MESSAGE(full, t.sys.render(full.error()));
  REQUIRE(full->tokens.size() == 12);
  // The prefill rank's pick (token 0) is a stop token: alone it ends the answer at once; with
  // min_tokens 5 it is never picked before the fifth token, on the prefill rank or the decode rank.
  auto held = greedy;
  held.stop_token_ids = {full->tokens[0]};
  auto at_once = t.generate(cluster.router, held);
  REQUIRE(at_once);
  CHECK(at_once->tokens.size() == 1);
  held.min_tokens = 5;
  auto later = t.generate(cluster.router, held);
  REQUIRE_MESSAGE(later, t.sys.render(later.error()));
  REQUIRE(later->tokens.size() >= 5);
  for (size_t i = 0; i < 5; ++i) CHECK(later->tokens[i] != full->tokens[0]);
  // Every token the greedy answer holds is a stop token, held back for all 12: the decode
  // rank's steps pick none of them either, and the answer runs to its length.
  held.stop_token_ids = full->tokens;
  std::sort(held.stop_token_ids.begin(), held.stop_token_ids.end());
  held.stop_token_ids.erase(std::unique(held.stop_token_ids.begin(), held.stop_token_ids.end()), held.stop_token_ids.end());
  held.min_tokens = 12;
  auto whole = t.generate(cluster.router, held);
  REQUIRE_MESSAGE(whole, t.sys.render(whole.error()));
  CHECK(whole->finish_reason == "length");
  REQUIRE(whole->tokens.size() == 12);
  for (auto tok : whole->tokens)
    CHECK(std::find(held.stop_token_ids.begin(), held.stop_token_ids.end(), tok) == held.stop_token_ids.end());
  // A stop string inside the first tokens: it ends nothing before min_tokens, and the tokens are
  // the greedy run's (nothing is banned: no stop token, and <eos> is ignored).
  auto by_text = greedy;
  // With a longer stop string beside it (a wider search window), the short one that the first
  // tokens hold is still not found once min_tokens is reached: only text after them counts.
  by_text.stop = {full->text.substr(1, 2), "a stop string this text never holds"};
  by_text.min_tokens = 10;
  auto s2 = t.generate(cluster.router, by_text);
  REQUIRE(s2);
  REQUIRE(s2->tokens.size() >= 10);
  CHECK(std::equal(s2->tokens.begin(), s2->tokens.end(), full->tokens.begin()));
  CHECK(s2->text.size() >= 10);
  CHECK(full->text.rfind(s2->text.substr(0, 10), 0) == 0);
  // min_p: the tokens a colocated run draws with the same cut, which are not those without it.
  generate_request drawn;
  drawn.prompt = greedy.prompt;
  drawn.max_tokens = 16;
  drawn.ignore_eos = true;
  drawn.temperature = 1.5f;
  drawn.seed = 3;
  drawn.min_p = 0.2f;
  auto got = t.generate(cluster.router, drawn);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  gpu::sampling_config cut{1.5f, 3};
  cut.min_p = 0.2f;
  auto ref = gpu::generate_colocated(*exec, encode(cfg, greedy.prompt), 16, chunk_tokens, cut, true);
  CHECK(got->tokens == ref.tokens);
  auto uncut = gpu::generate_colocated(*exec, encode(cfg, greedy.prompt), 16, chunk_tokens, {1.5f, 3}, true);
  CHECK(uncut.tokens != ref.tokens);
  // Refused: min_tokens past max_tokens, min_p outside [0, 1].
  auto too_many = greedy;
  too_many.min_tokens = 13;
  auto r1 = t.generate(cluster.router, too_many);
  REQUIRE_FALSE(r1);
  CHECK(t.sys.render(r1.error()).find("min_tokens 13 exceeds max_tokens 12") != std::string::npos);
  auto bad_p = greedy;
  bad_p.min_p = 1.5f;
  auto r2 = t.generate(cluster.router, bad_p);
  REQUIRE_FALSE(r2);
  CHECK(t.sys.render(r2.error()).find("min_p must be in [0, 1]") != std::string::npos);
  auto constrained = greedy;
  constrained.output_format = 1;
  constrained.min_tokens = 4;
  auto r3 = t.generate(cluster.router, constrained);
  REQUIRE_FALSE(r3);
  CHECK(t.sys.render(r3.error()).find("min_tokens cannot hold back the end of a constrained answer") != std::string::npos);
}

TEST_CASE("logit_bias: banned tokens never come out, greedy or drawn, and the tokens equal the colocated run's "
          "with the same bias; a token outside the vocabulary, a repeat or a bias out of range is refused by name") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const std::string prompt = "a bias on the logits";
  generate_request plain;
  plain.prompt = prompt;
  plain.max_tokens = 12;
  plain.ignore_eos = true;
  auto full = t.generate(cluster.router, plain);
  REQUIRE_MESSAGE(full, t.sys.render(full.error()));
  // Ban what the greedy run picked first and later (the prefill's token and a decode step's).
  const auto later = std::find_if(full->tokens.begin() + 1, full->tokens.end(), [&](int32_t x) { return x != full->tokens[0]; });
  REQUIRE(later != full->tokens.end());
  const std::vector<int32_t> banned = {full->tokens[0], *later};
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  for (const float temperature : {0.0f, 0.8f}) {
    CAPTURE(temperature);
    auto req = plain;
    req.temperature = temperature;
    req.seed = 3;
    req.logit_bias_tokens = banned;
    req.logit_bias_values = {-100.0f, -100.0f};
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    for (int32_t b : banned) CHECK(std::count(got->tokens.begin(), got->tokens.end(), b) == 0);
    gpu::sampling_config sc{temperature, 3};
    sc.bias_tokens = banned;
    sc.bias_values = {-100.0f, -100.0f};
    CHECK(got->tokens == gpu::generate_colocated(*exec, encode(cfg, prompt), 12, chunk_tokens, sc, true).tokens);
  }
  auto refused = [&](std::vector<int32_t> tokens, std::vector<float> values) {
    auto req = plain;
    req.logit_bias_tokens = std::move(tokens);
    req.logit_bias_values = std::move(values);
    auto r = t.generate(cluster.router, req);
    REQUIRE_FALSE(r);
    return t.sys.render(r.error());
  };
  const auto vocab = std::to_string(cfg.model.vocab_size);
  CHECK(refused({static_cast<int32_t>(cfg.model.vocab_size)}, {1.0f}).find("logit_bias token " + vocab +
                                                                           " is outside the vocabulary [0, " + vocab + ")") !=
        std::string::npos);
  CHECK(refused({5, 5}, {1.0f, 2.0f}).find("logit_bias names token 5 twice") != std::string::npos);
  CHECK(refused({5}, {-101.0f}).find("logit_bias of token 5 must be a number in [-100, 100]") != std::string::npos);
  CHECK(refused({5}, {}).find("logit_bias has 1 tokens but 0 values") != std::string::npos);
}

namespace {

/// The tokens one executor picks for `prompt` under the constraint (kind, text), the reference the
/// cluster's constrained answers must equal.
std::vector<int32_t> constrained_colocated(const local_cluster_config& cfg, gpu::output_format kind,
                                           const std::string& text, const std::string& prompt, int32_t max_tokens,
                                           const gpu::sampling_config& sampling) {
  std::string why;
  auto grammar = gpu::compile_output_grammar(kind, text, {}, &why);
  REQUIRE_MESSAGE(grammar, why);
  auto matcher = std::make_shared<gpu::grammar_matcher>(grammar, gpu::byte_vocabulary(cfg.model.vocab_size),
                                                        std::vector<int32_t>{cfg.model.eos_token_id});
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  return gpu::generate_colocated(*exec, encode(cfg, prompt), max_tokens, chunk_tokens, sampling, false, {}, matcher)
      .tokens;
}

}  // namespace

TEST_CASE("structured outputs: a JSON schema's answer parses and holds to it, greedy or drawn, disaggregated or "
          "hybrid, with the colocated run's tokens under the same grammar; what the grammar cannot honour is refused") {
  test::cluster_system t;
  // A finite language: every answer ends (an end token is all the grammar allows at its end).
  const std::string schema = R"({"type":"object","properties":{"color":{"enum":["red","green","blue"]},
      "ok":{"type":"boolean"},"n":{"type":"integer","minimum":-3,"maximum":12},
      "code":{"type":"string","pattern":"^[A-Z]{2}-[0-9]{2}$"}},"required":["color","ok","code"],
      "additionalProperties":false})";
  const std::string prompt = "Answer in JSON:";
  constexpr int32_t max_tokens = 600;  // more than the longest sentence, whitespace and all
  for (const bool hybrid : {false, true})
    for (const float temperature : {0.0f, 1.0f}) {
      CAPTURE(hybrid);
      CAPTURE(temperature);
      auto cfg = small_cluster(hybrid);
      auto cluster = start_local_cluster(t.sys, cfg);
      test::cluster_system::stopper stop{t, cluster};
      generate_request req;
      req.prompt = prompt;
      req.max_tokens = max_tokens;
      req.temperature = temperature;
      req.seed = 11;
      req.output_format = static_cast<uint8_t>(gpu::output_format::schema);
      req.output_spec = schema;
      auto got = t.generate(cluster.router, req);
      REQUIRE_MESSAGE(got, t.sys.render(got.error()));
      CAPTURE(got->text);
      CHECK(got->finish_reason == "eos");
      // The built-in model's weights are random: without the grammar this is never JSON.
      const auto j = nlohmann::json::parse(got->text, nullptr, false);
      REQUIRE(j.is_object());
      CHECK((j["color"] == "red" || j["color"] == "green" || j["color"] == "blue"));
      CHECK(j["ok"].is_boolean());
      CHECK(std::regex_match(j["code"].get<std::string>(), std::regex("[A-Z]{2}-[0-9]{2}")));
      if (j.contains("n")) CHECK((j["n"].is_number_integer() && j["n"] >= -3 && j["n"] <= 12));
      CHECK(j.size() == (j.contains("n") ? 4u : 3u));
      CHECK(got->tokens == constrained_colocated(cfg, gpu::output_format::schema, schema, prompt, max_tokens,
                                                 gpu::sampling_config{temperature, 11}));
      if (hybrid || temperature > 0.0f) continue;
      // Any JSON object: it opens as one (its language has no end, so it may run to max_tokens).
      req.output_format = static_cast<uint8_t>(gpu::output_format::object);
      req.output_spec.clear();
      req.max_tokens = 40;
      auto object = t.generate(cluster.router, req);
      REQUIRE_MESSAGE(object, t.sys.render(object.error()));
      REQUIRE_FALSE(object->text.empty());
      CHECK(object->text[0] == '{');
      if (object->finish_reason == "eos") CHECK(nlohmann::json::parse(object->text, nullptr, false).is_object());
      auto refused = [&](uint8_t kind, const std::string& s, bool compact = false) {
        auto bad = req;
        bad.output_format = kind;
        bad.output_spec = s;
        bad.json_compact = compact;
        auto r = t.generate(cluster.router, bad);
        REQUIRE_FALSE(r);
        return t.sys.render(r.error());
      };
      CHECK(refused(2, R"({"type":"integer","multipleOf":2})").find("json_schema at /: the keyword 'multipleOf' is "
                                                                   "not supported") != std::string::npos);
      CHECK(refused(2, R"({"type":"object","properties":{"a":{"$ref":"#/nowhere"}}})")
                .find("json_schema at /properties/a/$ref: $ref '#/nowhere' names nothing") != std::string::npos);
      CHECK(refused(1, schema).find("output_spec is given, but output_format is 1 (any JSON object), which reads "
                                    "none") != std::string::npos);
      CHECK(refused(2, "").find("output_format 2 needs output_spec: the JSON schema's text") != std::string::npos);
      CHECK(refused(4, "").find("output_format 4 needs output_spec: the GBNF grammar's text") != std::string::npos);
      CHECK(refused(5, "").find("output_format must be 0 (free text), 1 (a JSON object), 2") != std::string::npos);
      CHECK(refused(3, "a+", true).find("json_compact asks for JSON without whitespace, but the answer is text "
                                        "matching a regular expression") != std::string::npos);
      CHECK(refused(0, "", true).find("json_compact asks for JSON without whitespace, but the answer is free "
                                      "text") != std::string::npos);
      CHECK_MESSAGE(t.generate(cluster.router, [&] {
        auto compact = req;
        compact.json_compact = true;
        return compact;
      }()), "compact JSON of any object is taken");
    }
}

TEST_CASE("structured outputs: a regular expression's answer (vLLM's guided_regex) matches it whole, greedy or drawn, "
          "disaggregated or hybrid, with the colocated run's tokens under the same grammar, and a GBNF grammar of the "
          "same language gives the same answer") {
  test::cluster_system t;
  const std::string pattern = "(?:yes|no), [a-z]{2,5}-[0-9]{1,3}\\.";
  constexpr int32_t max_tokens = 64;
  for (const bool hybrid : {false, true})
    for (const float temperature : {0.0f, 1.0f}) {
      CAPTURE(hybrid);
      CAPTURE(temperature);
      auto cfg = small_cluster(hybrid);
      auto cluster = start_local_cluster(t.sys, cfg);
      test::cluster_system::stopper stop{t, cluster};
      generate_request req;
      req.prompt = "Say yes or no:";
      req.max_tokens = max_tokens;
      req.temperature = temperature;
      req.seed = 3;
      req.output_format = static_cast<uint8_t>(gpu::output_format::regex);
      req.output_spec = pattern;
      auto got = t.generate(cluster.router, req);
      REQUIRE_MESSAGE(got, t.sys.render(got.error()));
      CAPTURE(got->text);
      CHECK(got->finish_reason == "eos");  // the expression's language is finite
      CHECK(std::regex_match(got->text, std::regex(pattern)));
      CHECK(got->tokens == constrained_colocated(cfg, gpu::output_format::regex, pattern, req.prompt, max_tokens,
                                                 gpu::sampling_config{temperature, 3}));
      // The same language as a GBNF grammar: the same tokens allowed at every step, so the same
      // answer.
      auto as_gbnf = req;
      as_gbnf.output_format = static_cast<uint8_t>(gpu::output_format::gbnf);
      as_gbnf.output_spec = "root ::= (\"yes\" | \"no\") \", \" letter{2,5} \"-\" [0-9]{1,3} \".\"\nletter ::= [a-z]";
      auto by_gbnf = t.generate(cluster.router, as_gbnf);
      REQUIRE_MESSAGE(by_gbnf, t.sys.render(by_gbnf.error()));
      CHECK(by_gbnf->tokens == got->tokens);
      if (hybrid || temperature > 0.0f) continue;
      req.output_spec = "a(?<=b)";
      auto bad = t.generate(cluster.router, req);
      REQUIRE_FALSE(bad);
      CHECK(t.sys.render(bad.error()).find("regex: lookarounds are not supported") != std::string::npos);
    }
}

TEST_CASE("logprobs: each token's log-probability and its step's top tokens are the log-softmax of the logits that "
          "chose it, from the prefill rank's first token to the decode rank's last; asking changes no token") {
  test::cluster_system t;
  for (const bool hybrid : {false, true})
  for (const float temperature : {0.0f, 0.8f}) {
    CAPTURE(hybrid);
    CAPTURE(temperature);
    auto cfg = small_cluster(hybrid);
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    generate_request req;
    req.prompt = "log-probabilities, please";
    req.max_tokens = 6;
    req.temperature = temperature;
    req.seed = 5;
    req.ignore_eos = true;
    auto plain = t.generate(cluster.router, req);
    REQUIRE(plain);
    req.logprobs = true;
    req.top_logprobs = 3;
    req.return_logits = true;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    CHECK(got->tokens == plain->tokens);  // on the CUDA backend, asking moves the pick to the host
    REQUIRE(got->logprobs.size() == got->tokens.size());
    REQUIRE(got->step_logits.size() == got->tokens.size());
    for (size_t i = 0; i < got->tokens.size(); ++i) {
      CAPTURE(i);
      const auto& row = got->step_logits[i];
      const auto& lp = got->logprobs[i];
      double z = 0.0, max = row[0];
      for (float x : row) max = std::max<double>(max, x);
      for (float x : row) z += std::exp(x - max);
      const auto lsm = [&](int32_t id) { return row[id] - max - std::log(z); };
      CHECK(lp.token == got->tokens[i]);
      CHECK(lp.logprob == doctest::Approx(lsm(lp.token)).epsilon(1e-5));
      CHECK(lp.text == gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.decode({lp.token}));
      REQUIRE(lp.top_tokens.size() == 3);
      REQUIRE(lp.top_texts.size() == 3);
      std::vector<int32_t> order(row.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int32_t>(k);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      for (size_t k = 0; k < 3; ++k) {
        CHECK(lp.top_tokens[k] == order[k]);
        CHECK(lp.top_logprobs[k] == doctest::Approx(lsm(order[k])).epsilon(1e-5));
      }
      if (temperature == 0.0f) CHECK(lp.top_tokens[0] == lp.token);  // greedy: the pick is the most likely
    }
    if (hybrid) CHECK(got->kv_bytes == 0);  // it was prefilled where it decoded
  }
  // Too many alternatives, or alternatives without logprobs, are refused by name.
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  generate_request bad;
  bad.prompt_tokens = {1, 2};  // (a one-character literal here trips GCC 12's -Wrestrict false positive)
  bad.logprobs = true;
  bad.top_logprobs = 21;
  auto refused = t.generate(cluster.router, bad);
  REQUIRE_FALSE(refused);
  CHECK(t.sys.render(refused.error()).find("top_logprobs must be at most 20, got 21") != std::string::npos);
  bad.logprobs = false;
  bad.top_logprobs = 2;
  refused = t.generate(cluster.router, bad);
  REQUIRE_FALSE(refused);
  CHECK(t.sys.render(refused.error()).find("top_logprobs needs logprobs") != std::string::npos);
}

TEST_CASE("prompt scoring (echo with logprobs): each prompt token's log-probability is what one executor's logits of "
          "its prefix say, the prompt computed whole where the cluster would reuse its cached prefix, split it, or "
          "prefill it on the decode rank; the tokens generated are the same") {
  test::cluster_system t;
  char dir_template[] = "/tmp/baton-score-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  struct cleanup {
    std::string dir;
    ~cleanup() { std::filesystem::remove_all(dir); }
  } clean{dir_template};
  std::string text;
  for (int i = 0; i < 90; ++i) text.push_back(static_cast<char>('a' + (i * 7) % 26));
  for (const bool hybrid : {false, true}) {
    CAPTURE(hybrid);
    auto cfg = small_cluster(hybrid);
    cfg.num_prefill_ranks = 2;
    cfg.executor.num_kv_pages = 128;
    cfg.prefill.chunk_tokens = 64;
    cfg.prefill.score_chunk_tokens = 16;  // a scored prompt runs in several chunks
    cfg.prefill_balancer.policy = "split";
    cfg.prefill_balancer.split_min_tokens = 32;
    cfg.store.enabled = true;
    cfg.store.dir = std::string(dir_template) + (hybrid ? "/h" : "/s");
    cfg.store.block_tokens = 32;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    REQUIRE(t.wait_registered(cluster));  // a split needs both prefill ranks known to the balancer
    generate_request req;
    req.prompt = text;
    req.max_tokens = 4;
    req.ignore_eos = true;
    auto plain = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(plain, t.sys.render(plain.error()));
    if (!hybrid) {
      CHECK(plain->prefill_placement_why.rfind("split:", 0) == 0);
      CHECK_MESSAGE(plain->prefill_placement_why.find("not split") == std::string::npos,  // it was split
                    plain->prefill_placement_why);
      // Its blocks reach the store when its decode ends (written back behind the answer): ask
      // again until a request finds them, so the scored one below had a prefix to reuse.
      uint32_t cached = 0;
      for (int tries = 0; tries < 100 && cached == 0; ++tries) {
        auto again = t.generate(cluster.router, req);
        REQUIRE(again);
        cached = again->cached_tokens;
        if (cached == 0) std::this_thread::sleep_for(std::chrono::milliseconds{50});
      }
      CHECK(cached > 0);
    }
    req.echo = true;
    req.prompt_logprobs = true;
    req.top_logprobs = 2;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    CHECK(got->tokens == plain->tokens);
    CHECK(got->cached_tokens == 0);
    CHECK(got->prefill_rank.rfind("prefill-", 0) == 0);  // never the decode rank
    CHECK(got->kv_bytes > 0);
    if (!hybrid) CHECK(got->prefill_placement_why.find("computed whole") != std::string::npos);
    const auto prompt = encode(cfg, text);
    CHECK(got->prompt_text == gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.decode(prompt));
    REQUIRE(got->prompt_logprobs.size() == prompt.size());
    CHECK(std::isnan(got->prompt_logprobs[0].logprob));
    CHECK(got->prompt_logprobs[0].top_tokens.empty());
    CHECK(got->logprobs.empty());  // not asked for the generated tokens
    const auto ref = prefix_logprobs(cfg, prompt, 2);
    for (size_t i = 1; i < prompt.size(); ++i) {
      CAPTURE(i);
      const auto& want = ref[i];
      const auto& lp = got->prompt_logprobs[i];
      CHECK(lp.token == prompt[i]);
      CHECK(lp.logprob == doctest::Approx(want.logprob).epsilon(1e-5));
      CHECK(lp.top_tokens == want.top_tokens);
      REQUIRE(lp.top_texts.size() == 2);
      CHECK(lp.top_texts[0] == gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.decode({lp.top_tokens[0]}));
    }
  }
}

TEST_CASE("prompt scoring survives a failed KV send: the request is placed again and its scores are the new "
          "attempt's, whole") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.retry_backoff_ms = 1;
  // The first put of layer 1 fails (retryable): the first attempt's prompt is scored, then lost.
  const transport::fault_plan plan{transport::fault_kind::fail, 1u, {}, 1};
  auto cluster = start_local_cluster(t.sys, cfg, {},
                                     test::fault_proxy_on("prefill-0", plan));
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = "scored after a failover";
  req.max_tokens = 2;
  req.prompt_logprobs = true;
  req.ignore_eos = true;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->failovers == 1);
  const auto prompt = encode(cfg, req.prompt);
  REQUIRE(got->prompt_logprobs.size() == prompt.size());
  const auto ref = prefix_logprobs(cfg, prompt, 0);
  for (size_t i = 1; i < prompt.size(); ++i) {
    CAPTURE(i);
    CHECK(got->prompt_logprobs[i].logprob == doctest::Approx(ref[i].logprob).epsilon(1e-5));
  }
}

/// Events of `kind` that a rank logged for request `rid`.
size_t count_events(const std::vector<rank_event>& events, const char* kind, uint64_t rid) {
  return static_cast<size_t>(std::count_if(events.begin(), events.end(),
                                           [&](const rank_event& e) { return e.kind == kind && e.request_id == rid; }));
}

TEST_CASE("a request for one token runs on a prefill rank alone: no decode lease, no KV shipped; its token, "
          "log-probabilities and prompt scores are those of the path through a decode rank") {
  test::cluster_system t;
  std::string text;
  for (int i = 0; i < 70; ++i) text.push_back(static_cast<char>('a' + (i * 5) % 26));  // five chunks
  std::vector<completion> got;
  for (const bool alone : {true, false}) {
    CAPTURE(alone);
    auto cfg = small_cluster();
    cfg.router.request.single_token_prefill_only = alone;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    generate_request req;
    req.prompt = text;
    req.max_tokens = 1;
    req.ignore_eos = true;
    req.logprobs = true;
    req.top_logprobs = 2;
    req.echo = true;
    req.prompt_logprobs = true;
    auto c = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(c, t.sys.render(c.error()));
    CHECK(c->finish_reason == "length");
    CHECK(c->prefill_rank == "prefill-0");
    CHECK(c->decode_rank.empty() == alone);
    CHECK((c->kv_bytes == 0) == alone);
    // Nothing was put to the decode rank, and nothing landed there.
    CHECK((count_events(t.events(cluster.prefill[0].handle), "send_posted", c->request_id) == 0) == alone);
    // (Through a decode rank, a one-token answer may be done before its KV lands there, so only
    // the alone case is checked on the decode side.)
    if (alone) CHECK(count_events(t.events(cluster.decode[0].handle), "kv_landed", c->request_id) == 0);
    const auto ps = t.stats(cluster.prefill[0].handle);
    CHECK(ps.num_free_pages == ps.num_total_pages);  // the prompt's pages came back
    got.push_back(std::move(*c));
  }
  REQUIRE(got.size() == 2);
  CHECK(got[0].tokens == got[1].tokens);
  REQUIRE(got[0].logprobs.size() == 1);
  REQUIRE(got[1].logprobs.size() == 1);
  CHECK(got[0].logprobs[0].logprob == got[1].logprobs[0].logprob);
  CHECK(got[0].logprobs[0].top_tokens == got[1].logprobs[0].top_tokens);
  REQUIRE(got[0].prompt_logprobs.size() == got[1].prompt_logprobs.size());
  for (size_t i = 1; i < got[0].prompt_logprobs.size(); ++i) {
    CAPTURE(i);
    CHECK(got[0].prompt_logprobs[i].logprob == got[1].prompt_logprobs[i].logprob);
  }
}

TEST_CASE("a prefill-only order is answered without a lease; a cancel naming its tag stops it, one naming another "
          "tag does not, and a split of one is refused") {
  test::cluster_system t;
  auto cfg = small_cluster();
  // Each chunk starts 30 ms late: the cancel sent behind an order is read before chunk 0's result
  // even if this thread is held up between the two sends.
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "prefill", 30);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  const std::string text(100, 'q');  // seven chunks of 16
  const auto prompt = encode(cfg, text);
  const auto rank = cluster.prefill[0].handle;
  auto order_for = [&](uint64_t rid, uint32_t attempt) {
    prefill_order o;
    o.request_id = rid;
    o.tokens = prompt;
    o.output_from = static_cast<uint32_t>(prompt.size());
    o.prefill_only = true;
    o.grant.request_id = rid;
    o.grant.lease_id = prefill_only_tag(attempt);
    return o;
  };
  caf::scoped_actor self{t.sys};
  // The cancel is sent right behind the order, so the rank reads it before any chunk's result.
  auto ask = [&](prefill_order o, std::optional<uint64_t> cancel_tag) {
    caf::expected<prefill_result> out{caf::error{}};
    const auto rid = o.request_id;
    auto pending = self->request(rank, std::chrono::seconds{60}, std::move(o));
    if (cancel_tag) self->send(rank, cancel_atom::value, rid, *cancel_tag);
    pending.receive([&](prefill_result& r) { out = std::move(r); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  };
  generate_request ref_req;
  ref_req.prompt = text;
  ref_req.max_tokens = 1;
  ref_req.ignore_eos = true;
  auto ref = t.generate(cluster.router, ref_req);
  REQUIRE_MESSAGE(ref, t.sys.render(ref.error()));

  auto whole = ask(order_for(901, 0), prefill_only_tag(1));  // another attempt's tag: not this order
  REQUIRE_MESSAGE(whole, t.sys.render(whole.error()));
  CHECK(whole->first_token == ref->tokens.at(0));
  CHECK(whole->kv_bytes == 0);
  auto events = t.events(rank);
  CHECK(count_events(events, "send_posted", 901) == 0);
  CHECK(count_events(events, "compute_done", 901) == 7 * cfg.model.num_hidden_layers);

  auto cancelled = ask(order_for(902, 2), prefill_only_tag(2));
  REQUIRE_FALSE(cancelled);
  CHECK(cancelled.error().code() == static_cast<uint8_t>(errc::cancelled));
  CHECK(t.sys.render(cancelled.error()).find("let go of lease") != std::string::npos);
  // At most the two chunks the executor held when the cancel came were computed.
  events = t.events(rank);
  CHECK(std::none_of(events.begin(), events.end(),
                     [](const rank_event& e) { return e.request_id == 902 && e.kind == "compute_done" && e.chunk >= 2; }));
  const auto ps = t.stats(rank);
  CHECK(ps.num_free_pages == ps.num_total_pages);

  auto split = order_for(903, 0);
  split.part_ranks = {caf::actor_cast<caf::actor>(rank), caf::actor_cast<caf::actor>(rank)};
  split.part_bounds = {0, 50, static_cast<uint32_t>(prompt.size())};
  split.part_names = {"prefill-0", "prefill-0"};
  auto refused = ask(split, std::nullopt);
  REQUIRE_FALSE(refused);
  CHECK(t.sys.render(refused.error()).find("a prefill-only order is computed on one rank, not a split") != std::string::npos);
}

TEST_CASE("a prompt whose earlier attempt still winds down on the prefill rank steps aside: the prompts behind it "
          "start at once, and it starts once the attempt is gone") {
  test::cluster_system t;
  auto cfg = small_cluster();
  // Each prefill job starts 300 ms late: a cancelled attempt stays until its job comes back.
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "prefill", 300);
  test::cluster_system::stopper stop{t, cluster};
  const auto& prefill = cluster.prefill[0].handle;
  caf::scoped_actor self{t.sys};
  // Prefill-only orders (one token, no decode rank): the request's attempt is the lease's tag.
  const auto order = [&](uint64_t rid, uint32_t attempt) {
    prefill_order o;
    o.request_id = rid;
    o.tokens = encode(cfg, "In the beginning God created the heaven");
    o.prefill_only = true;
    o.grant.request_id = rid;
    o.grant.lease_id = prefill_only_tag(attempt);
    return o;
  };
  auto a = self->request(prefill, std::chrono::seconds{30}, order(1, 0));
  self->send(prefill, cancel_atom::value, uint64_t{1}, prefill_only_tag(0));  // its job is in the executor
  auto a2 = self->request(prefill, std::chrono::seconds{30}, order(1, 1));  // request 1 placed again, here
  auto b = self->request(prefill, std::chrono::seconds{30}, order(2, 0));
  // Handled in order (one mailbox): the first attempt winds down, its second waits for it, and
  // request 2 runs. (It used to wait behind request 1's second attempt, which waited for the first.)
  const auto st = t.stats(prefill);
  CHECK(st.num_waiting == 1);
  CHECK(st.num_running == 2);
  a.receive([](prefill_result&) { FAIL("the cancelled attempt was answered as done"); },
            [&](caf::error& e) { CHECK(t.sys.render(e).find("cancelled") != std::string::npos); });
  int32_t b_token = -1, a2_token = -2;
  b.receive([&](prefill_result& r) { b_token = r.first_token; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  a2.receive([&](prefill_result& r) { a2_token = r.first_token; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(a2_token == b_token);  // the same prompt
  CHECK(t.stats(prefill).num_waiting == 0);
}

TEST_CASE("a one-token request reuses a prompt prefix from the block store, and is placed again when its prefill "
          "rank is declared gone mid-prompt") {
  test::cluster_system t;
  char dir_template[] = "/tmp/baton-alone-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  struct cleanup {
    std::string dir;
    ~cleanup() { std::filesystem::remove_all(dir); }
  } clean{dir_template};
  auto cfg = small_cluster();
  cfg.executor.num_kv_pages = 128;
  cfg.store.enabled = true;
  cfg.store.dir = dir_template;
  cfg.store.block_tokens = 32;
  cfg.prefill.prefix_cache_blocks = 0;  // no rank-local tier: the prefix comes from the store
  cfg.router.request.retry_backoff_ms = 1;
  // Every prefill job of prefill-0 starts 100 ms late: long enough to declare the rank gone in
  // the middle of a prompt.
  auto make_exec = [cfg](const std::string& name) -> std::shared_ptr<gpu::executor> {
    auto w = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
    std::shared_ptr<gpu::executor> x = gpu::make_cpu_executor(cfg.model, w, cfg.executor);
    return name == "prefill-0" ? gpu::make_fault_slow_executor(std::move(x), 100) : x;
  };
  auto cluster = start_local_cluster(t.sys, cfg, make_exec);
  test::cluster_system::stopper stop{t, cluster};
  std::string text;
  for (int i = 0; i < 100; ++i) text.push_back(static_cast<char>('a' + (i * 3) % 26));
  generate_request req;
  req.prompt = text;
  req.max_tokens = 3;  // through the decode rank, which writes the prompt's blocks back
  req.ignore_eos = true;
  auto first = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(first, t.sys.render(first.error()));
  req.max_tokens = 1;
  caf::expected<completion> got{caf::error{}};
  for (int tries = 0; tries < 100; ++tries) {  // the write-back lands behind the first answer
    got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    if (got->cached_tokens == 96) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  CHECK(got->cached_tokens == 96);  // three blocks of 32, loaded under the order's tag
  CHECK(got->decode_rank.empty());
  CHECK(got->tokens.at(0) == first->tokens.at(0));

  // Declared gone while it computes: the request is placed again (on the same rank, which is
  // alive: the newer attempt supersedes the older) and answers the same token.
  caf::scoped_actor self{t.sys};
  req.prompt.clear();  // not cached: 101 tokens with <bos>, seven chunks
  for (int i = 0; i < 100; ++i) req.prompt.push_back(static_cast<char>('a' + (i * 11) % 26));
  auto pending = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req);
  bool running = false;
  for (int i = 0; i < 2000 && !running; ++i) {
    running = t.stats(cluster.prefill[0].handle).num_running > 0;
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  REQUIRE(running);
  self->send(cluster.router, rank_gone_atom::value, std::vector<std::string>{"prefill-0"}, std::string{"test"});
  caf::expected<completion> moved{caf::error{}};
  pending.receive([&](completion& c) { moved = std::move(c); }, [&](caf::error& e) { moved = std::move(e); });
  REQUIRE_MESSAGE(moved, t.sys.render(moved.error()));
  CHECK(moved->failovers == 1);
  CHECK(moved->decode_rank.empty());
  // The first attempt was told to stop (its tag named in the cancel): it did not compute all seven
  // chunks, 100 ms late each, before the second attempt computed its own.
  const auto computed = count_events(t.events(cluster.prefill[0].handle), "compute_done", moved->request_id);
  CHECK(computed >= 7 * cfg.model.num_hidden_layers);
  CHECK(computed < 14 * cfg.model.num_hidden_layers);
  req.max_tokens = 2;  // the reference goes through the decode rank
  auto through = t.generate(cluster.router, req);
  REQUIRE(through);
  CHECK(moved->tokens.at(0) == through->tokens.at(0));

  // A client that goes away while its prompt computes: its request lets go, and the cancel, naming
  // the attempt's tag, stops the prefill rank after the chunks the executor already held.
  const auto all_computed = [&] {
    const auto ev = t.events(cluster.prefill[0].handle);
    return std::count_if(ev.begin(), ev.end(), [](const rank_event& e) { return e.kind == "compute_done"; });
  };
  const auto computed_before = all_computed();
  auto sink = t.sys.spawn([](client_sink_actor::pointer) -> client_sink_actor::behavior_type {
    return {[](stream_chunk&) {}};
  });
  req.max_tokens = 1;
  req.prompt.clear();
  for (int i = 0; i < 100; ++i) req.prompt.push_back(static_cast<char>('a' + (i * 17) % 26));
  auto gone = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, req, sink);
  running = false;
  for (int i = 0; i < 2000 && !running; ++i) {
    running = t.stats(cluster.prefill[0].handle).num_running > 0;
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  REQUIRE(running);
  self->send_exit(sink, caf::exit_reason::kill);
  gone.receive([](completion&) { FAIL("a cancelled request was answered"); },
               [&](caf::error& e) { CHECK(t.sys.render(e).find("the client went away") != std::string::npos); });
  bool idle = false;  // the rank answers the cancelled order once its executor is done with it
  for (int i = 0; i < 3000 && !idle; ++i) {
    const auto s = t.stats(cluster.prefill[0].handle);
    idle = s.num_running == 0 && s.num_waiting == 0 && s.num_free_pages == s.num_total_pages;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  CHECK(idle);
  CHECK(all_computed() - computed_before < 7 * static_cast<long>(cfg.model.num_hidden_layers));
}

TEST_CASE("a request whose decode fails before its last token gets that token from a prefill rank alone, and its "
          "answer still names the decode rank that generated the others") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.retry_backoff_ms = 1;
  // Layer 1 of the first prompt arrives corrupted: the decode rank refuses the lease at its
  // checksum after the prefill answered with the first token.
  const transport::fault_plan plan{transport::fault_kind::corrupt_byte, 1u, {}, 1, 5};
  auto cluster = start_local_cluster(t.sys, cfg, {}, test::fault_proxy_on("prefill-0", plan));
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = "two tokens, the last after a failover";
  req.max_tokens = 2;
  req.ignore_eos = true;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->failovers == 1);
  REQUIRE(got->tokens.size() == 2);
  CHECK(got->kv_bytes == 0);  // the last attempt shipped nothing: its one token came from the prefill
  CHECK(got->decode_rank == "decode-0");
  auto again = t.generate(cluster.router, req);  // the proxy is transparent now
  REQUIRE(again);
  CHECK(again->failovers == 0);
  CHECK(got->tokens == again->tokens);
}
