// Closed-loop load on a router through Baton's C++ client: C clients, each sending its next
// request when the previous one ends, for D seconds. The baseline for the gateway's overhead
// (bench/gateway_bench.sh runs wrk against the gateway with the same concurrency and prompt).
//   baton_bench_client_load HOST:PORT CONCURRENCY SECONDS MAX_TOKENS PROMPT

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/baton/client.hpp"
#include "bench/bench_flags.hpp"

int main(int argc, char** argv) {
  std::vector<std::string> args;
  baton::deploy::flag_set flags;
  flags.collect_positional(&args);
  const std::string usage = "HOST:PORT CONCURRENCY SECONDS MAX_TOKENS PROMPT";
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, usage)) return *rc;
  const auto whole = [](const std::string& t, unsigned long max, unsigned long* out) {
    char* end = nullptr;
    *out = std::strtoul(t.c_str(), &end, 10);
    return !t.empty() && t[0] != '-' && *end == '\0' && *out >= 1 && *out <= max;
  };
  unsigned long concurrency_n = 0, seconds_n = 0, max_tokens_n = 0;
  std::string host, why;
  uint16_t port = 0;
  if (args.size() != 5) return std::fprintf(stderr, "usage: baton_bench_client_load %s\n", usage.c_str()), 2;
  if (!baton::deploy::parse_host_port(args[0], "HOST:PORT", &host, &port, &why) || port == 0)
    return std::fprintf(stderr, "baton_bench_client_load: %s\n", why.empty() ? "HOST:PORT needs a port" : why.c_str()), 2;
  if (!whole(args[1], 4096, &concurrency_n) || !whole(args[2], 86400, &seconds_n) || !whole(args[3], 1u << 20, &max_tokens_n))
    return std::fprintf(stderr, "baton_bench_client_load: CONCURRENCY (1-4096), SECONDS (1-86400) and MAX_TOKENS must be "
                                "positive integers, got '%s' '%s' '%s'\n",
                        args[1].c_str(), args[2].c_str(), args[3].c_str()), 2;
  const int concurrency = static_cast<int>(concurrency_n);
  const double seconds = static_cast<double>(seconds_n);
  auto conn = baton::client::connection::connect(host, port, &why);
  if (!conn) {
    std::fprintf(stderr, "%s\n", why.c_str());
    return 1;
  }
  baton::client::request req;
  req.prompt = args[4];
  req.max_tokens = static_cast<int32_t>(max_tokens_n);
  std::mutex mutex;
  std::vector<double> latencies_ms;
  std::atomic<int> errors{0};
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < concurrency; ++c)
    clients.emplace_back([&] {
      std::vector<double> mine;
      while (std::chrono::steady_clock::now() < end) {
        const auto t0 = std::chrono::steady_clock::now();
        auto s = conn->submit(req);
        baton::client::token_chunk chunk;
        while (s->next(&chunk, std::chrono::seconds{60})) {
        }
        if (s->failed() || s->timed_out()) ++errors;
        mine.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::lock_guard<std::mutex> guard{mutex};
      latencies_ms.insert(latencies_ms.end(), mine.begin(), mine.end());
    });
  for (auto& t : clients) t.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::sort(latencies_ms.begin(), latencies_ms.end());
  auto pct = [&](double p) {
    if (latencies_ms.empty()) return 0.0;
    const size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(latencies_ms.size())));
    return latencies_ms[std::clamp<size_t>(i, 1, latencies_ms.size()) - 1];
  };
  double mean = 0;
  for (double x : latencies_ms) mean += x;
  mean /= std::max<size_t>(1, latencies_ms.size());
  std::printf("client_load: %zu requests in %.2f s: %.1f requests/s; latency mean %.3f ms, p50 %.3f, p99 %.3f; %d errors\n",
              latencies_ms.size(), elapsed, static_cast<double>(latencies_ms.size()) / elapsed, mean, pct(50), pct(99),
              errors.load());
  return errors.load() == 0 ? 0 : 1;
}
