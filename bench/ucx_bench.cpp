// Layer-wise KV send throughput over Baton's UCX transport between two processes, next to a
// cold memcpy measured in the same run. The sender walks a 256 MiB source (far larger than the
// L3 cache) in "layers" of 1-16 MiB, keeping a few layers in flight as a prefill rank does; each
// layer is one transfer (puts + flush: remote-complete when polled done).
// bench/ucx_bench.sh runs it next to ucx_perftest with the same transport and sizes.
//
// The receiver's buffer is the transport's own memory (transport::allocate_memory, as a rank's
// KV pool is), which UCX makes a shared-memory segment the sender stores into directly;
// `--receiver-memory heap` registers ordinary memory instead, whose puts UCX emulates with
// messages the receiver's progress thread must serve.
//
// `--buffers hot` sends every layer from and to offset 0, so both ends stay in the cache while a
// layer fits it: that is what ucx_perftest does (it has no option to walk a larger buffer), and
// the like-for-like row against it. The memcpy column then copies one chunk over and over.
//
// Usage: baton_bench_ucx [--layer-mib N ...] [--inflight N] [--total-mib N] [--send put|am]
//        [--receiver-memory transport|heap] [--buffers cold|hot]
//        (it starts itself as the receiver: `baton_bench_ucx --receiver transport|heap`)

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include "transport/ucx.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr uint64_t buffer_bytes = uint64_t{256} << 20;

/// Receiver: registers its buffer, prints the key, keeps the transport alive until stdin closes.
int run_receiver(const std::string& memory) {
  std::string why;
  auto t = transport::make_ucx_transport({"receiver"}, &why);
  if (!t) {
    std::fprintf(stderr, "receiver: %s\n", why.c_str());
    return 1;
  }
  std::vector<std::byte> heap;
  transport::xfer_error err;
  std::byte* buf = nullptr;
  if (memory == "heap") {
    heap.resize(buffer_bytes);
    buf = heap.data();
  } else if (!(buf = t->allocate_memory(buffer_bytes, &err))) {
    std::fprintf(stderr, "receiver: %s\n", err.to_string().c_str());
    return 1;
  }
  std::memset(buf, 0, buffer_bytes);  // committed before timing, in both kinds
  auto key = t->register_region(buf, buffer_bytes, &err);
  if (!key) return 1;
  std::printf("%s\n", transport::key_to_text(*key).c_str());
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);  // the sender closes the pipe when done
  return 0;
}

