// `baton profile`: measures the executor in use over a grid of (q new tokens, c cached tokens)
// prefills and (sequences, context) decode steps, fits the cost models by least squares, reports
// the fit's error on held-out grid points, and writes the profile file balancers and sims load.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <numeric>

#include <unistd.h>

#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/profile_file.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"

namespace baton::deploy {

namespace {

struct profile_options {
  gpu::cpu_executor_config executor;
  uint64_t weights_seed = 20261130;
  std::string out = "baton-profile.json";
  uint32_t repeats = 3;         ///< timings per grid point; the median is kept
  uint32_t held_out_every = 4;  ///< every n-th grid point is held out of the fit
  bool quick = false;           ///< a small grid (smoke test)
};

std::vector<int32_t> filler_tokens(uint32_t n, uint32_t offset) {
  std::vector<int32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(32 + (i * 7 + offset) % 95);
  return t;
}

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs[xs.size() / 2];
}

/// Times `job` `repeats` times; microseconds, median. Re-running a job rewrites the same KV
/// positions with the same values, so every repeat does identical work.
bool time_job(gpu::executor& exec, const gpu::forward_job& job, uint32_t repeats, double* us, std::string* why) {
  std::vector<double> t;
  for (uint32_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    auto out = gpu::run_blocking(exec, job);
    const auto end = std::chrono::steady_clock::now();
    if (!out.error.empty()) {
      *why = out.error;
      return false;
    }
    t.push_back(std::chrono::duration<double, std::micro>(end - start).count());
  }
  *us = median(std::move(t));
  return true;
}

std::string utc_now() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

int run_profile(const std::vector<std::string>& args) {
  profile_options opt;
  flag_set flags;
  flags.add("--executor-threads", &opt.executor.num_threads, "math threads of the executor being profiled");
  flags.add("--weights-seed", &opt.weights_seed, "seed of the profiled random model's weights");
  flags.add("--out", &opt.out, "where to write the profile (JSON)");
  flags.add("--repeats", &opt.repeats, "timings per grid point (the median is kept)");
  flags.add("--held-out-every", &opt.held_out_every, "hold every n-th grid point out of the fit (>= 2)");
  flags.add("--quick", &opt.quick, "a small grid, for smoke tests");
  if (auto rc = flags.parse_command_line(args, "profile", "baton profile [flags]")) return *rc;
  if (opt.repeats == 0 || opt.held_out_every < 2) {
    std::fprintf(stderr, "baton profile: --repeats must be >= 1 and --held-out-every >= 2\n");
    return 2;
  }

  const auto model = gpu::builtin_tiny_config();
  const uint32_t ctx_limit = model.max_position_embeddings;
  std::vector<uint32_t> qs = {16, 32, 64, 128, 256, 512, 1024, 1536, 2048};
  std::vector<uint32_t> cs = {0, 256, 512, 1024};
  std::vector<uint32_t> decode_seqs = {1, 4, 8, 16};
  std::vector<uint32_t> decode_ctx = {64, 256, 1024};
  if (opt.quick) {
    qs = {16, 64, 256};
    cs = {0, 256};
    decode_seqs = {1, 4};
    decode_ctx = {64, 256};
  }
  // Enough pages for the largest decode batch (16 × 1024 tokens) or the longest prefill.
  const uint32_t max_tokens = std::max<uint32_t>(decode_seqs.back() * (decode_ctx.back() + 1), ctx_limit);
  opt.executor.num_kv_pages = max_tokens / opt.executor.page_size_tokens + decode_seqs.back() + 1;
  if (auto err = opt.executor.validate(); !err.empty()) {
    std::fprintf(stderr, "baton profile: %s\n", err.c_str());
    return 2;
  }
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(model, opt.weights_seed));
  auto exec = gpu::make_cpu_executor(model, weights, opt.executor);
  auto& kv = exec->kv();
  std::printf("baton profile: %s on model %s (%u layers, hidden %u), %u repeat(s) per point\n",
              exec->describe().c_str(), model.name.c_str(), model.num_hidden_layers, model.hidden_size, opt.repeats);

  executor_profile prof;
  prof.executor = exec->describe();
  prof.model = model.name + " (" + std::to_string(model.num_hidden_layers) + " layers, hidden " +
               std::to_string(model.hidden_size) + ")";
  prof.machine = host_name();
  prof.date = utc_now();
  std::string why;
  uint64_t job_id = 0;

