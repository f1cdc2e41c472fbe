// The CUDA executor end to end (issue 11): against transformers' own logits (the committed ones,
// or those remade in the same run: --hf-reference-dir, gpu_test_paths.hpp), against the CPU
// backend's greedy tokens, and the disaggregated-equals-colocated invariant across two CUDA
// executors whose only link is the host KV pool (what a transport ships). Label "gpu"; every
// case skips where no device is present.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "gpu/cpu_executor.hpp"
#include "gpu/cuda/blas_library.hpp"
#include "gpu/cuda/kernels.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/json_schema_grammar.hpp"
#include "gpu/tokenizer.hpp"
#include "gpu/local_generate.hpp"
#include "gpu/sampling.hpp"
#include "tests/gpu/gpu_test_paths.hpp"
#include "tests/test_util.hpp"

using namespace baton;
using namespace baton::gpu;

namespace {

const bool no_gpu = cuda::device_count() == 0;

std::string source_dir() { return test::gpu_paths().source_dir; }

hf_model load(const std::string& dir) {
  hf_model m;
  std::string why;
  REQUIRE_MESSAGE(load_hf_model(dir, &m, &why), why);
  return m;
}

std::unique_ptr<executor> cuda_exec(const hf_model& m, bool bf16, uint32_t pages = 64) {
  cuda_executor_config c;
  c.bf16 = bf16;
  c.num_kv_pages = pages;
  c.max_batch_tokens = 512;
  std::string why;
  auto e = make_cuda_executor(m.config, m.weights, c, &why);
  REQUIRE_MESSAGE(e, why);
  return e;
}

float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::vector<int32_t> some_prompt(uint32_t n, uint32_t vocab) {
  std::vector<int32_t> p;
  for (uint32_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((i * 37 + 11) % vocab));
  return p;
}

}  // namespace

namespace {

/// The reference directories transformers made (index.json), split by family: DeepSeek's latent
/// attention and experts, or not. Split by the family each reference.json names, without loading
/// the models, so that a DeepSeek directory the loader refuses fails its own case only.
std::vector<std::string> reference_models(bool deepseek) {
  const std::string root = test::gpu_paths().hf_reference();
  std::ifstream in{root + "/index.json"};
  REQUIRE_MESSAGE(in.good(), root << "/index.json is missing");
  std::vector<std::string> out;
  for (const auto& name : nlohmann::json::parse(in)) {
    std::ifstream rin{root + "/" + name.get<std::string>() + "/reference.json"};
    REQUIRE_MESSAGE(rin.good(), root << "/" << name.get<std::string>() << "/reference.json is missing");
    const auto family = nlohmann::json::parse(rin).value("family", std::string{});
    if ((family.rfind("deepseek", 0) == 0) == deepseek) out.push_back(name.get<std::string>());
  }
  return out;
}

/// One reference directory against the CUDA executor: fp32 within 1e-4 of the largest logit at
/// every teacher-forced step, bf16 within 1.5x transformers' own bf16 error, and greedy in fp32
/// equal to the CPU backend and to transformers for 32 steps.
void against_transformers(const std::string& name) {
  const std::string dir = test::gpu_paths().hf_reference() + "/" + name;
  CAPTURE(dir);
  auto m = load(dir + "/model");
  std::ifstream rin{dir + "/reference.json"};
  const auto ref = nlohmann::json::parse(rin);
  const auto tokens = ref["tokens"].get<std::vector<int32_t>>();
  const auto logits = ref["logits"].get<std::vector<std::vector<float>>>();
  REQUIRE(ref.contains("gpu_bf16_vs_fp32_max_abs"));
  const float bf16_bound = 1.5f * ref["gpu_bf16_vs_fp32_max_abs"].get<float>();
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto exec = cuda_exec(m, bf16);
    auto pages = *exec->kv().kv_page_alloc(exec->kv().pages_for_tokens(static_cast<uint32_t>(tokens.size())));
    float worst = 0, worst_ratio = 0;
    for (uint32_t pos = 0; pos < tokens.size(); ++pos) {  // teacher-forced, one position per step
      auto out = run_blocking(*exec, {pos + 1, {{1, {tokens[pos]}, pos, pages, true}}});
      REQUIRE_MESSAGE(out.error.empty(), out.error);
      const float d = max_diff(out.logits[0], logits[pos]);
      worst = std::max(worst, d);
      worst_ratio = std::max(worst_ratio, d / max_abs(logits[pos]));
    }
    if (bf16) {
      MESSAGE(name << " bf16: max |dlogit| " << worst << " vs transformers fp32; bound 1.5 x "
                                      << bf16_bound / 1.5f << " = " << bf16_bound);
      CHECK(worst <= bf16_bound);
    } else {
      MESSAGE(name << " fp32: max |dlogit| / max |logit| " << worst_ratio);
      CHECK(worst_ratio <= 1e-4f);
    }
    exec->kv().kv_page_free(pages);
  }
  // Greedy in fp32 (bf16 rounding would move these tiny models' near-ties): CUDA = CPU = transformers.
  auto gpu = cuda_exec(m, false);
  auto cpu = make_cpu_executor(m.config, m.weights, {});
  const auto prompt = ref["greedy_prompt"].get<std::vector<int32_t>>();
  const auto g = generate_colocated(*gpu, prompt, 32, 64, {}, true);
  const auto c = generate_colocated(*cpu, prompt, 32, 64, {}, true);
  REQUIRE(g.error.empty());
  CHECK(g.tokens == c.tokens);
  CHECK(g.tokens == ref["greedy_tokens"].get<std::vector<int32_t>>());
}

}  // namespace