/// memcpy of `chunk`-sized pieces: walking 256 MiB twice (cold), or one chunk again and again (hot).
double memcpy_gbps(uint64_t chunk, bool hot) {
  std::vector<char> src(buffer_bytes, 1), dst(buffer_bytes, 0);
  auto t0 = clock_type::now();
  uint64_t moved = 0;
  for (int rep = 0; rep < 2; ++rep)
    for (uint64_t off = 0; off + chunk <= buffer_bytes; off += chunk, moved += chunk)
      std::memcpy(dst.data() + (hot ? 0 : off), src.data() + (hot ? 0 : off), chunk);
  return static_cast<double>(moved) / std::chrono::duration<double>(clock_type::now() - t0).count() / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> layer_mib;
  uint32_t inflight = 4;
  uint64_t total_mib = 2048;
  std::string send = "put", receiver_memory = "transport";
  std::string receiver_role, buffers = "cold";
  std::vector<std::string> layer_mib_text;
  deploy::flag_set flags;
  flags.add("--layer-mib", &layer_mib_text, "a layer's size in MiB, one row each (repeatable; default 1, 4, 16)");
  flags.add("--inflight", &inflight, "puts in flight at once");
  flags.add("--total-mib", &total_mib, "MiB sent per row");
  flags.add("--send", &send, "put (RMA) or am (active messages)");
  flags.add("--receiver-memory", &receiver_memory, "transport (registered by the transport) or heap");
  flags.add("--buffers", &buffers, "cold (fresh each pass) or hot (reused)");
  flags.add("--receiver", &receiver_role, "internal: run as the receiving process, its memory transport or heap");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--layer-mib N ...] [--inflight N] [--total-mib N] [--send put|am] ...")) return *rc;
  if (!receiver_role.empty()) return run_receiver(receiver_role);
  if (receiver_memory != "transport" && receiver_memory != "heap")
    return std::fprintf(stderr, "--receiver-memory must be transport or heap, not %s\n", receiver_memory.c_str()), 2;
  if (buffers != "cold" && buffers != "hot") return std::fprintf(stderr, "--buffers must be cold or hot, not %s\n", buffers.c_str()), 2;
  if (send != "put" && send != "am") return std::fprintf(stderr, "--send must be put or am, not %s\n", send.c_str()), 2;
  const bool hot = buffers == "hot";
  for (const auto& t : layer_mib_text) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(t.c_str(), &end, 10);
    if (t.empty() || *end != '\0' || v == 0 || v > 65536)
      return std::fprintf(stderr, "--layer-mib expects 1 to 65536, got '%s'\n", t.c_str()), 2;
    layer_mib.push_back(v);
  }
  if (inflight == 0 || total_mib == 0) return std::fprintf(stderr, "--inflight and --total-mib must be >= 1\n"), 2;
  if (layer_mib.empty()) layer_mib = {1, 4, 16};

  // The receiver: a second process, talking over a pipe for the key only.
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    execl("/proc/self/exe", argv[0], "--receiver", receiver_memory.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  FILE* in = fdopen(from_child[0], "r");
  char line[8192];
  if (!fgets(line, sizeof(line), in)) {
    std::fprintf(stderr, "receiver did not start\n");
    return 1;
  }
  const auto parsed = transport::key_from_text(line);
  if (!parsed) {
    std::fprintf(stderr, "receiver sent a malformed key\n");
    return 1;
  }
  const transport::region_key remote = *parsed;

  std::string why;
  auto t = transport::make_ucx_transport({.name = "sender", .send = send}, &why);
  if (!t) {
    std::fprintf(stderr, "sender: %s\n", why.c_str());
    return 1;
  }
  std::vector<std::byte> src(buffer_bytes, std::byte{7});
  transport::xfer_error err;
  auto local = t->register_region(src.data(), src.size(), &err);
  if (!local) return 1;

  std::printf("| layer size | Baton UCX %s, %u layers in flight, %s buffers | %s memcpy, same chunks |\n|---|---|---|\n",
              send == "am" ? "rendezvous active messages" : "put", inflight, hot ? "hot" : "cold",
              hot ? "hot" : "cold");
  // One untimed pass over the whole buffer: the first store into each page of the receiver's
  // segment faults the page into this process's mapping (65,536 faults for 256 MiB), which a
  // long-lived rank pays once and which would otherwise land on the first row only.
  for (uint64_t off = 0; off < buffer_bytes; off += uint64_t{16} << 20) {
    const auto id = t->post_put({0, 0, "receiver", local->region_id, remote, {{off, off, uint64_t{16} << 20}}});
    transport::xfer_state s;
    while ((s = t->poll(id, &err)) == transport::xfer_state::pending) std::this_thread::yield();
    t->release(id);
    if (s == transport::xfer_state::failed) {
      std::fprintf(stderr, "warm-up put failed: %s\n", err.to_string().c_str());
      return 1;
    }
  }
  // Woken as a rank is: the transport's settled listener (on its progress thread) signals the
  // poller, which otherwise waits for the next transfer to settle. (Before, a 20 us sleep stood
  // in for a rank's timer; Linux's timer slack made it 60-80 us, a gap per layer a rank with the
  // listener does not have.)
  std::mutex settled_m;
  std::condition_variable settled_cv;
  uint64_t settled = 0;
  t->set_settled_listener([&] {
    std::lock_guard<std::mutex> lock{settled_m};
    ++settled;
    settled_cv.notify_one();
  });
  for (auto mib : layer_mib) {
    const uint64_t layer = mib << 20, total = total_mib << 20;
    std::vector<uint64_t> pending;
    uint64_t off = 0, sent = 0;
    auto post_one = [&] {
      pending.push_back(t->post_put({0, 0, "receiver", local->region_id, remote, {{off, off, layer}}}));
      off = (hot || off + layer + layer > buffer_bytes) ? 0 : off + layer;
      sent += layer;
    };
    auto t0 = clock_type::now();
    while (sent < total || !pending.empty()) {
      while (sent < total && pending.size() < inflight) post_one();
      uint64_t seen;
      {
        std::lock_guard<std::mutex> lock{settled_m};
        seen = settled;
      }
      const auto s = t->poll(pending.front(), &err);
      if (s == transport::xfer_state::pending) {
        // Not a spin that steals the progress thread's core: wait for the next settle (bounded,
        // so a missed wake costs a millisecond, not the run).
        std::unique_lock<std::mutex> lock{settled_m};
        settled_cv.wait_for(lock, std::chrono::milliseconds{1}, [&] { return settled != seen; });
        continue;
      }
      if (s == transport::xfer_state::failed) {
        std::fprintf(stderr, "put failed: %s\n", err.to_string().c_str());
        return 1;
      }
      t->release(pending.front());
      pending.erase(pending.begin());
    }
    const double gbps = static_cast<double>(total) / std::chrono::duration<double>(clock_type::now() - t0).count() / 1e9;
    std::printf("| %llu MiB | %.2f GB/s | %.2f GB/s |\n", static_cast<unsigned long long>(mib), gbps, memcpy_gbps(layer, hot));
  }
  t->set_settled_listener({});
  close(to_child[1]);  // lets the receiver exit
  int status = 0;
  waitpid(pid, &status, 0);
  return 0;
}