  // Prefill grid: the prefix of c tokens is computed once (untimed), then q tokens on top.
  for (uint32_t c : cs)
    for (uint32_t q : qs) {
      if (q + c > ctx_limit) continue;
      auto pages = kv.kv_page_alloc(kv.pages_for_tokens(q + c));
      if (!pages) {
        std::fprintf(stderr, "baton profile: KV pool too small for q=%u c=%u\n", q, c);
        return 1;
      }
      const auto tokens = filler_tokens(q + c, c);
      if (c > 0) {
        auto out = gpu::run_blocking(*exec, {++job_id, {{1, {tokens.begin(), tokens.begin() + c}, 0, *pages, false}}});
        if (!out.error.empty()) {
          std::fprintf(stderr, "baton profile: prefix prefill failed: %s\n", out.error.c_str());
          return 1;
        }
      }
      gpu::forward_job job{++job_id, {{1, {tokens.begin() + c, tokens.end()}, c, *pages, true}}};
      double us = 0;
      if (!time_job(*exec, job, opt.repeats, &us, &why)) {
        std::fprintf(stderr, "baton profile: prefill q=%u c=%u failed: %s\n", q, c, why.c_str());
        return 1;
      }
      kv.kv_page_free(*pages);
      prof.prefill_samples.push_back({q, c, us});
      std::printf("  prefill q=%5u c=%5u  %10.1f us\n", q, c, us);
    }

  // Decode grid: n sequences of ctx tokens each, one new token per sequence.
  for (uint32_t n : decode_seqs)
    for (uint32_t ctx : decode_ctx) {
      gpu::forward_job step{++job_id, {}, gpu::forward_job::decode};
      std::vector<std::vector<uint32_t>> owned;
      for (uint32_t s = 0; s < n; ++s) {
        auto pages = kv.kv_page_alloc(kv.pages_for_tokens(ctx + 1));
        if (!pages) {
          std::fprintf(stderr, "baton profile: KV pool too small for %u x %u\n", n, ctx);
          return 1;
        }
        const auto tokens = filler_tokens(ctx + 1, s);
        auto out = gpu::run_blocking(*exec, {++job_id, {{s, {tokens.begin(), tokens.begin() + ctx}, 0, *pages, false}}});
        if (!out.error.empty()) {
          std::fprintf(stderr, "baton profile: context prefill failed: %s\n", out.error.c_str());
          return 1;
        }
        step.seqs.push_back({s, {tokens.back()}, ctx, *pages, true});
        owned.push_back(*pages);
      }
      double us = 0;
      if (!time_job(*exec, step, opt.repeats, &us, &why)) {
        std::fprintf(stderr, "baton profile: decode %u x %u failed: %s\n", n, ctx, why.c_str());
        return 1;
      }
      for (auto& p : owned) kv.kv_page_free(p);
      prof.decode_samples.push_back({n, uint64_t{n} * (ctx + 1), us});
      std::printf("  decode  seqs=%3u ctx=%5u  %10.1f us\n", n, ctx, us);
    }

  // Fit on most points; judge on the held-out rest.
  auto split = [&](const auto& all, auto& fit, auto& held) {
    for (size_t i = 0; i < all.size(); ++i) (i % opt.held_out_every == opt.held_out_every - 1 ? held : fit).push_back(all[i]);
  };
  std::vector<policies::prefill_sample> pf, ph;
  std::vector<policies::decode_sample> df, dh;
  split(prof.prefill_samples, pf, ph);
  split(prof.decode_samples, df, dh);
  auto prefill = policies::fit_cost_model(pf, &why);
  if (!prefill) {
    std::fprintf(stderr, "baton profile: prefill fit failed: %s\n", why.c_str());
    return 1;
  }
  auto decode = policies::fit_decode_cost_model(df, &why);
  if (!decode) {
    std::fprintf(stderr, "baton profile: decode fit failed: %s\n", why.c_str());
    return 1;
  }
  prof.prefill = *prefill;
  prof.decode = *decode;
  prof.prefill_held_out = policies::evaluate(*prefill, ph);
  prof.decode_held_out = policies::evaluate(*decode, dh);
  std::printf("prefill: cost(q, c) = %.4g q^2 + %.4g q c + %.4g q + %.4g us; held-out error mean %.1f%% max %.1f%% "
              "(%zu points)\n",
              prefill->alpha_us, prefill->beta_us, prefill->gamma_us, prefill->delta_us, 100 * prof.prefill_held_out.mean_rel,
              100 * prof.prefill_held_out.max_rel, prof.prefill_held_out.count);
  std::printf("decode:  step(n, ctx) = %.4g + %.4g n + %.4g ctx us; held-out error mean %.1f%% max %.1f%% (%zu points)\n",
              decode->step_base_us, decode->per_seq_us, decode->per_context_token_us,
              100 * prof.decode_held_out.mean_rel, 100 * prof.decode_held_out.max_rel, prof.decode_held_out.count);
  if (auto err = write_profile(opt.out, prof); !err.empty()) {
    std::fprintf(stderr, "baton profile: %s\n", err.c_str());
    return 1;
  }
  std::printf("wrote %s\n", opt.out.c_str());
  // The samples are kept, but a profile that --cost-profile refuses must not look like success.
  if (!prefill->usable() || !decode->usable()) {
    std::fprintf(stderr, "baton profile: the %s fit has a negative coefficient, so --cost-profile will refuse %s; "
                 "measure with more repeats\n", !prefill->usable() ? "prefill" : "decode", opt.out.c_str());
    return 1;
  }
  return 0;
}

}  // namespace baton::deploy