TEST_CASE("cuda executor vs transformers: fp32 within 1e-4 of the largest logit, bf16 within 1.5x transformers' own "
          "bf16 error, and greedy equals the CPU backend for 32 steps" * doctest::skip(no_gpu)) {
  for (const auto& name : reference_models(false)) against_transformers(name);
}

// DeepSeek's families apart, so that a failure names them (first passed on the H200 on 2026-12-04).
TEST_CASE("cuda executor vs transformers, DeepSeek-V2 and V3 (latent attention, experts): the same bounds" *
          doctest::skip(no_gpu)) {
  const auto names = reference_models(true);
  if (names.empty()) MESSAGE("no DeepSeek reference directories (scripts/hf_reference.py makes them where torch is)");
  for (const auto& name : names) against_transformers(name);
}

namespace {

/// Prefill on one CUDA executor, ship the host KV pages to another (as a transport does), decode
/// there; `gate_delay_ms` > 0 makes the decode side's first job wait for its prefix layer by
/// layer, as a store load or a layer-wise handoff delivers it.
std::vector<std::vector<float>> disaggregated(const hf_model& m, bool bf16, const std::vector<int32_t>& prompt,
                                              uint32_t steps, int gate_delay_ms) {
  auto p = cuda_exec(m, bf16), d = cuda_exec(m, bf16);
  auto& pkv = p->kv();
  auto& dkv = d->kv();
  const uint32_t total = static_cast<uint32_t>(prompt.size()) + steps;
  auto ppages = *pkv.kv_page_alloc(pkv.pages_for_tokens(total));
  (void)dkv.kv_page_alloc(3);  // the decode side's pages are other ids than the prefill side's
  auto dpages = *dkv.kv_page_alloc(dkv.pages_for_tokens(total));
  auto first = run_blocking(*p, {1, {{7, prompt, 0, ppages, true}}});
  REQUIRE_MESSAGE(first.error.empty(), first.error);
  std::vector<std::vector<float>> out{first.logits[0]};
  auto gate = std::make_shared<streamed_layers_gate>();
  const uint32_t L = m.config.num_hidden_layers;
  auto ship_layer = [&](uint32_t l) {
    for (uint32_t i = 0; i < pkv.pages_for_tokens(static_cast<uint32_t>(prompt.size())); ++i)
      std::copy_n(pkv.k_at(l, ppages[i], 0), pkv.layout().page_bytes() / sizeof(float), dkv.k_at(l, dpages[i], 0));
  };
  // Joined on every way out (a failed REQUIRE below throws; a joinable thread's destructor
  // would end the whole run).
  std::jthread shipper;
  if (gate_delay_ms > 0) {
    shipper = std::jthread([&] {
      for (uint32_t l = 0; l < L; ++l) {
        std::this_thread::sleep_for(std::chrono::milliseconds(gate_delay_ms));
        ship_layer(l);
        gate->open_through(l + 1);
      }
    });
  } else {
    for (uint32_t l = 0; l < L; ++l) ship_layer(l);
    gate = nullptr;
  }
  int32_t tok = sample_token(out.back(), {}, static_cast<uint32_t>(prompt.size()), nullptr);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t pos = static_cast<uint32_t>(prompt.size()) + s;
    forward_seq seq{7, {tok}, pos, dpages, true};
    if (s == 0) seq.gate = gate;
    auto r = run_blocking(*d, {100 + s, {seq}});
    REQUIRE_MESSAGE(r.error.empty(), r.error);
    out.push_back(r.logits[0]);
    tok = sample_token(out.back(), {}, pos + 1, nullptr);
  }
  if (shipper.joinable()) shipper.join();  // before `out` is handed back (the thread reads the pages)
  return out;
}

