#include <doctest/doctest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/cpu_kernels.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/job_queue.hpp"
#include "gpu/sampling.hpp"
#include "gpu/local_generate.hpp"
#include "gpu/thread_pool.hpp"
#include "tests/test_util.hpp"

using namespace baton;
using namespace baton::gpu;

namespace {

std::shared_ptr<const model_weights> tiny_weights() {
  static auto w = std::make_shared<const model_weights>(make_seeded_weights(builtin_tiny_config(), 7));
  return w;
}

std::unique_ptr<executor> tiny_executor(unsigned threads = 1, uint32_t pages = 128) {
  return make_cpu_executor(builtin_tiny_config(), tiny_weights(), cpu_executor_config{.num_threads = threads, .num_kv_pages = pages, .page_size_tokens = 16});
}

std::vector<int32_t> prompt(const char* text) {
  auto c = builtin_tiny_config();
  return byte_tokenizer{c.bos_token_id, c.eos_token_id}.encode(text);
}

}  // namespace

TEST_CASE("matmul gives every element the same bits whatever the batch, tiling and threads") {
  const size_t k = 67;  // odd: a tail in k
  // m 5: 4 + 1 rows; 8, 13 and 64: 8-row tiles where the CPU has 32 vector registers, then 4 + 1;
  // 65: past those (4-row tiles again). n 13: tails in the 3- and 4-wide column tiles; 2011: a
  // product large enough for the pool to split its columns over the threads.
  const std::pair<size_t, size_t> shapes[] = {{5, 13}, {8, 13}, {13, 13}, {64, 13}, {65, 13}, {8, 2011}, {13, 2011}};
  for (const auto& [m, n] : shapes) {
    CAPTURE(m);
    CAPTURE(n);
    std::vector<float> x(m * k), w(n * k);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i) * 0.37f);
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(static_cast<float>(i) * 0.11f);
    std::vector<float> batched(m * n), alone(n), threaded(m * n);
    matmul_nt(x.data(), m, k, w.data(), n, batched.data(), nullptr);
    thread_pool pool{3};
    matmul_nt(x.data(), m, k, w.data(), n, threaded.data(), &pool);
    CHECK(test::same_bits(batched, threaded));
    for (size_t r = 0; r < m; ++r) {
      matmul_nt(x.data() + r * k, 1, k, w.data(), n, alone.data(), nullptr);
      CHECK(test::same_bits(alone, std::vector<float>(batched.begin() + r * n, batched.begin() + (r + 1) * n)));
      // and it is a dot product: compare with a plain double-precision sum
      for (size_t c = 0; c < n; ++c) {
        double ref = 0;
        for (size_t i = 0; i < k; ++i) ref += double{x[r * k + i]} * w[c * k + i];
        CHECK(alone[c] == doctest::Approx(ref).epsilon(1e-5));
      }
    }
  }
}

