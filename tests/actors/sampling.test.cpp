// Sampling through a cluster (prefill rank -> KV handoff -> decode rank): the knobs a request
// turns pick the same tokens as one executor does alone, and what a request asks to know about
// its tokens (log-probabilities) is what that executor's logits say.

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "transport/fault_proxy.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;

namespace {

constexpr uint32_t chunk_tokens = 16;

local_cluster_config one_by_one() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_threads = 1;
  cfg.executor.num_kv_pages = 64;
  cfg.prefill.chunk_tokens = chunk_tokens;
  return cfg;
}

std::vector<int32_t> encode(const local_cluster_config& cfg, const std::string& text) {
  return gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.encode(text);
}

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
  auto cfg = one_by_one();
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
  const auto first_hit = std::find(full->tokens.begin(), full->tokens.end(), full->tokens[3]) - full->tokens.begin();
  CHECK(s1->tokens.size() == static_cast<size_t>(first_hit) + 1);
  // Stop string: the text ends before it.
  auto by_text = greedy;
  const std::string needle = full->text.substr(5, 2);
  by_text.stop = {needle};
  auto s2 = t.generate(cluster.router, by_text);
  REQUIRE(s2);
  CHECK(s2->finish_reason == "stop");
  CHECK(s2->text == full->text.substr(0, full->text.find(needle)));
  // Every lease comes back (a stopped request's release reaches the decode rank asynchronously).
  for (int i = 0; i < 1000 && t.stats(cluster.decode[0].handle).num_free_pages != cfg.executor.num_kv_pages; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("logprobs: each token's log-probability and its step's top tokens are the log-softmax of the logits that "
          "chose it, from the prefill rank's first token to the decode rank's last; asking changes no token") {
  test::cluster_system t;
  for (const bool hybrid : {false, true})
  for (const float temperature : {0.0f, 0.8f}) {
    CAPTURE(hybrid);
    CAPTURE(temperature);
    auto cfg = one_by_one();
    // Hybrid PD: the prompt is prefilled on the decode rank, whose step answers its first token.
    if (hybrid) cfg.router.request.hybrid_prefill_below_tokens = 1000;
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
  auto cfg = one_by_one();
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
    auto cfg = one_by_one();
    cfg.num_prefill_ranks = 2;
    cfg.executor.num_kv_pages = 128;
    cfg.prefill.chunk_tokens = 64;
    cfg.prefill.score_chunk_tokens = 16;  // a scored prompt runs in several chunks
    cfg.prefill_balancer.policy = "split";
    cfg.prefill_balancer.split_min_tokens = 32;
    cfg.store.enabled = true;
    cfg.store.dir = std::string(dir_template) + (hybrid ? "/h" : "/s");
    cfg.store.block_tokens = 32;
    if (hybrid) cfg.router.request.hybrid_prefill_below_tokens = 1000;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    generate_request req;
    req.prompt = text;
    req.max_tokens = 4;
    req.ignore_eos = true;
    auto plain = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(plain, t.sys.render(plain.error()));
    if (!hybrid) {
      CHECK(plain->prefill_placement_why.rfind("split:", 0) == 0);
      CHECK(plain->prefill_placement_why.find("not split") == std::string::npos);  // it was split
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
    if (!hybrid) CHECK(got->prefill_placement_why.find("scored whole") != std::string::npos);
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
  auto cfg = one_by_one();
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

TEST_CASE("floats cross processes bit for bit, NaN and infinities too (CAF 0.17 packs floats by hand: NaN became 1.0 "
          "and an infinity hung the sender)") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto bits = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  };
  completion c;
  c.step_logits = {{1.5f, -inf, inf, nan, -0.0f, 1e-40f}};  // 1e-40: subnormal, also lost by the hand packing
  c.logprobs = {{7, -inf, "x", {7, 8}, {-inf, nan}, {"x", "y"}}};
  c.prompt_logprobs = {{1, nan, "", {}, {}, {}}};
  prefill_result p;
  p.logprobs = {gpu::token_logprobs{-inf, {3}, {nan}}};
  p.logits = {inf};
  generate_request g;
  g.temperature = inf;
  rank_load load;
  load.predicted_us = std::numeric_limits<double>::infinity();
  std::vector<char> buf;
  caf::binary_serializer sink{nullptr, buf};
  REQUIRE_FALSE(sink(c, p, g, load));
  completion c2;
  prefill_result p2;
  generate_request g2;
  rank_load load2;
  caf::binary_deserializer source{nullptr, buf};
  REQUIRE_FALSE(source(c2, p2, g2, load2));
  REQUIRE(c2.step_logits.size() == 1);
  REQUIRE(c2.step_logits[0].size() == c.step_logits[0].size());
  for (size_t i = 0; i < c.step_logits[0].size(); ++i) CHECK(bits(c2.step_logits[0][i]) == bits(c.step_logits[0][i]));
  CHECK(bits(c2.logprobs[0].logprob) == bits(-inf));
  CHECK(bits(c2.logprobs[0].top_logprobs[1]) == bits(nan));
  CHECK(std::isnan(c2.prompt_logprobs[0].logprob));
  CHECK(bits(p2.logprobs[0].logprob) == bits(-inf));
  CHECK(std::isnan(p2.logprobs[0].top_logprobs[0]));
  CHECK(bits(p2.logits[0]) == bits(inf));
  CHECK(std::isinf(g2.temperature));
  CHECK(std::isinf(load2.predicted_us));
}