/// Disaggregated (prefix shipped at once, or streamed in layer by layer) equals colocated, bit for
/// bit, over 12 decode steps.
void same_as_colocated(const hf_model& m, bool bf16, const std::vector<int32_t>& prompt) {
  auto colo = cuda_exec(m, bf16);
  const auto c = generate_colocated(*colo, prompt, 12, static_cast<uint32_t>(prompt.size()), {}, true);
  REQUIRE(c.error.empty());
  for (int delay : {0, 5}) {
    CAPTURE(delay);
    const auto d = disaggregated(m, bf16, prompt, 12, delay);
    REQUIRE(d.size() == 13);
    for (size_t i = 0; i < 12; ++i) CHECK_MESSAGE(test::same_bits(d[i], c.step_logits[i]), "step " << i);
  }
}

}  // namespace

TEST_CASE("cuda: disaggregated (prefill on one executor, KV through the host pool, decode on another) equals "
          "colocated bit for bit, with the prefix streamed in layer by layer or all at once" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  const auto prompt = some_prompt(45, m.config.vocab_size);  // 45: the prefix ends inside a page
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    same_as_colocated(m, bf16, prompt);
  }
}

TEST_CASE("cuda: decode rows mirrored slot by slot leave the host pool complete: another executor continues the "
          "sequence from it bit for bit" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  const auto prompt = some_prompt(45, m.config.vocab_size);  // the prefill leaves its last page part-filled
  const uint32_t steps = 22;  // decode rows fill that page and the next two
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    cuda_executor_config c;
    c.bf16 = bf16;
    c.num_kv_pages = 64;
    c.max_batch_tokens = 512;
    c.mirror_rows = true;
    std::string why;
    auto a = make_cuda_executor(m.config, m.weights, c, &why);
    REQUIRE_MESSAGE(a, why);
    REQUIRE_MESSAGE(dynamic_cast<cuda_executor_extras&>(*a).mirrors_rows(), "the host pool could not be mapped");
    auto b = cuda_exec(m, bf16);  // pages mirrored whole: only its first job matters here
    auto& akv = a->kv();
    auto& bkv = b->kv();
    const uint32_t total = static_cast<uint32_t>(prompt.size()) + steps + 1;
    auto apages = *akv.kv_page_alloc(akv.pages_for_tokens(total));
    (void)bkv.kv_page_alloc(5);  // other page ids on the other side
    auto bpages = *bkv.kv_page_alloc(bkv.pages_for_tokens(total));
    auto first = run_blocking(*a, {1, {{3, prompt, 0, apages, true}}});
    REQUIRE_MESSAGE(first.error.empty(), first.error);
    int32_t tok = sample_token(first.logits[0], {}, static_cast<uint32_t>(prompt.size()), nullptr);
    uint32_t pos = static_cast<uint32_t>(prompt.size());
    for (uint32_t s = 0; s < steps; ++s, ++pos) {
      auto r = run_blocking(*a, {10 + s, {{3, {tok}, pos, apages, true}}});
      REQUIRE_MESSAGE(r.error.empty(), r.error);
      tok = sample_token(r.logits[0], {}, pos + 1, nullptr);
    }
    // Everything A wrote, prefill and decode rows alike, must be in its host pool now.
    const uint32_t used = akv.pages_for_tokens(pos);
    for (uint32_t l = 0; l < m.config.num_hidden_layers; ++l)
      for (uint32_t i = 0; i < used; ++i)
        std::copy_n(akv.k_at(l, apages[i], 0), akv.layout().page_bytes() / sizeof(float), bkv.k_at(l, bpages[i], 0));
    const auto stayed = run_blocking(*a, {100, {{3, {tok}, pos, apages, true}}});
    const auto moved = run_blocking(*b, {100, {{3, {tok}, pos, bpages, true}}});
    REQUIRE_MESSAGE(stayed.error.empty(), stayed.error);
    REQUIRE_MESSAGE(moved.error.empty(), moved.error);
    CHECK(test::same_bits(moved.logits[0], stayed.logits[0]));
  }
}