TEST_CASE("grouped attention gives each query head exactly attention_ref's bits, and the latent form "
          "latent_attention_ref's, over paged KV, for any group size, length and width") {
  const uint32_t page_size = 4;
  for (const uint32_t head_dim : {7u, 16u, 64u}) {  // 7: only the k tail; 16 and 64: whole lanes
    for (const uint32_t kv_heads : {1u, 3u}) {
      const uint32_t kv_dim = kv_heads * head_dim;
      const uint64_t page_elems = uint64_t{2} * page_size * kv_dim;  // [k|v][slot][kv_dim]
      const uint32_t num_pages = 12;
      std::vector<float> kv(num_pages * page_elems);
      for (size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(static_cast<float>(i) * 0.013f) * 3.0f;
      const std::vector<uint32_t> pages = {7, 2, 11, 0, 5, 9, 1, 3, 10, 4, 6, 8};  // not in order
      for (const uint32_t group : {1u, 2u, 3u, 5u, 8u, 17u}) {  // 17: past the 16 sums kept on the stack
        for (const uint32_t len : {1u, 3u, 4u, 13u, 41u}) {
          CAPTURE(head_dim);
          CAPTURE(kv_heads);
          CAPTURE(group);
          CAPTURE(len);
          std::vector<float> q(size_t{group} * head_dim);
          for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(static_cast<float>(i * 7 + len) * 0.29f);
          const uint32_t kvh = kv_heads - 1;
          std::vector<float> scores(size_t{group} * len), grouped(q.size()), alone(head_dim);
          attention_group_ref(q.data(), group, len, kv.data(), pages.data(), page_size, kv_dim, page_elems, kvh * head_dim,
                              head_dim, 0.125f, scores.data(), grouped.data());
          for (uint32_t g = 0; g < group; ++g) {
            attention_ref(q.data() + g * head_dim, len, kv.data(), pages.data(), page_size, kv_dim, page_elems,
                          kvh * head_dim, head_dim, 0.125f, scores.data(), alone.data());
            CHECK(test::same_bits(alone, std::vector<float>(grouped.begin() + g * head_dim,
                                                              grouped.begin() + (g + 1) * head_dim)));
          }
          // The latent form: every head reads the whole slot as its key, its first value_dim as its value.
          const uint32_t latent = kv_dim, value_dim = std::max(1u, kv_dim - 3);
          std::vector<float> lq(size_t{group} * latent), lgrouped(size_t{group} * value_dim), lalone(value_dim);
          for (size_t i = 0; i < lq.size(); ++i) lq[i] = std::sin(static_cast<float>(i * 3 + len) * 0.17f);
          latent_attention_group_ref(lq.data(), group, len, kv.data(), pages.data(), page_size, latent, page_elems,
                                     value_dim, 0.0625f, scores.data(), lgrouped.data());
          for (uint32_t g = 0; g < group; ++g) {
            latent_attention_ref(lq.data() + g * latent, len, kv.data(), pages.data(), page_size, latent, page_elems,
                                 value_dim, 0.0625f, scores.data(), lalone.data());
            CHECK(test::same_bits(lalone, std::vector<float>(lgrouped.begin() + g * value_dim,
                                                               lgrouped.begin() + (g + 1) * value_dim)));
          }
        }
      }
    }
  }
}

TEST_CASE("rmsnorm, rope and swiglu match their definitions") {
  std::vector<float> x = {1, -2, 3, -4}, wt = {1, 1, 2, 0.5f}, y(4);
  rmsnorm(x.data(), wt.data(), 1, 4, 0.0f, y.data());
  const float inv = 1.0f / std::sqrt(30.0f / 4.0f);
  CHECK(y[2] == doctest::Approx(2 * 3 * inv));
  std::vector<float> v = {1, 0, 0, 1};  // one head of dim 4: pairs (0,2) and (1,3)
  rope_apply(v.data(), 1, 4, 1, 10000.0f);
  CHECK(v[0] == doctest::Approx(std::cos(1.0f)));
  CHECK(v[2] == doctest::Approx(std::sin(1.0f)));
  CHECK(v[3] == doctest::Approx(std::cos(0.01f)));  // inv_freq of pair 1 is 10000^(-1/2)
  std::vector<float> g = {0.0f, 2.0f}, u = {3.0f, 1.0f}, a(2);
  swiglu(g.data(), u.data(), 2, a.data());
  CHECK(a[0] == 0.0f);
  CHECK(a[1] == doctest::Approx(2.0f / (1.0f + std::exp(-2.0f))));
}

TEST_CASE("chunked prefill equals token-by-token, and one request's numbers do not depend on its batch") {
  auto exec = tiny_executor(2);
  const auto p = prompt("Layer by layer, the key-value cache moves.");
  // Whole prompt in one chunk vs chunks of 5 tokens: same logits, same tokens.
  auto whole = generate_colocated(*exec, p, 6, 0);
  auto chunked = generate_colocated(*exec, p, 6, 5);
  REQUIRE(whole.error.empty());
  CHECK(whole.tokens == chunked.tokens);
  CHECK(test::same_bits(whole.step_logits, chunked.step_logits));

  // Three sequences of different lengths in one batch vs each alone.
  const std::vector<std::vector<int32_t>> prompts = {prompt("a"), prompt("a longer prompt"), prompt("mid length")};
  auto& kv = exec->kv();
  std::vector<std::vector<uint32_t>> pages;
  for (size_t i = 0; i < prompts.size(); ++i) pages.push_back(*kv.kv_page_alloc(2));
  forward_job batch{1, {}};
  for (size_t i = 0; i < prompts.size(); ++i) batch.seqs.push_back({i, prompts[i], 0, pages[i], true});
  auto together = run_blocking(*exec, batch);
  REQUIRE(together.error.empty());
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto alone = run_blocking(*exec, forward_job{2, {forward_seq{i, prompts[i], 0, pages[i], true}}});
    CHECK(test::same_bits(alone.logits[0], together.logits[i]));
  }
}

TEST_CASE("a batched decode step gives each sequence exactly the logits of stepping it alone") {
  auto exec = tiny_executor(2);
  auto& kv = exec->kv();
  const std::vector<std::vector<int32_t>> prompts = {prompt("x"), prompt("a rather longer prompt here"),
                                                     prompt("medium prompt")};
  std::vector<std::vector<uint32_t>> pages;
  for (const auto& p : prompts) {
    pages.push_back(*kv.kv_page_alloc(3));
    REQUIRE(run_blocking(*exec, forward_job{1, {forward_seq{1, p, 0, pages.back(), false}}}).error.empty());
  }
  forward_job step{2, {}, forward_job::decode};
  for (size_t i = 0; i < prompts.size(); ++i)
    step.seqs.push_back({i, {'z'}, static_cast<uint32_t>(prompts[i].size()), pages[i], true});
  auto together = run_blocking(*exec, step);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto alone = run_blocking(*exec, forward_job{3, {step.seqs[i]}, forward_job::decode});
    CHECK(test::same_bits(alone.logits[0], together.logits[i]));
  }
}

TEST_CASE("paging is real: a fragmented pool gives non-contiguous pages and the same tokens") {
  const auto p = prompt("Pages of sixteen tokens, scattered across the pool, hold the same numbers.");
  auto fresh = tiny_executor();
  auto ref = generate_colocated(*fresh, p, 8, 16);
  REQUIRE(ref.error.empty());

  auto exec = tiny_executor();
  auto& kv = exec->kv();
  std::vector<std::vector<uint32_t>> held;
  for (int i = 0; i < 6; ++i) held.push_back(*kv.kv_page_alloc(2));
  kv.kv_page_free(held[1]);
  kv.kv_page_free(held[4]);
  kv.kv_page_free(held[2]);
  auto frag = generate_colocated(*exec, p, 8, 16);
  REQUIRE(frag.error.empty());
  bool contiguous = true;
  for (size_t i = 1; i < frag.pages.size(); ++i) contiguous &= frag.pages[i] == frag.pages[i - 1] + 1;
  CHECK_FALSE(contiguous);
  CHECK(frag.pages != ref.pages);
  CHECK(frag.tokens == ref.tokens);
  CHECK(test::same_bits(frag.step_logits, ref.step_logits));
}

