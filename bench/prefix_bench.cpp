// TTFT with a cached prefix (seed 000's request A, scaled to what the CPU executor can run): a
// prompt of N tokens computed from scratch, then the same prompt with its leading blocks (a) in
// the block store, loaded by another prefill rank, and (b) already in the first rank's own pages
// (the rank-local tier). Built-in model, its context raised to fit (RoPE needs no retraining for
// positions, and the numbers are about time, not text). Two prefill ranks, round robin, so the
// three requests land on rank 0, rank 1, rank 0.
//
// Then a burst: --burst prompts that share all but their last block arrive together at one
// prefill rank (one system prompt fanned out), with the rank's in-flight sharing on (later ones
// wait for the first and share its blocks) and off (each computes the prefix), in the same run.
// Usage: baton_bench_prefix [--tokens N] [--block-tokens B] [--burst N] [--dir DIR]

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;

namespace {

local_cluster_config bench_config(uint32_t tokens, uint32_t block, const std::string& dir) {
  local_cluster_config cfg;
  cfg.model.max_position_embeddings = tokens + 64;
  cfg.num_prefill_ranks = 2;
  cfg.prefill_balancer.policy = "round_robin";
  cfg.num_decode_ranks = 1;
  cfg.executor.num_kv_pages = (tokens + 64) / 16 + 8;
  cfg.prefill.chunk_tokens = 512;
  cfg.store.enabled = true;
  cfg.store.dir = dir;
  cfg.store.block_tokens = block;
  cfg.store.max_pending_write_bytes = 512ull << 20;  // the whole prompt's blocks at once
  cfg.prefill.prefix_cache_blocks = tokens / block + 1;
  cfg.router.request.prefill_timeout_ms = 1800000;  // a 32K recompute takes minutes on the CPU
  cfg.router.request.lease_ms = 60000;               // and one layer of a late chunk seconds
  return cfg;
}

/// The burst: `n` prompts of `tokens` sharing all but their last block, sent together to one
/// prefill rank. Prints the wall time until the last answer, TTFTs and tokens found cached.
int burst(caf::actor_system& sys, uint32_t tokens, uint32_t block, const std::string& dir, uint32_t n, bool share) {
  auto cfg = bench_config(tokens, block, dir);
  cfg.num_prefill_ranks = 1;
  cfg.store.enabled = false;  // the rank-local tier alone (local_tier_only): nothing from disk
  cfg.store.local_tier_only = true;
  cfg.executor.num_kv_pages = n * ((tokens + 64) / 16 + 8);
  cfg.prefill.prefix_cache_blocks = n * (tokens / block + 1);
  cfg.prefill.share_in_flight_prefix = share;
  auto cluster = start_local_cluster(sys, cfg);
  int rc = 0;
  caf::scoped_actor self{sys};
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t k = 0; k < n; ++k) {
    std::vector<int32_t> p{cfg.model.bos_token_id};
    for (uint32_t i = 1; i < tokens; ++i)  // the last block differs per prompt
      p.push_back(static_cast<int32_t>('a' + (i * 7 + (i + block >= tokens ? k : 0)) % 26));
    prompts.push_back(std::move(p));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<decltype(self->request(cluster.router, std::chrono::seconds{3600}, generate_atom::value, generate_request{}))> sent;
  for (const auto& p : prompts) {
    generate_request req;
    req.prompt_tokens = p;
    req.max_tokens = 2;
    req.ignore_eos = true;
    sent.push_back(self->request(cluster.router, std::chrono::seconds{3600}, generate_atom::value, std::move(req)));
  }
  double ttft_sum_ms = 0, ttft_max_ms = 0;
  uint64_t cached = 0;
  for (auto& h : sent)
    h.receive(
        [&](completion& c) {
          ttft_sum_ms += c.ttft_us / 1000.0;
          ttft_max_ms = std::max(ttft_max_ms, c.ttft_us / 1000.0);
          cached += c.local_cached_tokens;
        },
        [&](caf::error& e) {
          std::fprintf(stderr, "burst request failed: %s\n", sys.render(e).c_str());
          rc = 1;
        });
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  burst of %u, in-flight sharing %-3s: all answered in %8.1f ms, TTFT mean %8.1f ms max %8.1f ms, "
              "%llu of %llu prompt tokens cached\n",
              n, share ? "on" : "off", wall_ms, ttft_sum_ms / n, ttft_max_ms, static_cast<unsigned long long>(cached),
              static_cast<unsigned long long>(uint64_t{n} * tokens));
  for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t tokens = 4096, block = 512, burst_size = 4;
  std::string dir = "/var/tmp";
  deploy::flag_set flags;
  flags.add("--tokens", &tokens, "prompt length");
  flags.add("--block-tokens", &block, "tokens per store block");
  flags.add("--burst", &burst_size, "prompts in the burst (0: no burst)");
  flags.add("--dir", &dir, "the block store's files go under this folder (removed after)");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--tokens N] [--block-tokens N] [--burst N] [--dir DIR]")) return *rc;
  if (tokens == 0 || block == 0 || block % 16 != 0 || tokens <= block)
    return std::fprintf(stderr, "baton_bench_prefix: --tokens must be more than --block-tokens, a multiple of 16\n"), 2;
  dir += "/baton-prefix-bench-" + std::to_string(::getpid());
  const auto cfg = bench_config(tokens, block, dir);
  caf::actor_system_config sys_cfg;
  register_message_types(sys_cfg);
  sys_cfg.set("scheduler.max-threads", 2);
  sys_cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{sys_cfg};
  auto cluster = start_local_cluster(sys, cfg);
  int rc = 0;
  {
    caf::scoped_actor self{sys};
    std::vector<int32_t> prompt{cfg.model.bos_token_id};
    for (uint32_t i = 1; i < tokens; ++i) prompt.push_back(static_cast<int32_t>('a' + (i * 7) % 26));
    auto run = [&](const char* what) -> completion {
      generate_request req;
      req.prompt_tokens = prompt;
      req.max_tokens = 2;
      req.ignore_eos = true;
      completion out;
      self->request(cluster.router, std::chrono::seconds{3600}, generate_atom::value, req)
          .receive([&](completion& c) { out = std::move(c); },
                   [&](caf::error& e) {
                     std::fprintf(stderr, "%s failed: %s\n", what, sys.render(e).c_str());
                     rc = 1;
                   });
      return out;
    };
    const auto scratch = run("recompute");
    // Write-back is asynchronous: wait (bounded) for the index to know the blocks.
    const uint64_t want = (tokens + 1) / block;
    for (int i = 0; i < 1000; ++i) {
      store_stats s;
      self->request(cluster.store_index[0], std::chrono::seconds{5}, stats_atom::value)
          .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
      if (s.blocks >= want) break;
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    const auto cached = run("from the store");
    const auto local = run("already on the rank");
    // The store read's wall time, from the prefill rank's events.
    std::vector<rank_event> ev;
    self->request(cluster.prefill[1].handle, std::chrono::seconds{5}, events_atom::value)
        .receive([&](std::vector<rank_event>& e) { ev = std::move(e); }, [](caf::error&) {});
    int64_t t0 = 0, t1 = 0;
    for (const auto& e : ev) {
      if (e.kind == "prefix_load_start") t0 = e.wall_ns;
      if (e.kind == "prefix_loaded") t1 = e.wall_ns;
    }
    const double load_ms = (t1 - t0) / 1e6;
    const double bytes = static_cast<double>(cached.cached_tokens) * 2 * cfg.model.kv_dim() * 4 * cfg.model.num_hidden_layers;
    std::printf("prompt %u tokens, %u-token blocks, built-in model (4 layers, KV %u B/token), CPU executor 1 thread\n",
                tokens, block, 2 * cfg.model.kv_dim() * 4 * cfg.model.num_hidden_layers);
    std::printf("  recompute        : TTFT %9.1f ms (prefill hop %9.1f ms)\n", scratch.ttft_us / 1000.0,
                scratch.prefill_us / 1000.0);
    std::printf("  prefix from store: TTFT %9.1f ms (prefill hop %9.1f ms), %u tokens loaded, CHECK %lld us  -> %.1fx\n",
                cached.ttft_us / 1000.0, cached.prefill_us / 1000.0, cached.cached_tokens,
                static_cast<long long>(cached.check_us),
                cached.ttft_us > 0 ? static_cast<double>(scratch.ttft_us) / static_cast<double>(cached.ttft_us) : 0.0);
    std::printf("  prefix on the rank: TTFT %9.1f ms (prefill hop %9.1f ms), %u tokens in its own pages        -> %.1fx\n",
                local.ttft_us / 1000.0, local.prefill_us / 1000.0, local.local_cached_tokens,
                local.ttft_us > 0 ? static_cast<double>(scratch.ttft_us) / static_cast<double>(local.ttft_us) : 0.0);
    std::printf("  store read: %.1f MiB in %.1f ms = %.2f GB/s (block server I/O thread -> transport -> pages, verified)\n",
                bytes / (1 << 20), load_ms, load_ms > 0 ? bytes / (load_ms / 1e3) / 1e9 : 0.0);
    std::printf("  compute-only bound (cost model, the %u new tokens after the prefix): %.1f ms\n",
                tokens - cached.cached_tokens,
                cfg.prefill.cost.prefill_us(tokens - cached.cached_tokens, cached.cached_tokens) / 1000.0);
    for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
  std::filesystem::remove_all(dir);
  if (burst_size > 0 && rc == 0)
    for (const bool share : {false, true}) rc |= burst(sys, tokens, block, dir, burst_size, share);
  return rc;
}