TEST_CASE("cuda graphs: decode steps replayed from captured graphs give the bits of launched ones, as the batch "
          "shrinks and grows and contexts cross a split" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  // The model was trained to 256 positions; RoPE is defined past them, and the split needs 512.
  m.config.max_position_embeddings = 1024;
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    cuda_executor_config c;
    c.bf16 = bf16;
    c.num_kv_pages = 128;
    c.max_batch_tokens = 512;
    c.mirror_rows = true;  // decode jobs mirror slot by slot, which a graph can replay
    c.cuda_graphs = false;
    std::string why;
    auto launched = make_cuda_executor(m.config, m.weights, c, &why);
    REQUIRE_MESSAGE(launched, why);
    c.cuda_graphs = true;
    auto graphed = make_cuda_executor(m.config, m.weights, c, &why);
    REQUIRE_MESSAGE(graphed, why);
    // Prompts of 20, 33 and 490 tokens (the last crosses 512 positions while decoding, so its
    // attention splits in two); each prefilled alone, on both executors alike.
    const std::vector<uint32_t> lengths{20, 33, 490};
    const uint32_t steps = 40;
    std::vector<std::vector<uint32_t>> pages[2];
    std::vector<int32_t> next(lengths.size());
    std::vector<uint32_t> pos(lengths.size());
    for (int e = 0; e < 2; ++e) {
      auto& x = e ? *graphed : *launched;
      for (size_t i = 0; i < lengths.size(); ++i) {
        pages[e].push_back(*x.kv().kv_page_alloc(x.kv().pages_for_tokens(lengths[i] + steps + 1)));
        auto r = run_blocking(x, {i + 1, {{i, some_prompt(lengths[i], m.config.vocab_size), 0, pages[e][i], true}}});
        REQUIRE_MESSAGE(r.error.empty(), r.error);
        next[i] = sample_token(r.logits[0], {}, lengths[i], nullptr);
        pos[i] = lengths[i];
      }
    }
    for (uint32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      forward_job job[2];
      for (int e = 0; e < 2; ++e) {
        job[e] = {100 + step, {}, forward_job::decode};
        for (size_t i = 0; i < lengths.size(); ++i) {
          if (i == 1 && step >= 10 && step < 20) continue;  // sequence 1 sits out: the batch shrinks to 2
          forward_seq q{i, {next[i]}, pos[i], pages[e][i], true};
          q.sample = seq_sampling{{}, pos[i] + 1, {}};  // greedy, on the device
          if (i == 2) q.sample->cfg.temperature = 0.8f, q.sample->cfg.seed = 5;  // a draw, on the device
          job[e].seqs.push_back(std::move(q));
        }
      }
      const auto a = run_blocking(*launched, job[0]);
      const auto b = run_blocking(*graphed, job[1]);
      REQUIRE_MESSAGE(a.error.empty(), a.error);
      REQUIRE_MESSAGE(b.error.empty(), b.error);
      CHECK(test::same_bits(b.logits, a.logits));
      CHECK(b.tokens == a.tokens);
      for (size_t k = 0; k < job[0].seqs.size(); ++k) {
        const size_t i = job[0].seqs[k].seq_id;
        next[i] = a.tokens[k];
        ++pos[i];
      }
    }
    const uint64_t replays = dynamic_cast<cuda_executor_extras&>(*graphed).graph_replays();
    MESSAGE("bf16 " << bf16 << ": " << replays << " of " << steps << " decode steps ran as a graph launch");
    CHECK(replays >= steps - 8);  // each key's first job runs launched
    CHECK(dynamic_cast<cuda_executor_extras&>(*launched).graph_replays() == 0);
  }
}