TEST_CASE("a pool in memory from elsewhere (a transport's) holds the KV there, gives the same tokens, and frees it "
          "when the executor goes") {
  const auto p = prompt("Pool pages may live in a transport's shared memory.");
  auto ref = generate_colocated(*tiny_executor(), p, 8, 16);
  REQUIRE(ref.error.empty());
  auto freed = std::make_shared<bool>(false);
  std::vector<std::byte>* seen = nullptr;
  uint64_t asked = 0;
  cpu_executor_config ec{.num_threads = 1, .num_kv_pages = 128, .page_size_tokens = 16};
  ec.kv_memory = [&](uint64_t bytes) {
    asked = bytes;
    // Not zeroed, as a transport's memory need not be: every slot is written before it is read.
    auto buf = std::shared_ptr<std::vector<std::byte>>(new std::vector<std::byte>(bytes, std::byte{0xa5}),
                                                       [freed](std::vector<std::byte>* v) { *freed = true, delete v; });
    seen = buf.get();
    return kv_host_memory{buf->data(), buf};
  };
  auto exec = make_cpu_executor(builtin_tiny_config(), tiny_weights(), ec);
  CHECK(asked == exec->kv().size_bytes());
  REQUIRE(seen);
  CHECK(exec->kv().data() == seen->data());
  auto out = generate_colocated(*exec, p, 8, 16);
  REQUIRE(out.error.empty());
  CHECK(out.tokens == ref.tokens);
  CHECK(test::same_bits(out.step_logits, ref.step_logits));
  CHECK_FALSE(*freed);
  exec.reset();
  CHECK(*freed);
}

TEST_CASE("the executor refuses bad jobs with a message naming the sequence and the problem") {
  auto exec = tiny_executor(1, 8);
  auto pages = *exec->kv().kv_page_alloc(1);
  auto r = run_blocking(*exec, forward_job{1, {forward_seq{42, {300}, 0, pages, true}}});
  CHECK(r.error.find("sequence 42") != std::string::npos);
  CHECK(r.error.find("token id 300 outside the vocabulary") != std::string::npos);
  r = run_blocking(*exec, forward_job{1, {forward_seq{43, std::vector<int32_t>(20, 1), 0, pages, true}}});
  CHECK(r.error.find("cannot hold 20 tokens") != std::string::npos);
  r = run_blocking(*exec, forward_job{1, {forward_seq{44, {1}, 0, {99}, true}}});
  CHECK(r.error.find("KV page 99 does not exist") != std::string::npos);
  // Two sequences writing one page would overwrite each other's KV.
  r = run_blocking(*exec, forward_job{1, {forward_seq{46, {1, 2}, 0, pages, true}, forward_seq{47, {3}, 0, pages, true}}});
  CHECK(r.error.find("sequences 46 and 47 both write KV page " + std::to_string(pages[0])) != std::string::npos);
  // One page twice among one sequence's: its later tokens would overwrite its earlier ones' KV.
  r = run_blocking(*exec, forward_job{1, {forward_seq{48, std::vector<int32_t>(20, 1), 0, {pages[0], pages[0]}, true}}});
  CHECK(r.error == "sequence 48: KV page " + std::to_string(pages[0]) + " appears twice among the pages of its tokens");
  // ... and keeps working afterwards.
  r = run_blocking(*exec, forward_job{1, {forward_seq{45, {1, 2}, 0, pages, true}}});
  CHECK(r.error.empty());
  CHECK(r.logits[0].size() == builtin_tiny_config().vocab_size);
}

TEST_CASE("seeded weights are deterministic and the model is sensitive to its input") {
  auto a = make_seeded_weights(builtin_tiny_config(), 7);
  CHECK(test::same_bits(a.layers[2].w_up, tiny_weights()->layers[2].w_up));
  auto exec = tiny_executor();
  auto x = generate_colocated(*exec, prompt("The capital of France is"), 8, 0);
  auto y = generate_colocated(*exec, prompt("def fibonacci(n):"), 8, 0);
  CHECK(x.tokens != y.tokens);
}


TEST_CASE("a layer gate holds each layer until it opens, without changing a bit, and an aborted gate fails the job") {
  const auto cfg = gpu::builtin_tiny_config();
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg, 3));
  auto exec = gpu::make_cpu_executor(cfg, weights, {});
  auto pages = *exec->kv().kv_page_alloc(4);
  const std::vector<int32_t> prompt(40, 'g');
  const auto plain = gpu::run_blocking(*exec, {1, {{1, prompt, 0, pages, true}}});
  REQUIRE(plain.error.empty());
  auto gate = std::make_shared<gpu::streamed_layers_gate>();
  gpu::forward_job job{2, {{1, prompt, 0, pages, true}}};
  job.seqs[0].gate = gate;
  std::thread opener([&] {
    for (uint32_t l = 1; l <= cfg.num_hidden_layers; ++l) {
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
      gate->open_through(l);
    }
  });
  const auto gated = gpu::run_blocking(*exec, job);
  opener.join();
  REQUIRE(gated.error.empty());
  CHECK(test::same_bits(gated.logits[0], plain.logits[0]));
  auto stop = std::make_shared<gpu::streamed_layers_gate>();
  stop->open_through(2);
  stop->abort();
  job.job_id = 3;
  job.seqs[0].gate = stop;
  const auto failed = gpu::run_blocking(*exec, job);
  CHECK(failed.error.find("layer 0 of its cached prefix will not arrive") != std::string::npos);
}

