// `baton local` without --serve: the sample prompts answered by the cluster it started, and
// where their time went (deploy/local_options.hpp).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/messages.hpp"
#include "deploy/local_options.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton::deploy {

namespace {

double mean(const std::vector<int64_t>& xs) {
  return xs.empty() ? 0.0 : std::accumulate(xs.begin(), xs.end(), 0.0) / static_cast<double>(xs.size());
}

/// Nearest-rank percentile of microsecond samples, in milliseconds.
double percentile_ms(std::vector<int64_t> xs, double p) {
  if (xs.empty()) return 0.0;
  std::sort(xs.begin(), xs.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(xs.size())));
  return static_cast<double>(xs[std::clamp<size_t>(rank, 1, xs.size()) - 1]) / 1000.0;
}

void print_row(const char* what, const std::vector<int64_t>& us) {
  std::printf("  %-22s p50 %9.3f   p90 %9.3f   p99 %9.3f ms   (%zu samples)\n", what, percentile_ms(us, 50),
              percentile_ms(us, 90), percentile_ms(us, 99), us.size());
}

}  // namespace

int answer_sample_prompts(caf::actor_system& sys, const local_cluster& cluster, const local_options& opt) {
  caf::scoped_actor self{sys};
  struct pending {
    std::string prompt;
    decltype(self->request(cluster.router, caf::infinite, generate_atom::value, generate_request{})) handle;
  };
  std::vector<pending> inflight;
  const size_t num_requests = opt.num_requests ? opt.num_requests : opt.prompts.size();
  if (opt.prompts.empty()) {
    std::fprintf(stderr, "baton local: no prompts\n");
    return 2;
  }
  const auto started = std::chrono::steady_clock::now();
  int failures = 0;
  size_t num_tokens = 0, num_sent = 0;
  uint64_t cached_tokens = 0, prompt_tokens = 0;
  std::vector<int64_t> ttft, tbt, place, reserve, prefill_queue, prefill, decode_queue;
  std::map<std::string, int> per_rank;
  // Rounds run one after another, so a later round can find an earlier one's blocks in the store.
  for (uint32_t round = 0; round < opt.repeat; ++round) {
    inflight.clear();
    if (opt.repeat > 1 && !opt.quiet) std::printf("\n=== round %u of %u ===\n", round + 1, opt.repeat);
    for (size_t i = 0; i < num_requests; ++i) {
      const auto& p = opt.prompts[i % opt.prompts.size()];
      generate_request req;
      if (opt.chat)
        req.messages = {{"user", p}};
      else
        req.prompt = p;
      req.max_tokens = static_cast<int32_t>(opt.max_tokens);
      req.temperature = opt.temperature;
      req.ignore_eos = opt.ignore_eos;
      inflight.push_back({p, self->request(cluster.router, std::chrono::milliseconds{opt.timeout_ms},
                                           generate_atom::value, std::move(req))});
    }
    num_sent += inflight.size();
    for (auto& f : inflight) {
      f.handle.receive(
          [&](const completion& c) {
            num_tokens += c.tokens.size();
            cached_tokens += c.cached_tokens;
            prompt_tokens += c.num_prompt_tokens;
            ttft.push_back(c.ttft_us);
            tbt.insert(tbt.end(), c.tbt_us.begin(), c.tbt_us.end());
            place.push_back(c.place_us);
            reserve.push_back(c.reserve_us);
            prefill_queue.push_back(c.prefill_queue_us);
            prefill.push_back(c.prefill_us);
            decode_queue.push_back(c.decode_queue_us);
            ++per_rank[c.prefill_rank];
            if (!c.decode_rank.empty()) ++per_rank[c.decode_rank];  // a one-token request has none
            if (opt.quiet) return;
            std::printf("\n[request %llu] %s -> %s\n", static_cast<unsigned long long>(c.request_id),
                        c.prefill_rank.c_str(), c.decode_rank.empty() ? "(no decode rank: one token)" : c.decode_rank.c_str());
            std::printf("  prompt : %s\n", gpu::byte_tokenizer::escape(f.prompt).c_str());
            std::printf("  output : %s\n", gpu::byte_tokenizer::escape(c.text).c_str());
            std::printf("  tokens : %zu (%s)   TTFT %.3f ms   mean TBT %.3f ms\n", c.tokens.size(),
                        c.finish_reason.c_str(), static_cast<double>(c.ttft_us) / 1000.0, mean(c.tbt_us) / 1000.0);
            if (opt.cluster.store.enabled)
              // Apart: a hit in the prefill rank's own pages says nothing of the store (a trial
              // saw "64 loaded from the store" from a store that had written nothing).
              std::printf("  store  : %u of %u prompt tokens loaded from the store, %u from the rank's own cache%s "
                          "(CHECK %lld us)\n",
                          c.cached_tokens - std::min(c.cached_tokens, c.local_cached_tokens), c.num_prompt_tokens,
                          c.local_cached_tokens, c.recomputed_blocks ? ", some blocks recomputed" : "",
                          static_cast<long long>(c.check_us));
            if (opt.explain)
              std::printf("  placed : prefill %s\n           decode  %s\n", c.prefill_placement_why.c_str(),
                          c.decode_placement_why.c_str());
          },
          [&](const caf::error& err) {
            ++failures;
            std::printf("\n[request] %s\n  error  : %s\n", gpu::byte_tokenizer::escape(f.prompt).c_str(),
                        sys.render(err).c_str());
          });
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (opt.cluster.store.enabled) {
    // The last answers' write-backs are on their way (started as each sequence ended, before its
    // answer): waited for, up to 10 s, so that the store holds what this run computed when the
    // process ends. A one-round run ended before any landed, and the next run found nothing.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{10};
    for (const auto& d : cluster.decode)
      for (;;) {
        uint64_t in_flight = 0;
        self->request(d.handle, std::chrono::seconds{5}, stats_atom::value)
            .receive([&](rank_stats& s) { in_flight = s.num_writes_in_flight; }, [](caf::error&) {});
        if (in_flight == 0 || std::chrono::steady_clock::now() > until) break;
        std::this_thread::sleep_for(std::chrono::milliseconds{5});
      }
  }
  std::printf("\nbaton local: %zu requests, %d failed, %zu tokens in %.3f s: %.1f requests/s, %.1f tokens/s\n",
              num_sent, failures, num_tokens, seconds, static_cast<double>(num_sent - failures) / seconds,
              static_cast<double>(num_tokens) / seconds);
  if (opt.cluster.store.enabled) {
    std::printf("  store: %llu of %llu prompt tokens loaded instead of computed\n",
                static_cast<unsigned long long>(cached_tokens), static_cast<unsigned long long>(prompt_tokens));
    // What the disk holds now (write-backs of the last answers may still be on their way).
    self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](cluster_stats& c) {
              const auto mib = [](uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
              std::printf("  store: %llu blocks written, %.1f MiB of block files on disk",
                          static_cast<unsigned long long>(c.store.blocks_written), mib(c.store.disk_bytes));
              if (opt.cluster.store.capacity_gib > 0)
                std::printf(" (budget %.1f MiB), %llu deleted for room", opt.cluster.store.capacity_gib * 1024.0,
                            static_cast<unsigned long long>(c.store.disk_evicted));
              if (c.store.write_failures)
                std::printf(", %llu writes failed (%llu for want of room)", static_cast<unsigned long long>(c.store.write_failures),
                            static_cast<unsigned long long>(c.store.write_no_space));
              std::printf("\n");
            },
            [&](caf::error& e) { std::printf("  store: no figures from the router (%s)\n", sys.render(e).c_str()); });
  }
  print_row("TTFT", ttft);
  print_row("TBT (every interval)", tbt);
  print_row("placement", place);
  print_row("KV reserve", reserve);
  print_row("prefill queue", prefill_queue);
  print_row("prefill (whole hop)", prefill);
  print_row("decode queue", decode_queue);
  std::printf("  requests per rank:");
  for (const auto& [rank, n] : per_rank) std::printf(" %s=%d", rank.c_str(), n);
  std::printf("\n");
  if (cluster.elastic_controller)
    self->request(cluster.elastic_controller, std::chrono::seconds{5}, events_atom::value)
        .receive(
            [&](std::vector<role_change>& log) {
              std::printf("  role changes: %zu\n", log.size());
              for (const auto& c : log)
                std::printf("    %.1f s %s %s -> %s (%s, %.2f s): %s\n", c.at_s, c.rank.c_str(), c.from.c_str(),
                            c.to.c_str(), c.state.c_str(), c.drain_s, c.why.c_str());
            },
            [](caf::error&) {});
  return failures == 0 ? 0 : 1;
}

}  // namespace baton::deploy