TEST_CASE("cuda executor refuses bad work with messages that name it, and a prefix that never arrives fails its job" *
          doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  auto e = cuda_exec(m, true);
  auto pages = *e->kv().kv_page_alloc(4);
  auto bad = run_blocking(*e, {1, {{42, {static_cast<int32_t>(m.config.vocab_size)}, 0, pages, true}}});
  CHECK(bad.error.find("sequence 42: token id") != std::string::npos);
  forward_job big_job{2, {}};
  for (uint64_t id = 43; id < 46; ++id)  // three 200-token prompts: 600 rows
    big_job.seqs.push_back({id, std::vector<int32_t>(200, 5), 0, *e->kv().kv_page_alloc(13), true});
  auto big = run_blocking(*e, std::move(big_job));
  CHECK(big.error == "job 2: 600 rows exceed max_batch_tokens 512");
  auto gate = std::make_shared<streamed_layers_gate>();
  gate->open_through(1);
  forward_seq s{50, {5}, 20, pages, true};  // a 20-token prefix the device has never seen
  s.gate = gate;
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate->abort();
  });
  auto lost = run_blocking(*e, {3, {s}});
  aborter.join();
  CHECK(lost.error == "sequence 50: layer 1 of its cached prefix will not arrive");
  auto again = run_blocking(*e, {4, {{51, {5, 6, 7}, 0, pages, true}}});  // the executor goes on
  CHECK(again.error.empty());
  std::string why;
  cuda_executor_config c;
  c.host_pool = false;
  CHECK_FALSE(make_cuda_executor(m.config, m.weights, c, &why));
  CHECK(why == "cuda executor config: mirror_to_host needs host_pool");
}

TEST_CASE("cuda executor: what sharing a batch does to a sequence's logits (reported)" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  auto e = cuda_exec(m, true, 128);
  auto& kv = e->kv();
  const auto a = some_prompt(30, m.config.vocab_size), b = some_prompt(70, m.config.vocab_size);
  auto pa = *kv.kv_page_alloc(4), pb = *kv.kv_page_alloc(8);
  auto alone = run_blocking(*e, {1, {{1, a, 0, pa, true}}});
  auto shared = run_blocking(*e, {2, {{2, b, 0, pb, true}, {1, a, 0, pa, true}}});
  REQUIRE(alone.error.empty());
  REQUIRE(shared.error.empty());
  // Attention and the element-wise kernels are batch-invariant by construction; the products'
  // cuBLASLt algorithm is fixed per row bucket (the next case), and 30 and 100 rows fall in two
  // buckets, so they need not agree. Measured, not asserted.
  const std::string same = test::same_bits(alone.logits[0], shared.logits[1]) ? " (identical bits)" : "";
  MESSAGE("batch of 1 vs batch of 2: max |dlogit| " << max_diff(alone.logits[0], shared.logits[1]) << same);
  CHECK(max_diff(alone.logits[0], shared.logits[1]) <= 0.05f * max_abs(alone.logits[0]));
}