TEST_CASE("sampling: top-k 1 and a tiny top-p are greedy, penalties move a seen token down, draws are reproducible") {
  const std::vector<float> logits = {1.0f, 3.0f, 2.9f, -1.0f, 0.5f};
  gpu::sampling_config greedy;
  CHECK(gpu::sample_token(logits, greedy, 0) == 1);
  gpu::sampling_config k1{1.0f, 9, 1};
  gpu::sampling_config p_small{1.0f, 9, 0, 1e-6f};
  for (uint32_t pos = 0; pos < 50; ++pos) {
    CHECK(gpu::sample_token(logits, k1, pos) == 1);
    CHECK(gpu::sample_token(logits, p_small, pos) == 1);
  }
  // top-k 2: only ids 1 and 2 ever come out.
  gpu::sampling_config k2{1.0f, 3, 2};
  std::set<int32_t> seen;
  for (uint32_t pos = 0; pos < 200; ++pos) seen.insert(gpu::sample_token(logits, k2, pos));
  CHECK(seen == std::set<int32_t>{1, 2});
  // Repetition penalty 2 halves the positive logit of a seen token: 3.0 -> 1.5 < 2.9.
  const std::vector<int32_t> history = {4, 1};
  gpu::sampling_config rep{0.0f, 0, 0, 1.0f, 2.0f};
  CHECK(gpu::sample_token(logits, rep, 0, &history) == 2);
  gpu::sampling_config pres{0.0f, 0, 0, 1.0f, 1.0f, 0.2f};
  CHECK(gpu::sample_token(logits, pres, 0, &history) == 2);  // 3.0 - 0.2 < 2.9
}

TEST_CASE("sampling: presence and frequency penalties count the output only (after output_from), frequency once per "
          "repeat; the repetition penalty counts the prompt too") {
  const std::vector<float> logits = {1.0f, 3.0f, 2.5f, -1.0f, 0.5f};
  // Prompt {1, 1, 4}, output {2, 4, 4}: token 1 is only in the prompt.
  const std::vector<int32_t> history = {1, 1, 4, 2, 4, 4};
  gpu::sampling_config pres{0.0f, 0, 0, 1.0f, 1.0f, 1.0f};
  pres.output_from = 3;
  CHECK(gpu::sample_token(logits, pres, 6, &history) == 1);  // 1 is the prompt's: no presence penalty
  gpu::sampling_config big{0.0f, 0, 0, 1.0f, 1.0f, 5.0f};
  big.output_from = 0;
  CHECK(gpu::sample_token(logits, big, 6, &history) == 0);  // 1, 2 and 4 all pushed below token 0
  big.output_from = 3;
  CHECK(gpu::sample_token(logits, big, 6, &history) == 1);
  // Frequency: token 4 twice in the output, token 2 once. 0.5 - 2 * 0.3 vs -1.0 - 0 (token 3).
  gpu::sampling_config freq{0.0f, 0, 0, 1.0f, 1.0f, 0.0f, 2.0f};
  freq.output_from = 3;
  const std::vector<float> flat = {-9.0f, -9.0f, 0.9f, 0.0f, 3.5f};
  // 2: 0.9 - 2 = -1.1; 3: 0.0; 4: 3.5 - 2 * 2 = -0.5. Presence alone (2.0) would keep 4 (1.5).
  CHECK(gpu::sample_token(flat, freq, 6, &history) == 3);
  gpu::sampling_config pres2{0.0f, 0, 0, 1.0f, 1.0f, 2.0f};
  pres2.output_from = 3;
  CHECK(gpu::sample_token(flat, pres2, 6, &history) == 4);
  // The repetition penalty counts the prompt: token 1's 3.0 halved to 1.5 < 2.5.
  const std::vector<int32_t> prompt_1_output_4 = {1, 4};
  gpu::sampling_config rep{0.0f, 0, 0, 1.0f, 2.0f};
  rep.output_from = 1;
  CHECK(gpu::sample_token(logits, rep, 2, &prompt_1_output_4) == 2);
  // The same (seed, position) draws the same token; another seed may not.
  gpu::sampling_config a{1.0f, 42}, b{1.0f, 42};
  for (uint32_t pos = 0; pos < 20; ++pos) CHECK(gpu::sample_token(logits, a, pos) == gpu::sample_token(logits, b, pos));
}

TEST_CASE("sampling: logit_bias moves a token's logit for the pick (after the penalties), draws too, and makes no "
          "row a device pick") {
  const std::vector<float> logits = {1.0f, 3.0f, 2.9f, -1.0f, 0.5f};
  gpu::sampling_config ban;
  ban.bias_tokens = {1};
  ban.bias_values = {-100.0f};
  CHECK(gpu::sample_token(logits, ban, 0) == 2);  // the best one banned: the next
  gpu::sampling_config boost;
  boost.bias_tokens = {3, 7};  // 7 lies outside the row: ignored
  boost.bias_values = {4.5f, 100.0f};
  CHECK(gpu::sample_token(logits, boost, 0) == 3);  // -1 + 4.5 = 3.5 > 3
  // After the penalties: a repetition penalty of 2 on token 1, then +1.45 on it: 3.0 / 2 + 1.45
  // = 2.95 > 2.9 wins; biased first it would lose ((3.0 + 1.45) / 2 = 2.225).
  const std::vector<int32_t> history = {1};
  gpu::sampling_config rep{0.0f, 0, 0, 1.0f, 2.0f};
  rep.bias_tokens = {1};
  rep.bias_values = {1.45f};
  CHECK(gpu::sample_token(logits, rep, 1, &history) == 1);
  // Draws: a banned token never comes out, at any position.
  gpu::sampling_config draw{1.0f, 5};
  draw.bias_tokens = {1, 2};
  draw.bias_values = {-100.0f, -100.0f};
  std::set<int32_t> seen;
  for (uint32_t pos = 0; pos < 300; ++pos) seen.insert(gpu::sample_token(logits, draw, pos));
  CHECK(seen.count(1) == 0);
  CHECK(seen.count(2) == 0);
  CHECK(seen.size() == 3);
  // The CUDA backend's device picks read raw logits: a biased row is picked on the host.
  gpu::seq_sampling greedy{ban, 0, {}};
  CHECK_FALSE(greedy.plain_greedy());
  gpu::seq_sampling at_temperature{draw, 0, {}};
  CHECK_FALSE(at_temperature.plain_draw());
  CHECK(gpu::seq_sampling{gpu::sampling_config{}, 0, {}}.plain_greedy());
}

