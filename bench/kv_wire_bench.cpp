// What wire quantisation (transport/kv_wire) costs on the CPU against what it saves on the wire:
// encode and decode rates over one layer's KV (buffers larger than the L3, fresh each pass),
// against a cold memcpy of the fp32 layer in the same run. A layer is worth quantising where
// encode + decode take less time than the link needs for the bytes saved: on links slower than
// the last column (here, on one core each side; the handoff could spread a layer over cores).
//   baton_bench_kv_wire [--mib N]    (default 64 MiB of fp32 per layer)

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"
#include "transport/kv_wire.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::transport;
using baton::bench::median;

namespace {

double seconds_of(auto&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 64;
  baton::deploy::flag_set flags;
  flags.add("--mib", &mib, "MiB of fp32 KV in the layer (1 to 4096)");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--mib N]")) return *rc;
  if (mib == 0 || mib > 4096) {
    std::fprintf(stderr, "baton_bench_kv_wire: --mib must be 1 to 4096, got %llu\n", static_cast<unsigned long long>(mib));
    return 2;
  }
  const size_t values = mib * (size_t{1} << 20) / sizeof(float);
  // Two sets of buffers, used in turn, so no pass finds the last one's data in the cache.
  const int sets = 2, passes = 6;
  std::vector<std::vector<float>> src(sets, std::vector<float>(values)), dst(sets, std::vector<float>(values));
  for (auto& s : src)
    for (size_t i = 0; i < values; ++i) s[i] = 0.02f * std::sin(0.001f * static_cast<float>(i)) * (1 + i % 5);
  std::printf("wire quantisation of one layer: %zu MiB of fp32 KV, median of %d passes, buffers alternating\n", mib,
              passes);
  std::printf("| form | wire bytes | encode GB/s (fp32 in) | decode GB/s (fp32 out) | cold memcpy GB/s | pays on links below |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  std::vector<double> copy;
  for (int p = 0; p < passes; ++p)
    copy.push_back(seconds_of([&] { std::memcpy(dst[p % sets].data(), src[p % sets].data(), values * 4); }));
  const double memcpy_gbps = values * 4 / median(copy) / 1e9;
  for (const auto f : {wire_format::int8, wire_format::int4}) {
    std::vector<std::vector<uint8_t>> wire(sets, std::vector<uint8_t>(wire_bytes(f, values)));
    std::vector<double> enc, dec;
    for (int p = 0; p < passes; ++p) {
      const int k = p % sets;
      enc.push_back(seconds_of([&] {
        if (auto why = wire_encode(f, src[k].data(), values, wire[k].data()); !why.empty()) {
          std::fprintf(stderr, "baton_bench_kv_wire: %s\n", why.c_str());
          std::exit(1);
        }
      }));
      dec.push_back(seconds_of([&] { wire_decode(f, wire[k].data(), values, dst[k].data()); }));
    }
    const double e = median(enc), d = median(dec);
    // Sending s fp32 bytes at rate R takes s / R; quantised, (e + d) + w / R. Equal at
    // R = (s - w) / (e + d): slower links gain.
    const double saved = values * 4.0 - wire_bytes(f, values);
    std::printf("| %s | %.1f%% | %.2f | %.2f | %.2f | %.2f GB/s |\n", to_string(f),
                100.0 * wire_bytes(f, values) / (values * 4.0), values * 4 / e / 1e9, values * 4 / d / 1e9, memcpy_gbps,
                saved / (e + d) / 1e9);
  }
  return 0;
}
