// Expert-parallel dispatch and combine between processes over Baton's all-to-all (UCX): each
// rank routes its tokens to top-k of E experts (experts in contiguous blocks over the ranks),
// packs the copies bound for each rank together and exchanges them (dispatch, 1 byte per value as
// fp8 activations), then every rank returns one 2-byte-per-value result per copy (combine). Every
// byte is checked on arrival. bench/a2a_bench.sh sets it beside ucx_perftest with the same
// transport and per-destination message size.
//
// Usage: baton_bench_a2a [--ranks N] [--tokens T] [--hidden H] [--experts E] [--top-k K] [--rounds R]
//        [--poll-sleep-us N]  (between polls; 0 spins with yield)
//        [--direct 0|1]  (1: chunks are stores into peers' slots where UCX maps them, the default;
//                         0: every chunk a put, the path of transports that map nothing)
//        (it starts N copies of itself as the ranks: `baton_bench_a2a --rank i ...`)

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "transport/all_to_all.hpp"
#include "transport/ucx.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

struct options {
  uint32_t ranks = 2, tokens = 256, hidden = 7168, experts = 64, top_k = 8, rounds = 20, poll_sleep_us = 0;
  uint32_t direct = 1;  ///< 1: stores into mapped peers where the transport maps them; 0: puts only
};

/// The k distinct experts of token t on rank r (a fixed hash: every process computes the same).
std::vector<uint32_t> route(const options& o, uint32_t r, uint32_t t) {
  std::vector<uint32_t> out;
  uint64_t x = (uint64_t{r} << 32 | t) * 0x9E3779B97F4A7C15ull + 1;
  while (out.size() < o.top_k) {
    x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29;
    const auto e = static_cast<uint32_t>(x % o.experts);
    if (std::find(out.begin(), out.end(), e) == out.end()) out.push_back(e);
  }
  return out;
}

uint32_t owner(const options& o, uint32_t expert) { return static_cast<uint32_t>(uint64_t{expert} * o.ranks / o.experts); }

/// The value byte i of (source rank, token, expert): what dispatch carries and combine returns.
std::byte value(uint32_t src, uint32_t token, uint32_t expert, uint64_t i) {
  return std::byte(static_cast<uint8_t>(src * 131 + token * 7 + expert * 13 + i));
}