TEST_CASE("logprobs_of: the log-softmax of the raw logits at the pick, and the top n in order (ties to the lower id, "
          "NaN never ranked)") {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, -1.0f, NAN, 0.5f};
  double z = 0.0;
  for (float x : logits)
    if (!std::isnan(x)) z += std::exp(static_cast<double>(x));
  const auto lsm = [&](size_t i) { return static_cast<float>(std::log(std::exp(static_cast<double>(logits[i])) / z)); };
  auto lp = gpu::logprobs_of(logits, 5, 3);
  CHECK(lp.logprob == doctest::Approx(lsm(5)).epsilon(1e-6));
  CHECK(lp.top_tokens == std::vector<int32_t>{1, 2, 0});
  REQUIRE(lp.top_logprobs.size() == 3);
  for (size_t k = 0; k < 3; ++k) CHECK(lp.top_logprobs[k] == doctest::Approx(lsm(lp.top_tokens[k])).epsilon(1e-6));
  // Probabilities sum to one; a NaN logit has none.
  double mass = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) mass += std::exp(gpu::logprobs_of(logits, static_cast<int32_t>(i), 0).logprob);
  CHECK(mass == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(std::isinf(gpu::logprobs_of(logits, 4, 0).logprob));
  CHECK(gpu::logprobs_of(logits, 4, 0).top_tokens.empty());
  // At most 20 and at most the vocabulary; the NaN comes last.
  CHECK(gpu::logprobs_of(logits, 0, 50).top_tokens == std::vector<int32_t>{1, 2, 0, 5, 3, 4});
  std::vector<float> wide(100, 0.0f);
  CHECK(gpu::logprobs_of(wide, 0, 50).top_tokens.size() == gpu::max_top_logprobs);
  CHECK(gpu::logprobs_of(wide, 0, 0).logprob == doctest::Approx(-std::log(100.0)));
  // Degenerate rows, as sample_token draws them: the infinite largest logits share the mass.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> none = {-inf, -inf, -inf, -inf};
  CHECK(gpu::logprobs_of(none, 2, 0).logprob == doctest::Approx(-std::log(4.0)));
  const std::vector<float> two = {inf, 1.0f, inf};
  CHECK(gpu::logprobs_of(two, 0, 0).logprob == doctest::Approx(-std::log(2.0)));
  CHECK(std::isinf(gpu::logprobs_of(two, 1, 0).logprob));
  // The rank (vLLM v1's): the tokens at least as likely, itself included, so the two tied at the
  // top both rank 2; a NaN logit ranks after every other token; a token outside the vocabulary
  // has none.
  CHECK(gpu::logprobs_of(logits, 1, 0).rank == 2);
  CHECK(gpu::logprobs_of(logits, 2, 0).rank == 2);
  CHECK(gpu::logprobs_of(logits, 0, 0).rank == 3);
  CHECK(gpu::logprobs_of(logits, 5, 0).rank == 4);
  CHECK(gpu::logprobs_of(logits, 3, 0).rank == 5);
  CHECK(gpu::logprobs_of(logits, 4, 0).rank == 6);
  CHECK(gpu::logprobs_of(logits, 6, 0).rank == 0);
}

TEST_CASE("sampling: min-p cuts the tokens less likely than its fraction of the best one, after temperature; "
          "banned tokens are never picked, greedy or drawn") {
  // Relative to the best token: 1, 0.5, 0.05, 0.2 at temperature 1.
  const std::vector<float> logits = {0.0f, std::log(0.5f), std::log(0.05f), std::log(0.2f)};
  const auto drawn = [&](const gpu::sampling_config& cfg) {
    std::set<int32_t> seen;
    for (uint32_t pos = 0; pos < 400; ++pos) seen.insert(gpu::sample_token(logits, cfg, pos));
    return seen;
  };
  gpu::sampling_config plain{1.0f, 11};
  CHECK(drawn(plain) == std::set<int32_t>{0, 1, 2, 3});
  gpu::sampling_config cut = plain;
  cut.min_p = 0.1f;
  CHECK(drawn(cut) == std::set<int32_t>{0, 1, 3});
  cut.min_p = 0.3f;
  CHECK(drawn(cut) == std::set<int32_t>{0, 1});
  // At temperature 2 token 2 is sqrt(0.05) = 0.22 of the best: above a min-p of 0.1, so kept
  // (min-p reads the tempered probabilities, as vLLM's does).
  gpu::sampling_config warm{2.0f, 11};
  warm.min_p = 0.1f;
  CHECK(drawn(warm) == std::set<int32_t>{0, 1, 2, 3});
  // With top-k 2 as well: both cuts hold.
  cut.min_p = 0.1f;
  cut.top_k = 2;
  CHECK(drawn(cut) == std::set<int32_t>{0, 1});
  // Greedy: min-p keeps the best token, so the pick is the argmax; a row with min-p is never a
  // device draw (the device draw has no cut), while a greedy one still is.
  gpu::sampling_config greedy_min_p;
  greedy_min_p.min_p = 0.5f;
  CHECK(gpu::sample_token(logits, greedy_min_p, 0) == 0);
  CHECK(gpu::seq_sampling{greedy_min_p, 0, {}}.plain_greedy());
  CHECK_FALSE(gpu::seq_sampling{warm, 0, {}}.plain_draw());
  // Bans: the best token banned, greedy takes the next; drawn, the banned ones never come out.
  gpu::sampling_config ban;
  ban.banned_tokens = {0, 9};  // 9 lies outside the row: ignored
  CHECK(gpu::sample_token(logits, ban, 0) == 1);
  CHECK_FALSE(gpu::seq_sampling{ban, 0, {}}.plain_greedy());
  gpu::sampling_config ban_draw{1.0f, 11};
  ban_draw.banned_tokens = {0, 1};
  CHECK(drawn(ban_draw) == std::set<int32_t>{2, 3});
}

