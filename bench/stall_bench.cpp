// The live stall the seeds start from (seed 000 §1.1): a long prompt arriving while short
// requests stream tokens. Colocated (every prompt prefilled on the decode rank, in chunks that
// ride in the decode steps, as chunked-prefill engines do) against disaggregated (the long
// prompt goes to the prefill rank; the decode rank only decodes). Real actors, real CPU
// executors, the built-in model; one run of each in the same process.
//
// Reported per mode: TBT of the streaming requests before the long prompt arrives and while it
// is prefilled (its arrival -> its first token), p50 / p99 / max, and the long prompt's TTFT.
// Usage: baton_bench_stall [--streams N] [--long-tokens N] [--chunk-tokens N]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "bench/bench_system.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

struct options {
  uint32_t streams = 8;
  uint32_t long_tokens = 1500;
  uint32_t chunk_tokens = 256;
};

double pct(std::vector<double> xs, double p) {
  if (xs.empty()) return 0.0;
  std::sort(xs.begin(), xs.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(xs.size())));
  return xs[std::clamp<size_t>(rank, 1, xs.size()) - 1];
}

struct result {
  std::vector<double> before_ms, during_ms;
  double long_ttft_ms = 0.0;
  int failures = 0;
};

result run(const options& opt, bool colocated) {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_threads = 1;
  cfg.executor.num_kv_pages = (opt.long_tokens + 64) / 16 + opt.streams * 40 + 16;
  cfg.prefill.chunk_tokens = opt.chunk_tokens;  // fixed chunks: the same work in both modes
  cfg.decode.local_prefill_chunk_tokens = opt.chunk_tokens;
  cfg.router.request.hybrid_prefill_below_tokens = colocated ? UINT32_MAX : 0;
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{bench::cluster_system_config(sys_cfg)};
  auto cluster = start_local_cluster(sys, cfg);
  result out;
  {
    caf::scoped_actor self{sys};
    using handle_t = decltype(self->request(cluster.router, caf::infinite, generate_atom::value, generate_request{}));
    std::vector<std::pair<clock_type::time_point, handle_t>> streams;
    for (uint32_t i = 0; i < opt.streams; ++i) {
      generate_request req;
      req.prompt = "stream " + std::to_string(i) + ": tell me a long story";
      req.max_tokens = 600;
      req.ignore_eos = true;
      streams.emplace_back(clock_type::now(),
                           self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, req));
    }
    // Let the streams settle into steady decoding, then the long prompt arrives.
    std::this_thread::sleep_for(std::chrono::milliseconds{300});
    generate_request big;
    big.prompt = std::string(opt.long_tokens - 1, 'L');  // + <bos>
    big.max_tokens = 2;
    const auto long_sent = clock_type::now();
    auto long_handle = self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, big);
    clock_type::time_point long_first{};
    long_handle.receive(
        [&](const completion& c) {
          out.long_ttft_ms = static_cast<double>(c.ttft_us) / 1000.0;
          long_first = long_sent + std::chrono::microseconds{c.ttft_us};
        },
        [&](const caf::error& e) {
          ++out.failures;
          std::fprintf(stderr, "long prompt failed: %s\n", sys.render(e).c_str());
        });
    for (auto& [sent, h] : streams)
      h.receive(
          [&](const completion& c) {
            // Token k arrived at sent + ttft + sum of the first k intervals.
            auto at = sent + std::chrono::microseconds{c.ttft_us};
            for (auto tbt : c.tbt_us) {
              const auto start = at;
              at += std::chrono::microseconds{tbt};
              const double ms = static_cast<double>(tbt) / 1000.0;
              if (at <= long_sent) out.before_ms.push_back(ms);
              else if (start < long_first) out.during_ms.push_back(ms);
            }
          },
          [&](const caf::error& e) {
            ++out.failures;
            std::fprintf(stderr, "stream failed: %s\n", sys.render(e).c_str());
          });
    for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
  return out;
}

void print(const char* mode, const result& r) {
  std::printf("%-14s  before: p50 %7.2f  p99 %7.2f  max %7.2f ms (%4zu)   during: p50 %7.2f  p99 %7.2f  max %7.2f ms "
              "(%4zu)   long TTFT %8.1f ms%s\n",
              mode, pct(r.before_ms, 50), pct(r.before_ms, 99), pct(r.before_ms, 100), r.before_ms.size(),
              pct(r.during_ms, 50), pct(r.during_ms, 99), pct(r.during_ms, 100), r.during_ms.size(), r.long_ttft_ms,
              r.failures ? "  (FAILURES)" : "");
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  deploy::flag_set flags;
  flags.add("--streams", &opt.streams, "streaming requests decoding when the long prompt arrives");
  flags.add("--long-tokens", &opt.long_tokens, "the long prompt's length");
  flags.add("--chunk-tokens", &opt.chunk_tokens, "prefill chunk length");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--streams N] [--long-tokens N] [--chunk-tokens N]")) return *rc;
  if (opt.streams == 0 || opt.long_tokens == 0 || opt.chunk_tokens == 0)
    return std::fprintf(stderr, "baton_bench_stall: --streams, --long-tokens and --chunk-tokens must be >= 1\n"), 2;
  std::printf("TBT of %u streaming requests when a %u-token prompt arrives (chunks of %u tokens), built-in model, "
              "1 executor thread per rank\n",
              opt.streams, opt.long_tokens, opt.chunk_tokens);
  const auto colocated = run(opt, true);
  print("colocated", colocated);
  const auto disaggregated = run(opt, false);
  print("disaggregated", disaggregated);
  return colocated.failures + disaggregated.failures ? 1 : 0;
}
