// The CUDA IPC backend (issue 12, part 4): puts between device regions, inside one process and
// from a second process (this binary again, `--cuda-ipc-put-child`), land byte for byte at
// their segments and nowhere else; bad input fails by name. Written without a GPU: the cases
// are in the suite "unverified" until they have passed on the H200.

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "deploy/processes.hpp"
#include "gpu/cuda/kernels.hpp"
#include "tests/transport/settle.hpp"
#include "transport/cuda_ipc.hpp"

using namespace baton;
using namespace baton::transport;

namespace {

constexpr uint64_t region_bytes = 8 << 20;
constexpr uint64_t region_offset = 4096;  ///< regions start inside their allocation: the key's offset is used

uint8_t pattern(uint64_t i, uint32_t seed) { return static_cast<uint8_t>((i * 2654435761u >> 13) ^ seed); }

/// Scattered, out-of-order segments of different sizes, some continuing each other (so they
/// coalesce), as a layer's pages are.
std::vector<segment> scattered(uint64_t region) {
  return {{0, region / 2, 4096},
          {4096, region / 2 + 4096, 4096},  // continues the one before on both sides
          {3 * 4096, 0, 16 * 4096},
          {region / 4, region / 4 + 8192, 1 << 20},
          {region - 12345, 3 * region / 4 + 100, 12345},
          {77, region - 8192, 4096}};
}

/// A device allocation of the transport, zeroed, and a region over it from region_offset on.
struct device_region {
  std::byte* base = nullptr;
  region_key key;
};

device_region make_region(transport::transport& t, std::string* why) {
  xfer_error err;
  device_region r;
  r.base = t.allocate_memory(region_offset + region_bytes, &err);
  if (!r.base) return *why = err.to_string(), r;
  cudaMemset(r.base, 0, region_offset + region_bytes);
  cudaDeviceSynchronize();  // the transport's stream waits for no other
  auto key = t.register_region(r.base + region_offset, region_bytes, &err);
  if (!key) return *why = err.to_string(), r;
  r.key = *key;
  return r;
}

/// Fills the region with pattern(seed).
bool fill(const device_region& r, uint32_t seed) {
  std::vector<uint8_t> host(region_bytes);
  for (uint64_t i = 0; i < host.size(); ++i) host[i] = pattern(i, seed);
  // Synchronised: a pageable copy may return before its last bytes land, and the transport's
  // stream waits for no other.
  return cudaMemcpy(r.base + region_offset, host.data(), region_bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
}

/// Bytes of `dst` (its region) that differ from what the puts of scattered() from a region of
/// pattern(seed) leave: the source's bytes at each segment, zeros elsewhere.
uint64_t wrong_bytes(const device_region& dst, uint32_t seed) {
  std::vector<uint8_t> got(region_bytes), want(region_bytes, 0);
  if (cudaMemcpy(got.data(), dst.base + region_offset, region_bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
    return UINT64_MAX;
  for (const auto& s : scattered(region_bytes))
    for (uint64_t i = 0; i < s.size_bytes; ++i) want[s.dst_offset + i] = pattern(s.src_offset + i, seed);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < region_bytes; ++i) bad += got[i] != want[i];
  // The allocation's bytes before the region stay zero.
  std::vector<uint8_t> head(region_offset);
  cudaMemcpy(head.data(), dst.base, region_offset, cudaMemcpyDeviceToHost);
  for (auto b : head) bad += b != 0;
  return bad;
}

const bool no_gpu = !cuda_ipc_built() || gpu::cuda::device_count() == 0;

}  // namespace

namespace baton::test {

/// The second process of the cross-process case: reads the parent's key (one line on stdin),
/// puts scattered() from a region of pattern(5) into it, then a segment past its end. Exit code
/// 0 when all went as it should; else 1, and what went wrong on stderr.
int cuda_ipc_put_child() {
  std::string line;
  std::getline(std::cin, line);
  auto say = [](const std::string& what) {
    std::cerr << "cuda_ipc_put_child: " << what << std::endl;
    return what.rfind("failed", 0) == 0 ? 1 : 0;
  };
  const auto key = key_from_text(line);
  if (!key) return say("failed: the parent's key line is malformed: " + line);
  std::string why;
  auto t = make_cuda_ipc_transport({.name = "child"}, &why);
  if (!t) return say("failed: " + why);
  auto src = make_region(*t, &why);
  if (!why.empty()) return say("failed: " + why);
  if (!fill(src, 5)) return say("failed: cannot fill the source");
  put_desc d{7, 3, "parent", src.key.region_id, *key, scattered(region_bytes)};
  xfer_error err;
  const auto id = t->post_put(d);
  if (auto s = test::settle(*t, id, &err); s != xfer_state::done)
    return say("failed: the put " + std::string(s == xfer_state::pending ? "never settled" : err.to_string()));
  t->release(id);
  d.segments = {{0, region_bytes - 10, 11}};  // one byte past the parent's region
  const auto past = t->post_put(d);
  if (test::settle(*t, past, &err) != xfer_state::failed || err.code != xfer_errc::out_of_bounds)
    return say("failed: a put past the parent's region was not refused as out of bounds");
  return say("ok " + std::to_string(t->stats().keys) + " opened");
}

}  // namespace baton::test

TEST_CASE("cuda_ipc transport in one process: a put lands at its segments and nowhere else; bad input fails by name" *
          doctest::skip(no_gpu) * doctest::test_suite("unverified")) {
  std::atomic<int> settled{0};  // before the transport: its host callback may run until the transport is gone
  std::string why;
  auto t = make_cuda_ipc_transport({.name = "gpu-0"}, &why);
  REQUIRE_MESSAGE(t, why);
  t->set_settled_listener([&] { ++settled; });
  auto src = make_region(*t, &why);
  REQUIRE_MESSAGE(why.empty(), why);
  auto dst = make_region(*t, &why);
  REQUIRE_MESSAGE(why.empty(), why);
  REQUIRE(fill(src, 1));
  xfer_error err;
  const auto id = t->post_put({1, 0, "decode-0", src.key.region_id, dst.key, scattered(region_bytes)});
  REQUIRE_MESSAGE(test::settle(*t, id, &err) == xfer_state::done, err.to_string());
  t->release(id);
  CHECK(wrong_bytes(dst, 1) == 0);
  for (int i = 0; i < 1000 && settled == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  CHECK(settled > 0);

  // Host memory is not registered, and the error says what it is.
  std::vector<std::byte> host(4096);
  CHECK_FALSE(t->register_region(host.data(), host.size(), &err));
  CHECK(err.what.find("host memory") != std::string::npos);
  auto fails = [&](put_desc d, xfer_errc code, const std::string& says) {
    const auto x = t->post_put(d);
    xfer_error e;
    CHECK(test::settle(*t, x, &e) == xfer_state::failed);
    CHECK(e.code == code);
    CHECK_MESSAGE(e.what.find(says) != std::string::npos, e.what);
    CHECK(e.request_id == 9);
    t->release(x);
  };
  fails({9, 2, "decode-0", src.key.region_id, dst.key, {{0, region_bytes - 1, 2}}}, xfer_errc::out_of_bounds, "outside");
  auto nccl_key = dst.key;
  nccl_key.backend = "nccl";
  fails({9, 2, "decode-0", src.key.region_id, nccl_key, {{0, 0, 1}}}, xfer_errc::unknown_region, "not a cuda_ipc one");
  auto parts = *unpack_cuda_ipc_key(dst.key, &why);
  parts.host ^= 1;
  auto elsewhere = dst.key;
  elsewhere.packed = pack_cuda_ipc_key(parts);
  fails({9, 2, "decode-0", src.key.region_id, elsewhere, {{0, 0, 1}}}, xfer_errc::unknown_region, "another host");
  fails({9, 2, "decode-0", 12345, dst.key, {{0, 0, 1}}}, xfer_errc::unknown_region, "no local region 12345");

  // Two transports of one process (two ranks in it): a put from one reaches the other's region,
  // not a region of its own with the same id.
  auto other = make_cuda_ipc_transport({.name = "gpu-0b"}, &why);
  REQUIRE_MESSAGE(other, why);
  auto theirs = make_region(*other, &why);
  REQUIRE_MESSAGE(why.empty(), why);
  REQUIRE(theirs.key.region_id == src.key.region_id);  // the same id in each transport
  const auto across = t->post_put({2, 0, "gpu-0b", src.key.region_id, theirs.key, scattered(region_bytes)});
  REQUIRE_MESSAGE(test::settle(*t, across, &err) == xfer_state::done, err.to_string());
  t->release(across);
  CHECK(wrong_bytes(theirs, 1) == 0);

  // A region inside an allocation the transport did not make: the key's offset is its place in it.
  void* foreign = nullptr;
  REQUIRE(cudaMalloc(&foreign, region_offset + region_bytes) == cudaSuccess);
  REQUIRE(cudaMemset(foreign, 0, region_offset + region_bytes) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  device_region inside{static_cast<std::byte*>(foreign), {}};
  auto inside_key = t->register_region(inside.base + region_offset, region_bytes, &err);
  REQUIRE_MESSAGE(inside_key, err.to_string());
  CHECK(unpack_cuda_ipc_key(*inside_key, &why)->offset == region_offset);
  inside.key = *inside_key;
  const auto into = t->post_put({3, 0, "decode-0", src.key.region_id, inside.key, scattered(region_bytes)});
  REQUIRE_MESSAGE(test::settle(*t, into, &err) == xfer_state::done, err.to_string());
  t->release(into);
  CHECK(wrong_bytes(inside, 1) == 0);
  // One that runs past its allocation is refused.
  CHECK_FALSE(t->register_region(inside.base + region_offset, region_bytes + 2 * region_offset + (4 << 20), &err));
  CHECK(err.what.find("runs past its allocation") != std::string::npos);
  t->deregister_region(inside.key.region_id);
  cudaFree(foreign);
  other->free_memory(theirs.base);
  t->free_memory(src.base);
  t->free_memory(dst.base);
}

TEST_CASE("cuda_ipc transport across processes: a second process's put lands in this one's device memory at its "
          "segments and nowhere else, and one past the region is refused" *
          doctest::skip(no_gpu) * doctest::test_suite("unverified")) {
  std::string why;
  auto t = make_cuda_ipc_transport({.name = "decode-0"}, &why);
  REQUIRE_MESSAGE(t, why);
  auto dst = make_region(*t, &why);
  REQUIRE_MESSAGE(why.empty(), why);
  // The second process: this binary again, told the region's key on its stdin.
  int to_child = -1;
  const pid_t pid = deploy::spawn_process({deploy::self_executable(), "--cuda-ipc-put-child"}, &why, {}, false, &to_child);
  REQUIRE_MESSAGE(pid > 0, why);
  const std::string line = key_to_text(dst.key) + "\n";
  const auto old_pipe = signal(SIGPIPE, SIG_IGN);  // a child that died already must not take this process with it
  CHECK(write(to_child, line.data(), line.size()) == static_cast<ssize_t>(line.size()));
  signal(SIGPIPE, old_pipe);
  close(to_child);
  // Its end, bounded (60 s), else it is stopped.
  std::string how;
  bool ended = false;
  for (int i = 0; i < 6000 && !(ended = deploy::process_exited(pid, &how)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  if (!ended) {
    std::vector<pid_t> left{pid};
    deploy::stop_processes(left, 0);
  }
  REQUIRE_MESSAGE((ended && how == "exit code 0"),
                  "the child " << (ended ? "ended with " + how : std::string{"hung and was stopped"})
                               << " (what went wrong is on stderr)");
  CHECK(wrong_bytes(dst, 5) == 0);
  t->free_memory(dst.base);
}
