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

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s HOST:PORT CONCURRENCY SECONDS MAX_TOKENS PROMPT\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1];
  const auto colon = target.rfind(':');
  const int concurrency = std::atoi(argv[2]);
  const double seconds = std::atof(argv[3]);
  std::string why;
  auto conn = baton::client::connection::connect(target.substr(0, colon),
                                                 static_cast<uint16_t>(std::atoi(target.c_str() + colon + 1)), &why);
  if (!conn) {
    std::fprintf(stderr, "%s\n", why.c_str());
    return 1;
  }
  baton::client::request req;
  req.prompt = argv[5];
  req.max_tokens = std::atoi(argv[4]);
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
