// CPU executor throughput next to the machine's ceilings, measured in the same run:
//   - OpenBLAS sgemm at the executor's matrix shapes (the compute ceiling for prefill),
//   - our fixed-order matmul at the same shapes (what batch invariance costs),
//   - memcpy bandwidth (the ceiling for batch-1 decode, which streams every weight once).
// Prints a markdown table for docs/perf.md. Usage: baton_bench_cpu [--threads N] [--quick] [--0.5b]
// (--0.5b adds a ~0.47B-parameter Llama shape: 1.9 GB of fp32 weights, a minute or two).

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu/cpu_executor.hpp"
#include "gpu/cpu_kernels.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/local_generate.hpp"
#include "gpu/sampling.hpp"
#include "gpu/thread_pool.hpp"
#include "bench/bench_flags.hpp"
#include "bench/bench_models.hpp"

extern "C" void openblas_set_num_threads(int);

using namespace baton::gpu;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Best of `reps` timings of fn (seconds).
template <class F>
double best_of(int reps, F&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = clock_type::now();
    fn();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

void gemm_row(const char* what, size_t m, size_t n, size_t k, unsigned threads) {
  std::vector<float> a(m * k, 0.5f), b(n * k, 0.25f), c(m * n);
  const double flops = 2.0 * static_cast<double>(m) * n * k;
  openblas_set_num_threads(static_cast<int>(threads));
  const double t_blas = best_of(5, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a.data(), static_cast<int>(k), b.data(), static_cast<int>(k), 0.0f,
                c.data(), static_cast<int>(n));
  });
  thread_pool pool{threads};
  const double t_ours = best_of(5, [&] { matmul_nt(a.data(), m, k, b.data(), n, c.data(), &pool); });
  std::printf("| %s | %zux%zux%zu | %.1f | %.1f | %.0f %% |\n", what, m, n, k, flops / t_blas / 1e9,
              flops / t_ours / 1e9, 100.0 * t_blas / t_ours);
}

/// Reading 512 MiB once with `threads` threads (each a share, summed in 8 lanes): what a decode
/// step does with its weights and KV, so the ceiling of its "GB/s" column.
double read_gbps(unsigned threads) {
  const size_t n = (size_t{512} << 20) / sizeof(float);
  std::vector<float> src(n, 1.0f);
  std::vector<float> sums(threads);
  const double t = best_of(3, [&] {
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < threads; ++w)
      pool.emplace_back([&, w] {
        float lane[8] = {};
        for (size_t i = n * w / threads; i + 8 <= n * (w + 1) / threads; i += 8)
          for (int j = 0; j < 8; ++j) lane[j] += src[i + j];
        sums[w] = lane[0] + lane[1] + lane[2] + lane[3] + lane[4] + lane[5] + lane[6] + lane[7];
      });
    for (auto& th : pool) th.join();
  });
  if (sums[0] < 0) std::printf("?");  // keeps the sums alive
  return static_cast<double>(n * sizeof(float)) / t / 1e9;
}