int run_rank(const options& o, uint32_t rank) {
  std::vector<std::string> names;
  for (uint32_t r = 0; r < o.ranks; ++r) names.push_back("ep-" + std::to_string(r));
  std::string why;
  auto t = transport::make_ucx_transport({names[rank]}, &why);
  if (!t) return std::fprintf(stderr, "%s: %s\n", names[rank].c_str(), why.c_str()), 1;
  // Packing: per destination, the (token, expert) copies in token order, `hidden` bytes each.
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> rows(o.ranks);
  for (uint32_t tok = 0; tok < o.tokens; ++tok)
    for (auto e : route(o, rank, tok)) rows[owner(o, e)].push_back({tok, e});
  uint64_t slot = 0;
  for (uint32_t s = 0; s < o.ranks; ++s)  // the largest chunk any rank sends any rank (combine, 2 B)
    for (uint32_t d = 0; d < o.ranks; ++d) {
      uint64_t n = 0;
      for (uint32_t tok = 0; tok < o.tokens; ++tok)
        for (auto e : route(o, s, tok)) n += owner(o, e) == d;
      slot = std::max(slot, n * o.hidden * 2);
    }
  transport::all_to_all a2a{*t, names, {.rank = rank,
                                              .size = o.ranks,
                                              .slot_bytes = slot,
                                              .timeout = std::chrono::milliseconds{30'000},
                                              .poll_sleep_us = o.poll_sleep_us,
                                              .direct = o.direct != 0}};
  if (!a2a.error().empty()) return std::fprintf(stderr, "%s\n", a2a.error().c_str()), 1;
  std::printf("%s\n", transport::key_to_text(a2a.key()).c_str());
  std::fflush(stdout);
  std::vector<transport::region_key> keys;
  for (uint32_t r = 0; r < o.ranks; ++r) {
    std::string line;
    auto k = std::getline(std::cin, line) ? transport::key_from_text(line) : std::nullopt;
    if (!k) return std::fprintf(stderr, "%s: a malformed key from the launcher\n", names[rank].c_str()), 1;
    keys.push_back(*k);
  }
  a2a.connect(keys);
  // What each source sends here (to check dispatch) is known from its routing.
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> incoming(o.ranks);
  for (uint32_t s = 0; s < o.ranks; ++s)
    for (uint32_t tok = 0; tok < o.tokens; ++tok)
      for (auto e : route(o, s, tok))
        if (owner(o, e) == rank) incoming[s].push_back({tok, e});
  std::vector<std::vector<std::byte>> out(o.ranks), back(o.ranks);
  for (uint32_t d = 0; d < o.ranks; ++d) {
    for (auto [tok, e] : rows[d])
      for (uint64_t i = 0; i < o.hidden; ++i) out[d].push_back(value(rank, tok, e, i));
  }
  std::vector<double> dispatch_us, combine_us;
  uint64_t remote_dispatch = 0, remote_combine = 0, bad = 0;
  for (uint32_t round = 0; round < o.rounds; ++round) {
    std::vector<std::span<const std::byte>> send, recv;
    // An empty exchange first: every rank starts the timed one together, so its time is the
    // transfer's, not a peer still checking the previous round.
    const std::vector<std::span<const std::byte>> none(o.ranks);
    if (!a2a.exchange(none, &recv, &why)) return std::fprintf(stderr, "%s\n", why.c_str()), 1;
    for (auto& v : out) send.emplace_back(v);
    auto t0 = clock_type::now();
    if (!a2a.exchange(send, &recv, &why)) return std::fprintf(stderr, "%s\n", why.c_str()), 1;
    dispatch_us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
    // The "expert": each copy's result is its activation widened to two bytes per value.
    for (uint32_t s = 0; s < o.ranks; ++s) {
      back[s].resize(incoming[s].size() * o.hidden * 2);
      bad += recv[s].size() != incoming[s].size() * o.hidden;
      for (size_t j = 0; j < incoming[s].size() && recv[s].size() == incoming[s].size() * o.hidden; ++j)
        for (uint64_t i = 0; i < o.hidden; ++i) {
          const auto v = recv[s][j * o.hidden + i];
          bad += v != value(s, incoming[s][j].first, incoming[s][j].second, i);
          back[s][(j * o.hidden + i) * 2] = v;
          back[s][(j * o.hidden + i) * 2 + 1] = std::byte{0x5a};
        }
      if (s != rank) remote_dispatch += recv[s].size();
    }
    if (!a2a.exchange(none, &recv, &why)) return std::fprintf(stderr, "%s\n", why.c_str()), 1;
    send.clear();
    for (auto& v : back) send.emplace_back(v);
    t0 = clock_type::now();
    if (!a2a.exchange(send, &recv, &why)) return std::fprintf(stderr, "%s\n", why.c_str()), 1;
    combine_us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
    for (uint32_t d = 0; d < o.ranks; ++d) {
      bad += recv[d].size() != rows[d].size() * o.hidden * 2;
      for (size_t j = 0; j < rows[d].size() && recv[d].size() == rows[d].size() * o.hidden * 2; ++j)
        for (uint64_t i = 0; i < o.hidden; i += 61)  // a sample of each returned row
          bad += recv[d][(j * o.hidden + i) * 2] != value(rank, rows[d][j].first, rows[d][j].second, i);
      if (d != rank) remote_combine += recv[d].size();
    }
  }
  std::sort(dispatch_us.begin(), dispatch_us.end());
  std::sort(combine_us.begin(), combine_us.end());
  const double d50 = dispatch_us[dispatch_us.size() / 2], c50 = combine_us[combine_us.size() / 2];
  const double d_bytes = static_cast<double>(remote_dispatch) / o.rounds, c_bytes = static_cast<double>(remote_combine) / o.rounds;
  std::printf("rank %u: dispatch %.0f us (%.2f GB/s received), combine %.0f us (%.2f GB/s received), chunk to each "
              "peer ~%.0f KiB, %llu bad bytes, %u of %u peers by direct stores\n",
              rank, d50, d_bytes / d50 / 1e3, c50, c_bytes / c50 / 1e3, d_bytes / std::max(1u, o.ranks - 1) / 1024,
              static_cast<unsigned long long>(bad), a2a.direct_peers(), o.ranks - 1);
  std::fflush(stdout);
  return bad == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  uint32_t rank_flag = UINT32_MAX;
  deploy::flag_set flags;
  flags.add("--ranks", &o.ranks, "rank processes in the all-to-all");
  flags.add("--tokens", &o.tokens, "tokens per rank per round");
  flags.add("--hidden", &o.hidden, "hidden size: values per token");
  flags.add("--experts", &o.experts, "experts, spread over the ranks");
  flags.add("--top-k", &o.top_k, "experts each token goes to");
  flags.add("--rounds", &o.rounds, "dispatch + combine rounds timed");
  flags.add("--poll-sleep-us", &o.poll_sleep_us, "sleep between polls of a rank waiting for its peers (0: spin)");
  flags.add("--direct", &o.direct, "1: stores into mapped peers where the transport maps them; 0: puts only");
  flags.add("--rank", &rank_flag, "internal: run as this rank (the launcher starts them)");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--ranks N] [--tokens N] [--experts N] [--top-k N] ...")) return *rc;
  const int rank = rank_flag == UINT32_MAX ? -1 : static_cast<int>(rank_flag);
  if (o.ranks < 2 || o.top_k == 0 || o.top_k > o.experts || o.experts < o.ranks || o.rounds == 0)
    return std::fprintf(stderr, "need --ranks >= 2, 1 <= --top-k <= --experts, --experts >= --ranks, --rounds >= 1\n"), 2;
  if (rank >= 0) return run_rank(o, static_cast<uint32_t>(rank));

  // The launcher: N rank processes, keys collected from each and handed to all.
  struct child {
    pid_t pid;
    FILE* out;
    int in;
  };
  std::vector<child> kids;
  for (uint32_t r = 0; r < o.ranks; ++r) {
    int to[2], from[2];
    if (pipe(to) != 0 || pipe(from) != 0) return 1;
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(to[0], 0);
      dup2(from[1], 1);
      close(to[1]);
      close(from[0]);
      std::vector<std::string> args = {argv[0], "--rank", std::to_string(r), "--ranks", std::to_string(o.ranks),
                                       "--tokens", std::to_string(o.tokens), "--hidden", std::to_string(o.hidden),
                                       "--experts", std::to_string(o.experts), "--top-k", std::to_string(o.top_k),
                                       "--rounds", std::to_string(o.rounds), "--poll-sleep-us",
                                       std::to_string(o.poll_sleep_us), "--direct", std::to_string(o.direct)};
      std::vector<char*> cargs;
      for (auto& s : args) cargs.push_back(s.data());
      cargs.push_back(nullptr);
      execv("/proc/self/exe", cargs.data());
      _exit(127);
    }
    close(to[0]);
    close(from[1]);
    kids.push_back({pid, fdopen(from[0], "r"), to[1]});
  }
  std::string keys;
  for (auto& k : kids) {
    char line[16384];
    if (!fgets(line, sizeof line, k.out)) return std::fprintf(stderr, "a rank did not start\n"), 1;
    keys += line;
  }
  for (auto& k : kids) {
    if (write(k.in, keys.data(), keys.size()) != static_cast<ssize_t>(keys.size())) return 1;
    close(k.in);
  }
  std::printf("%u ranks, %u tokens each, hidden %u, %u experts, top-%u, %u rounds (medians)\n", o.ranks, o.tokens,
              o.hidden, o.experts, o.top_k, o.rounds);
  int rc = 0;
  for (auto& k : kids) {
    char line[1024];
    while (fgets(line, sizeof line, k.out)) std::fputs(line, stdout);
    int status = 0;
    waitpid(k.pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  std::printf(rc == 0 ? "all-to-all: every byte verified\n" : "all-to-all: FAILED\n");
  return rc;
}
