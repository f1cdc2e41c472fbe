// One-token requests (max_tokens 1: scoring and classification calls) through a local cluster,
// answered by the prefill rank alone (request_config::single_token_prefill_only, the default)
// and through a decode rank as well (the KV shipped, a lease reserved and released), against the
// ceiling both chase: the same prompts' prefills on one executor alone, back to back, in the same
// run. Built-in model, 1 prefill + 1 decode rank, CPU executor with 1 thread each.
// Usage: baton_bench_one_token [--requests N] [--tokens T] [--transport loopback|ucx]

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "bench/bench_system.hpp"
#include "gpu/cpu_executor.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

/// Prompt i: <bos> and `tokens - 1` letters in an order of its own, so no two share a prefix.
std::vector<int32_t> prompt_of(const gpu::model_config& m, uint32_t i, uint32_t tokens) {
  std::vector<int32_t> p{m.bos_token_id};
  for (uint32_t k = 1; k < tokens; ++k) p.push_back(static_cast<int32_t>('a' + (k * (2 * i + 3) + i) % 26));
  return p;
}

/// Counts finished executor jobs; wait() returns once `n` are done (false if one failed).
class counting_sink final : public gpu::executor_sink {
public:
  void on_layer_kv_ready(uint64_t, uint32_t) override {}
  void on_done(uint64_t, gpu::forward_output) override { finish(true); }
  void on_failed(uint64_t, std::string what) override {
    std::fprintf(stderr, "baton_bench_one_token: the executor failed: %s\n", what.c_str());
    finish(false);
  }
  bool wait(uint32_t n) {
    std::unique_lock<std::mutex> lock{mutex_};
    cv_.wait(lock, [&] { return done_ >= n; });
    return ok_;
  }

private:
  void finish(bool ok) {
    std::lock_guard<std::mutex> lock{mutex_};
    ++done_;
    ok_ = ok_ && ok;
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  uint32_t done_ = 0;
  bool ok_ = true;
};

struct run_result {
  double seconds = 0;
  std::vector<double> ttft_ms;
  uint64_t kv_bytes = 0;
  uint32_t via_decode = 0;  ///< answers that named a decode rank
  uint32_t failed = 0;
};

run_result run_cluster(const local_cluster_config& cfg, uint32_t requests, uint32_t tokens) {
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{bench::cluster_system_config(sys_cfg)};
  auto cluster = start_local_cluster(sys, cfg);
  run_result out;
  {
    caf::scoped_actor self{sys};
    // Warm-up: one request, so that both clusters start measured work with their ranks known.
    generate_request warm;
    warm.prompt_tokens = prompt_of(cfg.model, requests, tokens);
    warm.max_tokens = 1;
    self->request(cluster.router, std::chrono::seconds{600}, generate_atom::value, warm)
        .receive([](completion&) {}, [](caf::error&) {});
    const auto t0 = clock_type::now();
    for (uint32_t i = 0; i < requests; ++i) {
      generate_request req;
      req.prompt_tokens = prompt_of(cfg.model, i, tokens);
      req.max_tokens = 1;
      req.logprobs = true;  // a classification call wants the token's probability
      self->send(cluster.router, generate_atom::value, std::move(req));
    }
    for (uint32_t i = 0; i < requests; ++i)
      self->receive([&](completion& c) {
                      out.ttft_ms.push_back(static_cast<double>(c.ttft_us) / 1000.0);
                      out.kv_bytes += c.kv_bytes;
                      out.via_decode += c.decode_rank.empty() ? 0 : 1;
                    },
                    [&](caf::error& e) {
                      ++out.failed;
                      std::fprintf(stderr, "request failed: %s\n", sys.render(e).c_str());
                    });
    out.seconds = seconds_since(t0);
    for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t requests = 64, tokens = 512;
  std::string transport = "ucx";
  deploy::flag_set flags;
  flags.add("--requests", &requests, "one-token requests, all at once");
  flags.add("--tokens", &tokens, "prompt tokens of each");
  flags.add("--transport", &transport, "ucx or loopback");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--requests N] [--tokens N] [--transport T]")) return *rc;
  if (requests == 0 || tokens == 0) return std::fprintf(stderr, "baton_bench_one_token: --requests and --tokens must be >= 1\n"), 2;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_threads = 1;
  cfg.transport = transport;
  // Room for every request's pages at once on either rank: the comparison is about the work
  // a decode rank adds, not about waiting for its pages.
  cfg.executor.num_kv_pages = (requests + 1) * (tokens / cfg.executor.page_size_tokens + 2);
  cfg.router.request.prefill_timeout_ms = 600000;
  cfg.router.request.lease_ms = 600000;
  if (auto why = cfg.validate(); !why.empty()) {
    std::fprintf(stderr, "baton_bench_one_token: %s\n", why.c_str());
    return 2;
  }

  // The ceiling: the same prefills on one executor, every chunk submitted at once in prompt
  // order (the executor keeps its queue full: no hop, no wait between jobs), each prompt's last
  // chunk picking its token with its log-probability as the prefill rank's does.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto ceiling_s = [&]() -> double {
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto& kv = exec->kv();
    auto sink = std::make_shared<counting_sink>();
    std::vector<std::vector<uint32_t>> pages;
    uint32_t jobs = 0;
    const auto t0 = clock_type::now();
    for (uint32_t i = 0; i < requests; ++i) {
      const auto prompt = prompt_of(cfg.model, i, tokens);
      pages.push_back(*kv.kv_page_alloc(kv.pages_for_tokens(tokens)));
      for (uint32_t start = 0; start < tokens; start += cfg.prefill.chunk_tokens) {
        const uint32_t end = std::min(tokens, start + cfg.prefill.chunk_tokens);
        gpu::forward_job job{++jobs, {gpu::forward_seq{i, {prompt.begin() + start, prompt.begin() + end}, start, pages.back(), false}}};
        if (end == tokens) job.seqs[0].sample = gpu::seq_sampling{{}, tokens, {}, true, 0};
        exec->submit(std::move(job), sink);
      }
    }
    const bool ok = sink->wait(jobs);
    const double s = seconds_since(t0);
    for (auto& p : pages) kv.kv_page_free(p);
    return ok ? s : -1.0;
  };
  std::printf("%u one-token requests (logprobs on) of %u tokens, sent at once; built-in model, 1 prefill + 1 decode "
              "rank, CPU executor 1 thread each, transport %s\n\n",
              requests, tokens, transport.c_str());
  // Three rounds, each measuring the ceiling and both paths, so that a slow spell of the machine
  // hits all three alike; the round with the median ceiling is reported, the others' ratios too.
  struct round {
    double ceiling_s = 0;
    run_result alone, via;
  };
  std::vector<round> rounds(3);
  int rc = 0;
  for (auto& r : rounds) {
    r.ceiling_s = ceiling_s();
    if (r.ceiling_s < 0) return 1;
    for (const bool alone : {true, false}) {
      auto c = cfg;
      c.router.request.single_token_prefill_only = alone;
      (alone ? r.alone : r.via) = run_cluster(c, requests, tokens);
      if ((alone ? r.alone : r.via).failed > 0) rc = 1;
    }
  }
  std::printf("| path | requests/s | vs the executor alone (each round) | TTFT p50 / p99 ms | KV shipped | answers via a decode rank |\n");
  std::printf("|---|---|---|---|---|---|\n");
  auto by_ceiling = rounds;
  std::sort(by_ceiling.begin(), by_ceiling.end(), [](const round& a, const round& b) { return a.ceiling_s < b.ceiling_s; });
  const auto& mid = by_ceiling[1];
  std::printf("| the executor alone, every chunk queued at once (ceiling) | %.1f | 1.00 | | | |\n", requests / mid.ceiling_s);
  for (const bool alone : {true, false}) {
    const auto& r = alone ? mid.alone : mid.via;
    std::string ratios;
    for (const auto& x : rounds) {
      const auto& y = alone ? x.alone : x.via;
      ratios += (ratios.empty() ? "" : ", ") + std::to_string(x.ceiling_s / y.seconds).substr(0, 4);
    }
    std::printf("| %s | %.1f | %.2f (%s) | %.1f / %.1f | %.1f MiB | %u of %u |\n",
                alone ? "prefill rank alone (default)" : "through a decode rank (--one-token-via-decode)",
                requests / r.seconds, mid.ceiling_s / r.seconds, ratios.c_str(), percentile(r.ttft_ms, 0.5),
                percentile(r.ttft_ms, 0.99), static_cast<double>(r.kv_bytes) / (1 << 20), r.via_decode, requests);
  }
  return rc;
}