double memcpy_gbps() {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const double t = best_of(3, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  return 2.0 * static_cast<double>(bytes) / t / 1e9;  // bytes read + bytes written
}

/// Runs one job; a refused one ends the benchmark, naming why: timed, it would report the
/// refusal's speed (the decode rows once did, past a model's context: 995,985 tok/s).
void run_checked(executor& exec, forward_job job, const char* what) {
  if (auto out = run_blocking(exec, std::move(job)); !out.error.empty()) {
    std::fprintf(stderr, "cpu bench: %s: the executor refused the job: %s\n", what, out.error.c_str());
    std::exit(1);
  }
}

void model_rows(const model_config& cfg, unsigned threads, uint32_t prompt_len, double mem_gbps, bool quick,
                std::shared_ptr<const model_weights> loaded = nullptr) {
  auto weights = loaded ? loaded : std::make_shared<const model_weights>(make_seeded_weights(cfg, 1));
  auto exec = make_cpu_executor(cfg, weights, cpu_executor_config{.num_threads = threads, .num_kv_pages = 512, .page_size_tokens = 16});
  std::vector<int32_t> prompt(prompt_len);
  for (uint32_t i = 0; i < prompt_len; ++i) prompt[i] = static_cast<int32_t>((i * 7919) % std::min(250u, cfg.vocab_size));
  // Per token, the decoder layers multiply every layer weight once (2 FLOPs each); the LM head
  // runs once per sequence and the embedding is a lookup, so neither counts here.
  const uint64_t head = uint64_t{cfg.vocab_size} * cfg.hidden_size;
  const uint64_t layer_params = cfg.num_parameters() - head * (cfg.tie_word_embeddings ? 1 : 2) - cfg.hidden_size;
  const double matmul_flops_per_token = 2.0 * static_cast<double>(layer_params);
  auto& kv = exec->kv();
  auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(prompt_len + 64));
  const int reps = quick ? 1 : 3;
  const double t_prefill = best_of(reps, [&] {
    run_checked(*exec, forward_job{1, {forward_seq{1, prompt, 0, pages, true}}}, "prefill");
  });
  std::printf("| %s | prefill %u tokens | %u | %.0f tok/s | %.1f GFLOP/s (matmul part) |\n", cfg.name.c_str(),
              prompt_len, threads, prompt_len / t_prefill, matmul_flops_per_token * prompt_len / t_prefill / 1e9);
  // Prompt scoring (echo with logprobs): the same prefill with every row's log-probabilities,
  // next to the plain prefill above, its ceiling; the LM head over every row adds its FLOPs.
  forward_seq scored{1, prompt, 0, pages, false};
  for (uint32_t i = 0; i < prompt_len; ++i) scored.score_targets.push_back(i + 1 < prompt_len ? prompt[i + 1] : -1);
  scored.score_top = 1;
  const double t_scored = best_of(reps, [&] { run_checked(*exec, forward_job{1, {scored}}, "scored prefill"); });
  const double head_share = static_cast<double>(head) / static_cast<double>(layer_params);
  std::printf("| %s | prefill %u tokens, every row scored | %u | %.0f tok/s | %.2fx the plain prefill's time (the head "
              "adds %.0f %% of the layers' FLOPs) |\n",
              cfg.name.c_str(), prompt_len, threads, prompt_len / t_scored, t_scored / t_prefill, 100.0 * head_share);
  const uint32_t steps = quick ? 4 : 16;
  // The decode steps' context: the prompt's, less the steps where the prompt fills the model's
  // context (the built-in model's is 256): positions past it are refused.
  const uint32_t context = std::min(prompt_len, cfg.max_position_embeddings - steps);
  for (uint32_t batch : {1u, 8u}) {
    std::vector<std::vector<uint32_t>> seq_pages(batch, pages);
    std::vector<std::vector<uint32_t>> own;
    for (uint32_t b = 1; b < batch; ++b) {
      own.push_back(*kv.kv_page_alloc(kv.pages_for_tokens(prompt_len + 64)));
      run_checked(*exec, forward_job{1, {forward_seq{b + 1, prompt, 0, own.back(), false}}}, "prefill");
      seq_pages[b] = own.back();
    }
    auto t0 = clock_type::now();
    for (uint32_t s = 0; s < steps; ++s) {
      forward_job job{2, {}, forward_job::decode};
      for (uint32_t b = 0; b < batch; ++b) job.seqs.push_back({b + 1, {65}, context + s, seq_pages[b], true});
      run_checked(*exec, std::move(job), "decode step");
    }
    const double per_step = seconds_since(t0) / steps;
    // A decode step streams every layer weight and the LM head once, whatever the batch, and
    // each sequence's cached K and V (fp32) once per layer: at batch 8 and a 512-token context
    // the cache is most of what a step of the ~100M shape reads.
    const double weight_bytes = static_cast<double>(layer_params + head) * sizeof(float);
    const double kv_bytes = static_cast<double>(batch) * (context + steps / 2.0) * cfg.num_hidden_layers *
                            cfg.kv_values_per_token() * sizeof(float);
    std::printf("| %s | decode batch %u, context %u | %u | %.0f tok/s | %.1f GB/s of weights + %.1f of KV = %.1f "
                "(read %.1f) |\n",
                cfg.name.c_str(), batch, context, threads, batch / per_step, weight_bytes / per_step / 1e9,
                kv_bytes / per_step / 1e9, (weight_bytes + kv_bytes) / per_step / 1e9, mem_gbps);
    for (auto& p : own) kv.kv_page_free(p);
  }
}

