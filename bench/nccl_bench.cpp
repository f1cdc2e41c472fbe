// Layer-wise KV send between two device regions on one GPU (issue 6's NCCL backend), against its
// ceiling and the path it replaces, all in one run:
//   nccl    - the NCCL transport, one-rank communicator: each layer one grouped send/recv to
//             itself, all layers posted, then all awaited (as a prefill rank posts them);
//   d2d     - cudaMemcpyAsync of the same layers on one stream: the device's copy ceiling;
//   staged  - the host-staged path: each layer device -> pinned host (async, one event per
//             layer), a UCX put into a second host region as soon as its copy is done, then
//             host -> device as soon as its put lands; the three stages overlap across layers.
// Buffers are 512 MiB each, far beyond the 50 MB L2, so no layer is served from cache.
//
// Usage: baton_bench_nccl [--quick] [--transport ucx|loopback]   (exit 2: no GPU or no NCCL)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "bench/bench_stats.hpp"
#include "transport/loopback.hpp"
#include "transport/nccl.hpp"
#include "transport/ucx.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::transport;
using clock_type = std::chrono::steady_clock;

using baton::bench::median;

namespace {

double since_ms(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

/// Polls `id` until it settles, for at most 10 s.
xfer_state settle(transport& t, uint64_t id, xfer_error* err) {
  const auto give_up = clock_type::now() + std::chrono::seconds{10};
  xfer_state s;
  while ((s = t.poll(id, err)) == xfer_state::pending && clock_type::now() < give_up) std::this_thread::yield();
  return s;
}

bool wait_all(transport& t, const std::vector<uint64_t>& ids) {
  bool ok = true;
  xfer_error err;
  for (auto id : ids) {
    const xfer_state s = settle(t, id, &err);
    if (s == xfer_state::pending) ok = false, std::fprintf(stderr, "put %llu still pending after 10 s\n", (unsigned long long)id);
    if (s == xfer_state::failed) ok = false, std::fprintf(stderr, "put failed: %s\n", err.to_string().c_str());
    t.release(id);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string host_kind = "ucx";
  baton::deploy::flag_set flags;
  flags.add("--quick", &quick, "smaller copies, fewer repetitions");
  flags.add("--transport", &host_kind, "the staged path's host transport: ucx or loopback");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--quick] [--transport T]")) return *rc;
  std::string why;
  auto nccl = make_nccl_transport({.name = "gpu-0"}, &why);
  if (!nccl) return std::fprintf(stderr, "baton_bench_nccl: %s\n", why.c_str()), 2;
  const uint64_t total = quick ? (128ull << 20) : (512ull << 20);
  const int reps = quick ? 3 : 5;
  xfer_error err;
  std::byte* src = nccl->allocate_memory(total, &err);
  std::byte* dst = nccl->allocate_memory(total, &err);
  if (!src || !dst) return std::fprintf(stderr, "baton_bench_nccl: %s\n", err.to_string().c_str()), 1;
  cudaMemset(src, 0x5a, total);
  cudaMemset(dst, 0, total);
  auto ks = nccl->register_region(src, total, &err);
  auto kd = nccl->register_region(dst, total, &err);
  if (!ks || !kd) return std::fprintf(stderr, "baton_bench_nccl: %s\n", err.to_string().c_str()), 1;

  // The host side of the staged path: two pinned host regions and two endpoints of the host
  // transport, the destination in that transport's own memory (as a decode rank's pool is).
  auto fabric = make_loopback_fabric();
  auto host_ep = [&](const char* name) -> std::shared_ptr<transport> {
    if (host_kind == "loopback") return make_loopback_transport(fabric, name);
    return make_ucx_transport({name}, &why);
  };
  auto ha = host_ep("host-a");
  auto hb = host_ep("host-b");
  if (!ha || !hb) return std::fprintf(stderr, "baton_bench_nccl: host transport: %s\n", why.c_str()), 1;
  std::vector<std::byte> stage_a_mem(total);
  auto stage_b = transport_memory(hb, total, &err);
  if (!stage_b) return std::fprintf(stderr, "baton_bench_nccl: no host staging memory: %s\n", err.to_string().c_str()), 1;
  std::byte* stage_a = stage_a_mem.data();
  std::memset(stage_a, 0, total);
  std::memset(stage_b.get(), 0, total);
  // Pinned, or the staged path's PCIe copies would run at pageable speed and flatter NCCL.
  if (cudaHostRegister(stage_a, total, cudaHostRegisterPortable) != cudaSuccess ||
      cudaHostRegister(stage_b.get(), total, cudaHostRegisterPortable) != cudaSuccess)
    return std::fprintf(stderr, "baton_bench_nccl: cannot pin the host staging buffers\n"), 1;
  auto ka = ha->register_region(stage_a, total, &err);
  auto kb = hb->register_region(stage_b.get(), total, &err);
  if (!ka || !kb) return std::fprintf(stderr, "baton_bench_nccl: %s\n", err.to_string().c_str()), 1;

  cudaStream_t d2h, h2d, copy;
  cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking);

  std::printf("| layer | layers | NCCL put, one rank | D2D memcpy (ceiling) | NCCL / D2D | host-staged (D2H + %s + H2D) | "
              "NCCL / staged | bytes equal |\n|---|---|---|---|---|---|---|---|\n",
              host_kind.c_str());
  for (uint64_t layer : {1ull << 20, 4ull << 20, 16ull << 20}) {
    const uint32_t layers = static_cast<uint32_t>(total / layer);
    std::vector<double> t_nccl, t_d2d, t_staged;
    bool equal = true;
    for (int rep = 0; rep < reps; ++rep) {
      cudaMemset(dst, rep & 1, total);
      cudaDeviceSynchronize();
      auto t0 = clock_type::now();
      std::vector<uint64_t> ids;
      for (uint32_t l = 0; l < layers; ++l)
        ids.push_back(nccl->post_put({1, l, "gpu-0", ks->region_id, *kd, {{l * layer, l * layer, layer}}}));
      if (!wait_all(*nccl, ids)) return 1;
      t_nccl.push_back(since_ms(t0));
      if (rep == 0) {  // every byte arrived: compare the regions on the host once per size
        std::vector<uint8_t> a(total), b(total);
        cudaMemcpy(a.data(), src, total, cudaMemcpyDeviceToHost);
        cudaMemcpy(b.data(), dst, total, cudaMemcpyDeviceToHost);
        equal = a == b;
      }

      t0 = clock_type::now();
      for (uint32_t l = 0; l < layers; ++l)
        cudaMemcpyAsync(dst + l * layer, src + l * layer, layer, cudaMemcpyDeviceToDevice, copy);
      cudaStreamSynchronize(copy);
      t_d2d.push_back(since_ms(t0));

      t0 = clock_type::now();
      std::vector<cudaEvent_t> down(layers);
      for (uint32_t l = 0; l < layers; ++l) {
        cudaEventCreateWithFlags(&down[l], cudaEventDisableTiming);
        cudaMemcpyAsync(stage_a + l * layer, src + l * layer, layer, cudaMemcpyDeviceToHost, d2h);
        cudaEventRecord(down[l], d2h);
      }
      std::vector<uint64_t> puts(layers);
      for (uint32_t l = 0; l < layers; ++l) {
        cudaEventSynchronize(down[l]);
        puts[l] = ha->post_put({1, l, "host-b", ka->region_id, *kb, {{l * layer, l * layer, layer}}});
      }
      for (uint32_t l = 0; l < layers; ++l) {
        if (settle(*ha, puts[l], &err) != xfer_state::done)
          return std::fprintf(stderr, "staged put: %s\n", err.to_string().c_str()), 1;
        ha->release(puts[l]);
        cudaMemcpyAsync(dst + l * layer, stage_b.get() + l * layer, layer, cudaMemcpyHostToDevice, h2d);
      }
      cudaStreamSynchronize(h2d);
      t_staged.push_back(since_ms(t0));
      for (auto e : down) cudaEventDestroy(e);
    }
    const double gb = static_cast<double>(total) / 1e9;
    const double n = median(t_nccl), c = median(t_d2d), s = median(t_staged);
    std::printf("| %llu MiB | %u | %.1f GB/s (%.2f ms) | %.1f GB/s (%.2f ms) | %.0f %% | %.1f GB/s (%.2f ms) | %.1fx | %s |\n",
                static_cast<unsigned long long>(layer >> 20), layers, gb / (n / 1e3), n, gb / (c / 1e3), c, 100.0 * c / n,
                gb / (s / 1e3), s, s / n, equal ? "yes" : "NO");
  }
  cudaStreamDestroy(d2h);
  cudaStreamDestroy(h2d);
  cudaStreamDestroy(copy);
  ha->deregister_region(ka->region_id);
  hb->deregister_region(kb->region_id);
  cudaHostUnregister(stage_a);
  cudaHostUnregister(stage_b.get());
  nccl->deregister_region(ks->region_id);
  nccl->deregister_region(kd->region_id);
  nccl->free_memory(src);
  nccl->free_memory(dst);
  return 0;
}