TEST_CASE("cuda executor picks greedy tokens on the device as sample_token picks them from its own logits, samples the "
          "other rows by the same rules, and returns logits only where asked" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto e = cuda_exec(m, bf16, 128);
    auto& kv = e->kv();
    forward_job plain{1, {}};
    for (uint32_t i = 0; i < 6; ++i)
      plain.seqs.push_back({i, some_prompt(9 + 7 * i, m.config.vocab_size), 0, *kv.kv_page_alloc(4), true});
    const auto ref = run_blocking(*e, plain);
    REQUIRE(ref.error.empty());
    // greedy without logits (the device's pick), greedy with logits, top-k/top-p (the host's),
    // penalties (the host's), a plain draw at a temperature (the device's), no pick
    std::vector<seq_sampling> how(5);
    how[2].cfg = {0.9f, 11, 20, 0.9f};
    how[3].cfg.presence_penalty = 1000.0f;
    how[3].history = plain.seqs[3].tokens;
    how[4].cfg = {1.3f, 21};
    forward_job sampled = plain;
    sampled.job_id = 2;
    for (size_t i = 0; i < how.size(); ++i) {
      how[i].position = static_cast<uint32_t>(plain.seqs[i].tokens.size());
      sampled.seqs[i].sample = how[i];
      sampled.seqs[i].want_logits = i == 1;
    }
    const auto got = run_blocking(*e, sampled);
    REQUIRE(got.error.empty());
    for (size_t i = 0; i < how.size(); ++i) {
      CAPTURE(i);
      CHECK(got.tokens[i] == sample_token(ref.logits[i], how[i]));
      CHECK(got.logits[i].empty() == (i != 1));
    }
    CHECK(got.tokens[5] == -1);
    CHECK(got.logits[5].size() == m.config.vocab_size);
    // Log-probabilities take a greedy row and a plain draw off the device: the same picks, and
    // logprobs_of over the row the host got.
    auto scored = sampled;
    scored.job_id = 3;
    for (size_t i : {0u, 4u}) {
      scored.seqs[i].sample->want_logprobs = true;
      scored.seqs[i].sample->top_logprobs = 3;
    }
    const auto lp = run_blocking(*e, scored);
    REQUIRE(lp.error.empty());
    REQUIRE(lp.logprobs.size() == scored.seqs.size());
    for (size_t i : {0u, 4u}) {
      CAPTURE(i);
      CHECK(lp.tokens[i] == got.tokens[i]);
      const auto want = logprobs_of(ref.logits[i], lp.tokens[i], 3);
      CHECK(lp.logprobs[i].logprob == want.logprob);
      CHECK(lp.logprobs[i].top_tokens == want.top_tokens);
      CHECK(lp.logprobs[i].top_logprobs == want.top_logprobs);
    }
    CHECK(lp.logprobs[1].top_tokens.empty());  // not asked
    // Constrained rows (a JSON grammar, greedy and drawn) are picked on the host over the tokens
    // the grammar allows: the picks sample_token makes from the row, each one allowed.
    std::string why;
    const auto tok = load_model_tokenizer(source_dir() + "/models/baton-kjv-tiny", m.config, &why);
    REQUIRE_MESSAGE(tok, why);
    const auto grammar = compile_output_grammar(output_format::object, "", {}, &why);
    auto constrained = sampled;
    constrained.job_id = 4;
    for (size_t i : {0u, 4u})
      constrained.seqs[i].sample->grammar = std::make_shared<grammar_matcher>(
          grammar, tok->vocabulary(), std::vector<int32_t>{m.config.eos_token_id});
    const auto c = run_blocking(*e, constrained);
    REQUIRE(c.error.empty());
    for (size_t i : {0u, 4u}) {
      CAPTURE(i);
      CHECK(c.tokens[i] == sample_token(ref.logits[i], *constrained.seqs[i].sample));
      CHECK(constrained.seqs[i].sample->grammar->allows(c.tokens[i]));
    }
  }
}

TEST_CASE("cuda executor scores a prompt's rows (echo with logprobs) as the logits of each prefix alone give them, "
          "beside a sequence that picks a token" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  auto e = cuda_exec(m, false, 128);
  auto& kv = e->kv();
  const auto p = some_prompt(40, m.config.vocab_size);
  const auto n = static_cast<uint32_t>(p.size());
  std::vector<token_logprobs> ref;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(i + 1));
    auto got = run_blocking(*e, forward_job{1, {forward_seq{1, {p.begin(), p.begin() + i + 1}, 0, pages, true}}});
    kv.kv_page_free(pages);
    REQUIRE(got.error.empty());
    ref.push_back(logprobs_of(got.logits[0], p[i + 1], 3));
  }
  forward_seq scored{1, p, 0, *kv.kv_page_alloc(kv.pages_for_tokens(n)), false};
  for (uint32_t q = 0; q < n; ++q) scored.score_targets.push_back(q + 1 < n ? p[q + 1] : -1);
  scored.score_top = 3;
  scored.sample = seq_sampling{};
  scored.sample->position = n;
  forward_seq picker{2, some_prompt(9, m.config.vocab_size), 0, *kv.kv_page_alloc(1), false};
  picker.sample = seq_sampling{};
  picker.sample->position = 9;
  const auto got = run_blocking(*e, forward_job{2, {picker, scored}});
  REQUIRE(got.error.empty());
  REQUIRE(got.scores.size() == 2);
  CHECK(got.scores[0].empty());
  REQUIRE(got.scores[1].size() == n - 1);
  for (uint32_t i = 0; i + 1 < n; ++i) {
    CAPTURE(i);
    CHECK(got.scores[1][i].logprob == doctest::Approx(ref[i].logprob).epsilon(1e-4));
    CHECK(got.scores[1][i].top_tokens == ref[i].top_tokens);
  }
  CHECK(got.tokens[0] >= 0);
  CHECK(got.tokens[1] >= 0);
}