/// Picking one token from a row of 151,936 logits (Qwen's vocabulary), per sampling setting,
/// next to the pass every draw needs (one exp per logit, in double) and to what sorting the whole
/// vocabulary costs (what top-k and top-p did before they sorted only the prefix they read).
void sampling_rows(bool quick) {
  // A peaked row, as a language model's is: a long tail around 0 (a sum of two uniforms, about
  // +-4) and 200 tokens lifted by 4 to 12.
  std::vector<float> logits(151936);
  uint32_t s = 7;
  auto uniform = [&] {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / 16777216.0f;
  };
  for (auto& x : logits) x = 4.0f * (uniform() + uniform() - 1.0f);
  for (int i = 0; i < 200; ++i) logits[static_cast<size_t>(uniform() * 151935)] += 4.0f + 8.0f * uniform();
  const int reps = quick ? 5 : 20;
  auto per_row_us = [&](auto&& fn) { return best_of(3, [&] { for (int i = 0; i < reps; ++i) fn(i); }) / reps * 1e6; };
  std::vector<double> p(logits.size());
  const double exp_pass = per_row_us([&](int) {
    for (size_t i = 0; i < logits.size(); ++i) p[i] = std::exp((static_cast<double>(logits[i]) - 10.0) / 0.7);
  });
  std::vector<uint32_t> idx(logits.size());
  const double full_sort = per_row_us([&](int) {
    for (uint32_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return p[a] > p[b]; });
  });
  std::printf("\n| sampling one row of 151,936 logits | us per row, fresh buffers | us per row, reused scratch | one exp pass over the row | a full sort of the row |\n");
  std::printf("|---|---|---|---|---|\n");
  const struct {
    const char* name;
    sampling_config cfg;
  } rows[] = {{"greedy", {}},
              {"temperature 0.7", {0.7f, 1}},
              {"temperature 0.7, top-k 50", {0.7f, 1, 50}},
              {"temperature 0.7, top-p 0.9", {0.7f, 1, 0, 0.9f}},
              {"temperature 0.7, top-k 50, top-p 0.9", {0.7f, 1, 50, 0.9f}}};
  for (const auto& r : rows) {
    const double us = per_row_us([&](int i) { (void)sample_token(logits, r.cfg, static_cast<uint32_t>(i)); });
    sampling_scratch scratch;  // as an executor's sampler thread keeps it
    const double us_scratch =
        per_row_us([&](int i) { (void)sample_token(logits, r.cfg, static_cast<uint32_t>(i), {}, &scratch); });
    std::printf("| %s | %.0f | %.0f | %.0f | %.0f |\n", r.name, us, us_scratch, exp_pass, full_sort);
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t threads = 1;
  bool quick = false, with_500m = false;
  baton::deploy::flag_set flags;
  flags.add("--threads", &threads, "executor and OpenBLAS threads");
  flags.add("--quick", &quick, "fewer repetitions");
  flags.add("--0.5b", &with_500m, "also the 0.5B model (Qwen2.5-0.5B's shape, seeded weights)");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--threads N] [--quick] [--0.5b]")) return *rc;
  if (threads == 0) return std::fprintf(stderr, "baton_bench_cpu: --threads must be at least 1\n"), 2;
  std::printf("## CPU executor, %u thread(s)\n\n", threads);
  std::printf("| matmul | m x n x k | OpenBLAS sgemm GFLOP/s | Baton matmul_nt GFLOP/s | ours / OpenBLAS |\n");
  std::printf("|---|---|---|---|---|\n");
  gemm_row("prefill, 100M q-proj", 512, 768, 768, threads);
  gemm_row("prefill, 100M mlp-up", 512, 2048, 768, threads);
  gemm_row("decode batch 8, mlp-up", 8, 2048, 768, threads);
  gemm_row("decode batch 1, mlp-up", 1, 2048, 768, threads);
  const double mem = read_gbps(threads);
  std::printf("\nmemcpy (512 MiB, read + write): %.1f GB/s; read (512 MiB, %u thread(s)): %.1f GB/s\n\n", memcpy_gbps(),
              threads, mem);
  std::printf("| model | work | threads | throughput | vs ceiling |\n|---|---|---|---|---|\n");
  // The built-in model as `baton local` serves it (the trained directory when it is there).
  hf_model builtin;
  std::string why;
  if (load_hf_model(BATON_MODELS_DIR "/baton-kjv-tiny", &builtin, &why))
    model_rows(builtin.config, threads, 256, mem, quick, builtin.weights);
  else
    model_rows(builtin_tiny_config(), threads, 256, mem, quick);
  model_rows(llama_100m_config(), threads, quick ? 128 : 512, mem, quick);
  sampling_rows(quick);
  if (with_500m) {
    gemm_row("prefill, 0.5B mlp-up", 256, 2816, 1024, threads);
    model_rows(baton::bench::llama_500m_config(), threads, 256, mem, quick);
  }
  return 0;
}
