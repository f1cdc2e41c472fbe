// The block store on this machine:
//  1. CHECK: hash a prompt's full 512-token blocks into the key chain and find the longest cached
//     prefix in an index of 1M blocks (every block of the prompt cached: the longest walk), for
//     8K, 32K and 128K-token prompts, one core. Goal: <= 50 us median at 32K.
//  2. Store read throughput of a 32K-token prefix of the built-in model (64 blocks of 2 MiB),
//     layer-major (one layer of all blocks, then the next: the order prefill consumes them), into
//     host memory, page cache hot and cold, against the ceiling measured in the same run: plain
//     whole-file reads of the same files.
// Usage: baton_bench_store [--dir DIR]   (DIR on the disk to measure; default /var/tmp)

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"
#include "store/block_file.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::store;
using clock_type = std::chrono::steady_clock;

using baton::bench::median;

namespace {

void drop_cache(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/var/tmp";
  baton::deploy::flag_set flags;
  flags.add("--dir", &dir, "the block files go under this folder (removed after)");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--dir DIR]")) return *rc;
  dir += "/baton-store-bench-" + std::to_string(::getpid());

  // --- 1. CHECK -----------------------------------------------------------------------------
  const kv_identity id{"baton-tiny seed 20261130", 4, 128, 512, 16, "f32"};
  const auto salt = salt_of(id);
  std::mt19937_64 rng{1};
  block_index index;
  for (int i = 0; i < 1'000'000; ++i) index.upsert({{rng(), rng()}, {}, {0}, 1, retention::chat, 1e18, 0}, 0);
  std::printf("CHECK against an index of %zu blocks (512-token blocks, all of the prompt cached), one core:\n",
              index.size() + 0);
  for (uint32_t n : {8192u, 32768u, 131072u}) {
    std::vector<int32_t> prompt(n);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 128000);
    for (const auto& k : chain_keys(salt, prompt, 512)) index.upsert({k, {}, {0}, 1, retention::chat, 1e18, 0}, 0);
    std::vector<double> total, hash;
    size_t found = 0;
    for (int rep = 0; rep < 2001; ++rep) {
      const auto t0 = clock_type::now();
      const auto keys = chain_keys(salt, prompt, 512);
      const auto t1 = clock_type::now();
      found = index.longest_prefix(keys, 1.0);
      const auto t2 = clock_type::now();
      hash.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      total.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
    }
    std::printf("  %6u tokens: %3zu blocks found, CHECK median %7.2f us (hashing %7.2f us, lookups %6.2f us)\n", n,
                found, median(total), median(hash), median(total) - median(hash));
  }

  // --- 2. read throughput -----------------------------------------------------------------------
  const uint32_t blocks = 64;  // 32K tokens
  const uint64_t layer_bytes = uint64_t{512} * 2 * id.kv_dim * sizeof(float);
  std::vector<std::byte> src(layer_bytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::byte(i * 7);
  std::vector<std::string> files;
  std::vector<block_key> keys;
  std::vector<int32_t> toks(blocks * 512);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % 259);
  keys = chain_keys(salt, toks, 512);
  for (uint32_t b = 0; b < blocks; ++b) {
    block_header h{salt, keys[b], b ? keys[b - 1] : block_key{}, id.num_layers, id.kv_dim, 512, 16, layer_bytes,
                   std::vector<uint64_t>(id.num_layers, 1)};
    files.push_back(block_path(dir, keys[b]));
    auto err = write_block_file(files.back(), h, [&](uint32_t) { return layer_pieces{{src.data(), layer_bytes}}; });
    if (!err.empty()) {
      std::fprintf(stderr, "%s\n", err.c_str());
      return 1;
    }
  }
  const uint64_t total_bytes = uint64_t{blocks} * id.num_layers * layer_bytes;
  std::vector<std::byte> host(total_bytes + 4096 * blocks);
  auto layer_major = [&]() {
    std::vector<int> fds;
    std::vector<block_header> hs(blocks);
    std::string why;
    for (uint32_t b = 0; b < blocks; ++b) fds.push_back(open_block_file(files[b], salt, keys[b], &hs[b], &why));
    for (uint32_t l = 0; l < id.num_layers; ++l)
      for (uint32_t b = 0; b < blocks; ++b)
        if (!read_block_layer(fds[b], hs[b], l, host.data() + (uint64_t{l} * blocks + b) * layer_bytes).empty()) return false;
    for (int fd : fds) ::close(fd);
    return true;
  };
  auto whole_files = [&]() {
    uint64_t off = 0;
    for (const auto& f : files) {
      const int fd = ::open(f.c_str(), O_RDONLY);
      ssize_t r;
      while ((r = ::read(fd, host.data() + off, 1 << 20)) > 0) off += static_cast<uint64_t>(r);
      ::close(fd);
    }
    return true;
  };
  auto gbps = [&](auto fn, bool cold) {
    std::vector<double> v;
    for (int rep = 0; rep < 5; ++rep) {
      if (cold) drop_cache(files);
      const auto t0 = clock_type::now();
      if (!fn()) return -1.0;
      v.push_back(static_cast<double>(total_bytes) / std::chrono::duration<double>(clock_type::now() - t0).count() / 1e9);
    }
    return median(v);
  };
  std::printf("store read of a 32K-token prefix (%u blocks, %.0f MiB), layer-major, into host memory:\n", blocks,
              static_cast<double>(total_bytes) / (1 << 20));
  for (bool cold : {false, true}) {
    const double ours = gbps(layer_major, cold), ceiling = gbps(whole_files, cold);
    std::printf("  page cache %-4s: %6.2f GB/s   ceiling (whole-file reads) %6.2f GB/s   %5.1f%%\n", cold ? "cold" : "hot",
                ours, ceiling, 100.0 * ours / ceiling);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