TEST_CASE("the executor picks each sequence's token by sample_token's rules, and returns logits only where asked") {
  auto exec = tiny_executor(2);
  auto& kv = exec->kv();
  const std::vector<std::vector<int32_t>> prompts = {prompt("greedy"), prompt("drawn at a temperature"),
                                                     prompt("penalised repeats"), prompt("logits only")};
  std::vector<std::vector<uint32_t>> pages;
  forward_job plain{1, {}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    pages.push_back(*kv.kv_page_alloc(2));
    plain.seqs.push_back({i, prompts[i], 0, pages[i], true});
  }
  const auto ref = run_blocking(*exec, plain);  // every row's logits, picked by nobody
  REQUIRE(ref.error.empty());
  CHECK(ref.tokens == std::vector<int32_t>(prompts.size(), -1));

  std::vector<seq_sampling> how(3);
  how[1].cfg = {0.8f, 5, 10, 0.95f};
  how[2].cfg.presence_penalty = 1000.0f;  // no token of the prompt can be picked
  how[2].history = prompts[2];
  forward_job sampled = plain;
  sampled.job_id = 2;
  for (size_t i = 0; i < how.size(); ++i) {
    how[i].position = static_cast<uint32_t>(prompts[i].size());
    sampled.seqs[i].sample = how[i];
    sampled.seqs[i].want_logits = i == 1;  // a token and its logits, or a token alone
  }
  const auto got = run_blocking(*exec, sampled);
  REQUIRE(got.error.empty());
  REQUIRE(got.tokens.size() == prompts.size());
  for (size_t i = 0; i < how.size(); ++i) {
    CAPTURE(i);
    CHECK(got.tokens[i] == sample_token(ref.logits[i], how[i]));
    CHECK(got.logits[i].empty() == (i != 1));
  }
  CHECK(test::same_bits(got.logits[1], ref.logits[1]));
  CHECK(test::same_bits(got.logits[3], ref.logits[3]));
  CHECK(got.tokens[3] == -1);
  int32_t argmax = -1;
  argmax_rows(ref.logits[0].data(), 1, ref.logits[0].size(), &argmax);
  CHECK(got.tokens[0] == argmax);
  // The history reached the penalty: the pick is none of the prompt's tokens.
  CHECK(std::find(prompts[2].begin(), prompts[2].end(), got.tokens[2]) == prompts[2].end());
}

TEST_CASE("prompt scoring: each scored row gives the log-probability of its target as the logits of that prefix "
          "alone do, in chunks or whole, next to a pick, and a mismatched target list is refused by name") {
  auto exec = tiny_executor(2);
  auto& kv = exec->kv();
  const auto p = prompt("Score every token of this prompt.");
  const auto n = static_cast<uint32_t>(p.size());
  // The reference: for each prefix p[0..i], the last row's logits of that prefix computed alone.
  std::vector<token_logprobs> ref;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(i + 1));
    auto got = run_blocking(*exec, forward_job{1, {forward_seq{1, {p.begin(), p.begin() + i + 1}, 0, pages, true}}});
    kv.kv_page_free(pages);
    REQUIRE(got.error.empty());
    ref.push_back(logprobs_of(got.logits[0], p[i + 1], 3));
  }
  auto same = [&](const std::vector<token_logprobs>& got, size_t from) {
    for (size_t k = 0; k < got.size(); ++k) {
      CAPTURE(from + k);
      const auto& r = ref[from + k];
      CHECK(got[k].logprob == doctest::Approx(r.logprob).epsilon(1e-5));
      CHECK(got[k].top_tokens == r.top_tokens);
      REQUIRE(got[k].top_logprobs.size() == r.top_logprobs.size());
      for (size_t t = 0; t < r.top_logprobs.size(); ++t) CHECK(got[k].top_logprobs[t] == doctest::Approx(r.top_logprobs[t]).epsilon(1e-5));
    }
  };
  auto targets = [&](uint32_t from, uint32_t to) {  // row q scores p[q + 1]; the prompt's last row nothing
    std::vector<int32_t> t;
    for (uint32_t q = from; q < to; ++q) t.push_back(q + 1 < n ? p[q + 1] : -1);
    return t;
  };
  auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(n));
  // Whole, with the last row also picking a token (a prompt's last chunk does both).
  forward_seq whole{1, p, 0, pages, false};
  whole.score_targets = targets(0, n);
  whole.score_top = 3;
  whole.sample = seq_sampling{};
  whole.sample->position = n;
  auto got = run_blocking(*exec, forward_job{2, {whole}});
  REQUIRE(got.error.empty());
  REQUIRE(got.scores.size() == 1);
  REQUIRE(got.scores[0].size() == n - 1);
  same(got.scores[0], 0);
  CHECK(got.tokens[0] >= 0);
  // In two chunks, the second beside an unscored sequence in the same job: the scores carry over.
  const uint32_t cut = n / 2;
  forward_seq first{1, {p.begin(), p.begin() + cut}, 0, pages, false};
  first.score_targets = targets(0, cut);
  first.score_top = 3;
  auto a = run_blocking(*exec, forward_job{3, {first}});
  REQUIRE(a.scores.size() == 1);
  REQUIRE(a.scores[0].size() == cut);  // the chunk's last row scores the next chunk's first token
  same(a.scores[0], 0);
  auto other = *kv.kv_page_alloc(1);
  forward_seq second{1, {p.begin() + cut, p.end()}, cut, pages, false};
  second.score_targets = targets(cut, n);
  second.score_top = 3;
  auto b = run_blocking(*exec, forward_job{4, {forward_seq{2, prompt("x"), 0, other, true}, second}});
  REQUIRE(b.error.empty());
  REQUIRE(b.scores.size() == 2);
  CHECK(b.scores[0].empty());
  REQUIRE(b.scores[1].size() == n - 1 - cut);
  same(b.scores[1], cut);
  CHECK(b.logits[0].size() == builtin_tiny_config().vocab_size);
  // Targets that do not match the rows: refused, naming the sequence.
  forward_seq bad{9, p, 0, pages, false};
  bad.score_targets = {1, 2};
  auto refused = run_blocking(*exec, forward_job{5, {bad}});
  CHECK(refused.error == "sequence 9: 2 score targets for " + std::to_string(n) + " rows");
}