TEST_CASE("cuda executor: within a row bucket of the matrix products a sequence's logits do not depend on what shares "
          "its batch, bit for bit" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto e = cuda_exec(m, bf16, 128);
    auto& kv = e->kv();
    // 30 rows alone, then 30 + 20 (bucket 9..64); 100 alone, then 100 + 150 (bucket 65..512).
    for (const auto& [alone_rows, other_rows] : {std::pair{30u, 20u}, std::pair{100u, 150u}}) {
      CAPTURE(alone_rows);
      const auto a = some_prompt(alone_rows, m.config.vocab_size), b = some_prompt(other_rows, m.config.vocab_size - 1);
      auto pa = *kv.kv_page_alloc(alone_rows / 16 + 1), pb = *kv.kv_page_alloc(other_rows / 16 + 1);
      const auto alone = run_blocking(*e, {1, {{1, a, 0, pa, true}}});
      const auto shared = run_blocking(*e, {2, {{2, b, 0, pb, true}, {1, a, 0, pa, true}}});
      REQUIRE(alone.error.empty());
      REQUIRE(shared.error.empty());
      CHECK(test::same_bits(alone.logits[0], shared.logits[1]));
      kv.kv_page_free(pa);
      kv.kv_page_free(pb);
    }
  }
}

TEST_CASE("cuda executor with tensor-core attention for prefill rows: logits within bf16 rounding of the CUDA-core "
          "kernel's (greedy text reported)" * doctest::skip(no_gpu)) {
  auto m = load(source_dir() + "/models/baton-kjv-tiny");  // head_dim 64: supported
  REQUIRE(cuda::flash_attention_supported(m.config.head_dim, cuda::dtype::bf16));
  cuda_executor_config c;
  c.num_kv_pages = 64;
  c.max_batch_tokens = 512;
  c.flash_attention = false;  // the default is on
  std::string why;
  auto plain = make_cuda_executor(m.config, m.weights, c, &why);
  REQUIRE_MESSAGE(plain, why);
  c.flash_attention = true;
  auto flash = make_cuda_executor(m.config, m.weights, c, &why);
  REQUIRE_MESSAGE(flash, why);
  const auto prompt = some_prompt(150, m.config.vocab_size);  // three tiles of 64, 64 and 22 rows
  const auto a = generate_colocated(*plain, prompt, 16, 150, {}, true);
  const auto b = generate_colocated(*flash, prompt, 16, 150, {}, true);
  REQUIRE(a.error.empty());
  REQUIRE(b.error.empty());
  // The prefill's logits: the kernels differ in rounding (bf16 probabilities here), not in math.
  CHECK(max_diff(a.step_logits[0], b.step_logits[0]) <= 0.05f * max_abs(a.step_logits[0]));
  MESSAGE("prefill logits, flash vs CUDA cores: max |d| " << max_diff(a.step_logits[0], b.step_logits[0]) << " of "
                                                           << max_abs(a.step_logits[0]));
  // Greedy text: reported, not asserted (a near-tie of this tiny model may move a token).
  size_t same = 0;
  while (same < std::min(a.tokens.size(), b.tokens.size()) && a.tokens[same] == b.tokens[same]) ++same;
  MESSAGE("greedy tokens equal for the first " << same << " of " << a.tokens.size());
}

namespace {

/// A tiny DeepSeek (MLA with a low-rank query, dense first layer, shared and routed experts) on
/// the byte vocabulary, with seeded weights: V3's gating when `v3`, else V2's.
hf_model seeded_deepseek(bool v3) {
  hf_model m;
  m.config = deepseek_tiny_config(v3);
  m.weights = std::make_shared<model_weights>(make_seeded_weights(m.config, 11));
  return m;
}

}  // namespace

