// The NCCL backend on one GPU (issue 6): a one-rank communicator's grouped send/recv to itself,
// from one device region into another, gives the same bytes as the host-staged path (device ->
// pinned host -> the loopback transport -> host -> device); bad input fails by name. Each case
// skips where the machine has no GPU or the build has no NCCL.

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/cuda/kernels.hpp"
#include "tests/transport/settle.hpp"
#include "transport/loopback.hpp"
#include "transport/nccl.hpp"

using namespace baton;
using namespace baton::transport;

namespace {

const bool no_nccl_gpu = !nccl_built() || gpu::cuda::device_count() == 0;

/// Scattered, out-of-order segments of different sizes, as a layer's pages are.
std::vector<segment> scattered(uint64_t region) {
  // Destinations do not overlap: the group's sends may run in any order.
  return {{0, region / 2, 4096},
          {3 * 4096, 0, 16 * 4096},
          {region / 4, region / 4 + 8192, 1 << 20},
          {region - 12345, 3 * region / 4 + 100, 12345},
          {77, region - 8192, 4096}};
}

}  // namespace

TEST_CASE("nccl transport: a one-rank put equals the host-staged path, byte for byte" * doctest::skip(no_nccl_gpu)) {
  std::atomic<int> settled{0};  // before the transport: its host callback may run until the transport is gone
  std::string why;
  auto nccl = make_nccl_transport({.name = "gpu-0"}, &why);
  REQUIRE_MESSAGE(nccl, why);
  CHECK(nccl->caps().name == "nccl");
  CHECK(nccl->caps().device_memory);
  nccl->set_settled_listener([&] { ++settled; });

  constexpr uint64_t size = 8 << 20;
  std::vector<uint8_t> pattern(size);
  for (uint64_t i = 0; i < size; ++i) pattern[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  xfer_error err;
  std::byte* src = nccl->allocate_memory(size, &err);
  std::byte* dst = nccl->allocate_memory(size, &err);
  REQUIRE_MESSAGE(src, err.to_string());
  REQUIRE_MESSAGE(dst, err.to_string());
  REQUIRE(cudaMemcpy(src, pattern.data(), size, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemset(dst, 0, size) == cudaSuccess);
  auto ks = nccl->register_region(src, size, &err);
  auto kd = nccl->register_region(dst, size, &err);
  REQUIRE_MESSAGE(ks, err.to_string());
  REQUIRE_MESSAGE(kd, err.to_string());

  const auto segs = scattered(size);
  // The fill and the clear ran on the legacy stream; the transport's stream does not wait for it.
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const uint64_t id = nccl->post_put({7, 3, "gpu-0", ks->region_id, *kd, segs});
  REQUIRE_MESSAGE(test::settle(*nccl, id, &err) == xfer_state::done, err.to_string());
  nccl->release(id);
  std::vector<uint8_t> got(size);
  REQUIRE(cudaMemcpy(got.data(), dst, size, cudaMemcpyDeviceToHost) == cudaSuccess);

  // The host-staged path: device -> pinned host, a loopback put between two host regions, host
  // -> device, with the same segments.
  auto fabric = make_loopback_fabric();
  auto a = make_loopback_transport(fabric, "host-a");
  auto b = make_loopback_transport(fabric, "host-b");
  void *ha = nullptr, *hb = nullptr;
  REQUIRE(cudaMallocHost(&ha, size) == cudaSuccess);
  REQUIRE(cudaMallocHost(&hb, size) == cudaSuccess);
  REQUIRE(cudaMemcpy(ha, src, size, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::memset(hb, 0, size);
  auto ka = a->register_region(static_cast<std::byte*>(ha), size, &err);
  auto kb = b->register_region(static_cast<std::byte*>(hb), size, &err);
  const uint64_t hid = a->post_put({7, 3, "host-b", ka->region_id, *kb, segs});
  REQUIRE(test::settle(*a, hid, &err) == xfer_state::done);
  a->release(hid);
  std::byte* staged = nccl->allocate_memory(size, &err);
  REQUIRE(cudaMemcpy(staged, hb, size, cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<uint8_t> via_host(size);
  REQUIRE(cudaMemcpy(via_host.data(), staged, size, cudaMemcpyDeviceToHost) == cudaSuccess);

  CHECK(got == via_host);
  // And both are what the segments say: the bytes moved, nothing else was written.
  std::vector<uint8_t> want(size, 0);
  for (const auto& s : segs) std::memcpy(want.data() + s.dst_offset, pattern.data() + s.src_offset, s.size_bytes);
  CHECK(got == want);
  // The listener heard of the settled put from the stream's host callback.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds{5};
  while (settled.load() == 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  CHECK(settled.load() >= 1);

  nccl->deregister_region(ks->region_id);
  nccl->deregister_region(kd->region_id);
  nccl->free_memory(src);
  nccl->free_memory(dst);
  nccl->free_memory(staged);
  cudaFreeHost(ha);
  cudaFreeHost(hb);
}

TEST_CASE("nccl transport: bad input fails naming what was wrong, and the transport keeps working" *
          doctest::skip(no_nccl_gpu)) {
  std::string why;
  auto nccl = make_nccl_transport({.name = "gpu-0"}, &why);
  REQUIRE_MESSAGE(nccl, why);
  xfer_error err;
  std::vector<std::byte> host(4096);
  CHECK_FALSE(nccl->register_region(host.data(), host.size(), &err));
  CHECK(err.what.find("host memory") != std::string::npos);

  constexpr uint64_t size = 1 << 20;
  std::byte* src = nccl->allocate_memory(size, &err);
  std::byte* dst = nccl->allocate_memory(size, &err);
  REQUIRE(src);
  REQUIRE(dst);
  auto ks = nccl->register_region(src, size, &err);
  auto kd = nccl->register_region(dst, size, &err);
  REQUIRE(ks);
  REQUIRE(kd);

  // A segment past the destination's end.
  uint64_t id = nccl->post_put({11, 5, "gpu-0", ks->region_id, *kd, {{0, size - 100, 4096}}});
  CHECK(test::settle(*nccl, id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::out_of_bounds);
  CHECK(err.to_string().find("request 11") != std::string::npos);
  CHECK(err.to_string().find("layer 5") != std::string::npos);
  nccl->release(id);

  // A key from another backend, and one claiming another rank of the communicator.
  auto foreign = *kd;
  foreign.backend = "ucx";
  id = nccl->post_put({12, 0, "gpu-0", ks->region_id, foreign, {{0, 0, 4096}}});
  CHECK(test::settle(*nccl, id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::unknown_region);
  nccl->release(id);
  // A key naming a rank this one-rank communicator does not have. (A put to another rank of a
  // real communicator fails naming it; one GPU cannot form one.)
  auto other_rank = *kd;
  other_rank.packed[0] = 1;
  id = nccl->post_put({13, 0, "gpu-1", ks->region_id, other_rank, {{0, 0, 4096}}});
  CHECK(test::settle(*nccl, id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::unknown_region);
  CHECK(err.what.find("another NCCL communicator") != std::string::npos);
  nccl->release(id);

  // Still good for a sound put.
  id = nccl->post_put({14, 0, "gpu-0", ks->region_id, *kd, {{0, 0, size}}});
  CHECK(test::settle(*nccl, id, &err) == xfer_state::done);
  nccl->release(id);
  nccl->free_memory(src);
  nccl->free_memory(dst);
}