TEST_CASE("argmax_rows is sample_token's greedy pick: ties to the lowest id, NaNs never chosen") {
  const std::vector<float> rows = {1.0f, 3.0f, 3.0f, -1.0f,  //
                                   -INFINITY, -INFINITY, -INFINITY, -INFINITY,  //
                                   NAN, 2.0f, NAN, 5.0f,  //
                                   NAN, NAN, NAN, NAN};
  int32_t out[4];
  argmax_rows(rows.data(), 4, 4, out);
  CHECK(out[0] == 1);
  CHECK(out[1] == 0);
  CHECK(out[2] == 3);
  CHECK(out[3] == 0);
  for (size_t r = 0; r < 4; ++r)
    CHECK(out[r] == sample_token(std::vector<float>(rows.begin() + r * 4, rows.begin() + (r + 1) * 4), sampling_config{}, 0));
}

namespace {

/// sample_token as it was written first: every candidate sorted, the top-p mass summed in rank
/// order. The reference for the partial-sort version.
int32_t sample_by_full_sort(const std::vector<float>& logits, const sampling_config& cfg, uint32_t position) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  uint64_t z = cfg.seed + 0x9E3779B97F4A7C15ull * (uint64_t{position} + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) p[i] = std::exp((static_cast<double>(logits[i]) - logits[best]) / cfg.temperature);
  std::vector<uint32_t> idx(p.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return p[a] > p[b]; });
  if (cfg.top_k > 0 && cfg.top_k < idx.size()) idx.resize(cfg.top_k);
  if (cfg.top_p < 1.0f) {
    double total = 0.0, acc = 0.0;
    for (auto i : idx) total += p[i];
    size_t keep = 0;
    while (keep < idx.size()) {
      acc += p[idx[keep++]] / total;
      if (acc >= cfg.top_p) break;
    }
    idx.resize(std::max<size_t>(1, keep));
  }
  double total = 0.0, acc = 0.0;
  for (auto i : idx) total += p[i];
  for (auto i : idx) {
    acc += p[i] / total;
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(idx.back());
}

}  // namespace

TEST_CASE("top-k and top-p sort only the prefix they read, and pick what a full sort picks") {
  // Logits with ties (quantised) and a long flat tail, as a real vocabulary has.
  std::vector<float> logits(5000);
  uint32_t s = 12345;
  for (auto& x : logits) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>((s >> 8) % 400) * 0.02f - 4.0f;
  }
  logits[17] = logits[4000] = 6.0f;  // a tie at the top
  const sampling_config configs[] = {{0.7f, 1, 0, 0.9f},  {1.0f, 2, 0, 0.5f},   {1.3f, 3, 50, 1.0f},
                                     {0.8f, 4, 50, 0.8f}, {1.0f, 5, 1, 1.0f},   {2.0f, 6, 0, 0.999f},
                                     {0.5f, 7, 6000, 0.95f}, {1.0f, 8, 0, 0.01f}};
  size_t drawn = 0;
  for (const auto& c : configs)
    for (uint32_t pos = 0; pos < 150; ++pos) {
      CAPTURE(c.top_k);
      CAPTURE(c.top_p);
      CAPTURE(pos);
      const int32_t got = sample_token(logits, c, pos);
      CHECK(got == sample_by_full_sort(logits, c, pos));
      drawn += got != 17;
    }
  CHECK(drawn > 100);  // the draws are not all the top token: the cut-offs were exercised
  // An infinite logit is certain, however hot the draw; a row without numbers draws among all.
  const std::vector<float> inf_row = {1.0f, INFINITY, 2.0f, 0.0f};
  for (uint32_t pos = 0; pos < 20; ++pos) CHECK(sample_token(inf_row, sampling_config{1.0f, 3}, pos) == 1);
}