TEST_CASE("cuda executor runs DeepSeek-V2 and V3 (latent attention over the latent KV, routed and shared experts): "
          "fp32 logits within 1e-4 of the CPU executor's largest and its greedy tokens for 32 steps; bf16 close" *
          doctest::skip(no_gpu)) {
  for (bool v3 : {false, true}) {
    CAPTURE(v3);
    auto m = seeded_deepseek(v3);
    auto cpu = make_cpu_executor(m.config, m.weights, {});
    const auto prompt = some_prompt(40, m.config.vocab_size);
    const auto c = generate_colocated(*cpu, prompt, 32, 16, {}, true);  // a chunked prefill, then decode
    REQUIRE(c.error.empty());
    for (const auto& [bf16, tc] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
      CAPTURE(bf16);
      CAPTURE(tc);  // the routed experts' products on the tensor cores
      auto gpu = cuda_exec(m, bf16);
      dynamic_cast<cuda_executor_extras&>(*gpu).set_moe_tensor_cores(tc);
      const auto g = generate_colocated(*gpu, prompt, 32, 16, {}, true);
      REQUIRE_MESSAGE(g.error.empty(), g.error);
      size_t same = 0;
      while (same < g.tokens.size() && g.tokens[same] == c.tokens[same]) ++same;
      float worst = 0;  // over the steps both took with the same tokens
      for (size_t i = 0; i <= std::min(same, g.step_logits.size() - 1); ++i)
        worst = std::max(worst, max_diff(g.step_logits[i], c.step_logits[i]) / max_abs(c.step_logits[i]));
      // One string first: doctest's MESSAGE applies its builder with `*`, which binds tighter.
      const std::string what = std::string{v3 ? "V3" : "V2"} + (bf16 ? " bf16" : " fp32") +
                               (tc ? " (experts on tensor cores)" : "");
      MESSAGE(what << ": max |dlogit| / max |logit| " << worst
                                 << ", greedy tokens equal for " << same << " of " << c.tokens.size());
      if (!bf16) {
        CHECK(worst <= 1e-4f);
        CHECK(g.tokens == c.tokens);
      } else {
        // bf16 weights, KV and products against fp32 throughout; a row whose routing flips under
        // bf16 rounding moves its logits more than rounding does, so the bound only catches garbage.
        // V3's sigmoid gating with a correction bias flips most: on the H200 (2026-12-04) this case
        // measured 0.015 for V2 and 0.376 for V3, and transformers' own bf16 run of its tiny V3
        // reference differs from its fp32 run by 4.55 of a largest logit of 8.38 (0.54).
        CHECK(worst <= (v3 ? 0.6f : 0.1f));
      }
    }
  }
}

TEST_CASE("cuda executor, DeepSeek: disaggregated equals colocated bit for bit with the latent as the only KV shipped, "
          "and a decode row's logits do not depend on the rows sharing its step" * doctest::skip(no_gpu)) {
  auto m = seeded_deepseek(true);
  REQUIRE(m.config.kv_planes() == 1);
  const auto prompt = some_prompt(45, m.config.vocab_size);
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    same_as_colocated(m, bf16, prompt);
    // Decode steps of sequence 1 alone and beside sequence 2: the experts see other rows, the
    // routing plan changes, the row's bits do not (with the experts on either kind of core).
    for (bool tc : {false, true}) {
      CAPTURE(tc);
      auto e = cuda_exec(m, bf16);
      dynamic_cast<cuda_executor_extras&>(*e).set_moe_tensor_cores(tc);
      auto& kv = e->kv();
      const auto a = some_prompt(20, m.config.vocab_size), b = some_prompt(33, m.config.vocab_size - 3);
      auto pa = *kv.kv_page_alloc(3), pb = *kv.kv_page_alloc(4);
      REQUIRE(run_blocking(*e, {1, {{1, a, 0, pa, false}}}).error.empty());
      REQUIRE(run_blocking(*e, {2, {{2, b, 0, pb, false}}}).error.empty());
      const auto alone = run_blocking(*e, {3, {{1, {65}, 20, pa, true}}});
      const auto beside = run_blocking(*e, {4, {{2, {66}, 33, pb, true}, {1, {65}, 20, pa, true}}});
      REQUIRE(alone.error.empty());
      REQUIRE(beside.error.empty());
      CHECK(test::same_bits(alone.logits[0], beside.logits[1]));
    }
  }
}

// No device needed: the libraries load on any machine with the CUDA toolkit this build used.
TEST_CASE("cuBLAS and cuBLASLt load on demand with every entry point the executor calls, once per process") {
  std::string why;
  const auto* lib = cuda::load_blas(&why);
  REQUIRE_MESSAGE(lib, why);
#define BATON_CHECK_LOADED(f) CHECK_MESSAGE(static_cast<bool>(lib->f), #f);
  BATON_CUBLAS_FUNCTIONS(BATON_CHECK_LOADED)
  BATON_CUBLASLT_FUNCTIONS(BATON_CHECK_LOADED)
#undef BATON_CHECK_LOADED
  CHECK(static_cast<bool>(lib->cublasGemmEx));
  CHECK(cuda::load_blas(nullptr) == lib);  // loaded once: the same table
  std::ifstream maps{"/proc/self/maps"};
  std::string line;
  bool mapped = false;
  while (std::getline(maps, line)) mapped = mapped || line.find("libcublasLt.so") != std::string::npos;
  CHECK(mapped);
}