TEST_CASE("a sampler's reused scratch changes no pick: each row in place, settings and widths interleaved") {
  // One buffer of rows of two widths, read in place as the executors do; one scratch carries
  // over from every kind of pick (penalised, top-p, greedy, wider, narrower) to the next.
  std::vector<float> rows(3 * 5000);
  uint32_t s = 99;
  for (auto& x : rows) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>((s >> 8) % 1000) * 0.01f - 5.0f;
  }
  const std::vector<int32_t> history = {3, 17, 17, 4000, 4999, 2500};
  const sampling_config configs[] = {{0.7f, 1, 0, 0.9f, 1.3f, 0.5f}, {0.0f, 0, 0, 1.0f, 1.0f, 2.0f}, {1.0f, 2},
                                     {0.9f, 3, 40, 0.8f},            {0.0f},                          {1.5f, 4, 0, 0.3f, 2.0f}};
  sampling_scratch scratch;
  size_t penalty_moved = 0;
  for (uint32_t pos = 0; pos < 60; ++pos)
    for (const auto& c : configs) {
      const size_t width = pos % 2 ? 5000 : 1200;
      const std::span<const float> row(rows.data() + (pos % 3) * 5000, width);
      const std::vector<float> copy(row.begin(), row.end());
      CAPTURE(pos);
      CAPTURE(c.temperature);
      const int32_t reused = sample_token(row, c, pos, history, &scratch);
      CHECK(reused == sample_token(copy, c, pos, &history));
      penalty_moved += c.penalised() && reused != sample_token(copy, c, pos);
    }
  CHECK(penalty_moved > 0);  // the penalties were in force, so stale penalised logits would show
}

TEST_CASE("an exception in a parallel range comes back to the caller once every range has ended (the caller's "
          "range or a worker's), and a job that throws fails by its sink instead of ending the process") {
  gpu::thread_pool pool{3};
  for (size_t thrower : {size_t{0}, size_t{2}}) {  // the caller's range, then a worker's
    CAPTURE(thrower);
    std::atomic<int> finished{0};
    bool caught = false;
    try {
      pool.parallel_for(3, 1, [&](size_t b, size_t) {
        if (b == thrower) throw std::runtime_error("no memory for scratch");
        std::this_thread::sleep_for(std::chrono::milliseconds{20});
        ++finished;
      });
    } catch (const std::runtime_error& e) {
      caught = std::string{e.what()} == "no memory for scratch";
      CHECK(finished.load() == 2);  // the other ranges had ended: `fn` outlived none of them
    }
    CHECK(caught);
  }
  // The pool serves the next loop as before.
  std::atomic<size_t> sum{0};
  pool.parallel_for(100, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) sum += i;
  });
  CHECK(sum.load() == 4950);

  struct recorder : gpu::executor_sink {
    std::mutex m;
    std::condition_variable cv;
    std::vector<std::pair<uint64_t, std::string>> failed;
    std::vector<uint64_t> done;
    void on_layer_kv_ready(uint64_t, uint32_t) override {}
    void on_done(uint64_t id, gpu::forward_output) override {
      std::lock_guard<std::mutex> l{m};
      done.push_back(id);
      cv.notify_all();
    }
    void on_failed(uint64_t id, std::string why) override {
      std::lock_guard<std::mutex> l{m};
      failed.emplace_back(id, std::move(why));
      cv.notify_all();
    }
  };
  auto sink = std::make_shared<recorder>();
  gpu::job_queue q;
  q.start(
      [](const gpu::forward_job& job) {
        if (job.job_id == 3) throw std::bad_alloc{};  // the check's own buffers
        return std::string{};
      },
      [](const gpu::forward_job& job, gpu::executor_sink& s) {
        if (job.job_id == 1) throw std::bad_alloc{};
        s.on_done(job.job_id, {});
      });
  q.submit(gpu::forward_job{1, {}}, sink);
  q.submit(gpu::forward_job{3, {}}, sink);
  q.submit(gpu::forward_job{2, {}}, sink);  // one thread, in order: 1 and 3 are settled first
  std::unique_lock<std::mutex> lock{sink->m};
  CHECK(sink->cv.wait_for(lock, std::chrono::seconds{30}, [&] { return !sink->done.empty(); }));
  REQUIRE(sink->failed.size() == 2);
  CHECK(sink->failed[0].first == 1);
  CHECK(sink->failed[0].second.find("the job threw: ") == 0);
  CHECK(sink->failed[1].first == 3);
  CHECK(sink->done == std::vector<uint64_t>{2});  // the queue's thread lives on
}

TEST_CASE("a process's CUDA ranks take the devices it sees in turn; the CPU backend and a machine without devices "
          "are left as they are") {
  const backend_config cuda{.kind = "cuda"};
  // A node with 8 ranks on an 8-GPU host: one rank per GPU.
  for (uint32_t i = 0; i < 8; ++i) CHECK(cuda.for_rank(i, 8).cuda_device == static_cast<int>(i));
  // More ranks than devices share them in turn; one device holds them all.
  CHECK(cuda.for_rank(5, 2).cuda_device == 1);
  CHECK(cuda.for_rank(6, 2).cuda_device == 0);
  CHECK(cuda.for_rank(3, 1).cuda_device == 0);
  // From the configured device on.
  const backend_config from2{.kind = "cuda", .cuda_device = 2};
  CHECK(from2.for_rank(0, 4).cuda_device == 2);
  CHECK(from2.for_rank(3, 4).cuda_device == 1);
  // Nothing else changes; without devices (no CUDA here) validate() names the problem as before.
  const backend_config fp32{.kind = "cuda", .cuda_bf16 = false};
  CHECK_FALSE(fp32.for_rank(1, 2).cuda_bf16);
  CHECK(cuda.for_rank(7, 0).cuda_device == 0);
  CHECK(backend_config{}.for_rank(3, 8).cuda_device == 0);  // the CPU backend has no device
  CHECK(backend_config{}.for_rank(3, 8).kind == "cpu");
}
