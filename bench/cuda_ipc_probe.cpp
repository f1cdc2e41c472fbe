// Does CUDA IPC work between two processes on this machine (issue 12, part 4)? The H200 machine
// runs in a microVM, where legacy CUDA IPC (cudaIpcGetMemHandle) may be refused; a same-host
// prefill -> decode handoff through it is worth building only if it works there. This probe
// answers in one run, before any transport is written against it:
//   1. the parent fills a device buffer with a known pattern and exports it (and an event);
//   2. a child process (this binary again, exec'd before the parent touches CUDA) opens both,
//      times device-to-device copies out of the parent's buffer, checks every word, then writes
//      a second pattern into the parent's buffer and records the event;
//   3. the parent waits on the shared event and checks that the child's writes are visible.
// Compared in the same run with device-to-device copies inside one process (the ceiling).
// Then the transport stage: the same through Baton's cuda_ipc transport (transport/cuda_ipc.hpp),
// a second child putting a 1K-token prompt's KV (Llama-3-8B bf16: 32 layers of 64 pages of
// 64 KiB, one put per layer) into this process's pool, to consecutive pages and to scattered
// ones; this process then checks every byte.
// Exit code: 0 it works, 3 it does not (the line says which call refused), 2 no GPU.
//   baton_cuda_ipc_probe [--mib N]

#include <cuda_runtime.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/cuda_ipc.hpp"

extern char** environ;

namespace {

constexpr int reps = 10;

uint32_t pattern(uint64_t i, uint32_t seed) { return static_cast<uint32_t>(i * 2654435761u) ^ seed; }

std::string err(const char* call, cudaError_t e) { return std::string(call) + ": " + cudaGetErrorString(e); }

/// Everything the child needs, sent over a pipe as bytes.
struct handoff {
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t event;
  uint64_t bytes;
};

/// Words of `dev` (device memory, `bytes` long) that differ from pattern(seed), counted on the host.
uint64_t mismatches(const void* dev, uint64_t bytes, uint32_t seed, std::string* why) {
  std::vector<uint32_t> host(bytes / 4);
  if (auto e = cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
    *why = err("cudaMemcpy to host", e);
    return UINT64_MAX;
  }
  uint64_t bad = 0;
  for (uint64_t i = 0; i < host.size(); ++i) bad += host[i] != pattern(i, seed);
  return bad;
}

cudaError_t fill(void* dev, uint64_t bytes, uint32_t seed) {
  std::vector<uint32_t> host(bytes / 4);
  for (uint64_t i = 0; i < host.size(); ++i) host[i] = pattern(i, seed);
  return cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice);
}

/// GB/s of `reps` device-to-device copies of `bytes` from `src` to `dst`, timed with events.
double copy_rate(void* dst, const void* src, uint64_t bytes, std::string* why) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);  // warm-up (and the mapping's first touch)
  cudaEventRecord(a);
  for (int r = 0; r < reps; ++r) cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(b);
  float ms = 0;
  auto e = cudaEventSynchronize(b);
  if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (e != cudaSuccess) return *why = err("device-to-device copies", e), 0.0;
  return static_cast<double>(bytes) * reps / (ms * 1e-3) / 1e9;
}

bool read_all(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t got = read(fd, c, n);
    if (got <= 0) return false;
    c += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

void say(int fd, const std::string& line) {
  const std::string l = line + "\n";
  if (write(fd, l.data(), l.size()) < 0) std::perror("write");
}

/// The child: opens the parent's buffer and event, copies and checks, writes seed 2 back.
int child(int in, int out) {
  handoff h{};
  if (!read_all(in, &h, sizeof h)) return say(out, "FAIL the parent sent no handles"), 1;
  std::string why;
  if (auto e = cudaSetDevice(0); e != cudaSuccess) return say(out, "FAIL " + err("cudaSetDevice", e)), 1;
  const auto t0 = std::chrono::steady_clock::now();
  void* peer = nullptr;
  if (auto e = cudaIpcOpenMemHandle(&peer, h.mem, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
    return say(out, "FAIL " + err("cudaIpcOpenMemHandle", e)), 1;
  const double open_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  cudaEvent_t done;
  if (auto e = cudaIpcOpenEventHandle(&done, h.event); e != cudaSuccess)
    return say(out, "FAIL " + err("cudaIpcOpenEventHandle", e)), 1;
  void* mine = nullptr;
  if (auto e = cudaMalloc(&mine, h.bytes); e != cudaSuccess) return say(out, "FAIL " + err("cudaMalloc", e)), 1;
  const double gbps = copy_rate(mine, peer, h.bytes, &why);
  if (!why.empty()) return say(out, "FAIL " + why), 1;
  const uint64_t bad = mismatches(mine, h.bytes, 1, &why);
  if (!why.empty()) return say(out, "FAIL " + why), 1;
  if (auto e = fill(peer, h.bytes, 2); e != cudaSuccess) return say(out, "FAIL " + err("writing the parent's buffer", e)), 1;
  cudaEventRecord(done);
  cudaDeviceSynchronize();
  char line[256];
  std::snprintf(line, sizeof line, "OK open_ms=%.2f gbps=%.1f bad_words=%llu", open_ms, gbps,
                static_cast<unsigned long long>(bad));
  say(out, line);
  // Stays until the parent has looked: the mapping must outlive the parent's check.
  char c;
  (void)read(in, &c, 1);
  cudaIpcCloseMemHandle(peer);
  return 0;
}

// The transport stage's shapes: a 1K-token prompt of Llama-3-8B in bf16 pages of 16 tokens.
constexpr uint32_t kv_layers = 32, prompt_pages = 64, pool_pages = 256;
constexpr uint64_t page_bytes = 2ull * 16 * 8 * 128 * 2;  // K and V, 16 tokens, 8 KV heads of 128, bf16
constexpr int put_reps = 5;

uint8_t byte_pattern(uint64_t i) { return static_cast<uint8_t>((i * 2654435761u >> 11) ^ 0x5a); }

/// The pool pages a prompt's pages land in: consecutive [0, 64), or 64 scattered ones from
/// [64, 256) (the same on both sides: a fixed seed).
std::vector<uint32_t> dst_pages(bool scattered) {
  std::vector<uint32_t> p(prompt_pages);
  if (!scattered) {
    for (uint32_t i = 0; i < prompt_pages; ++i) p[i] = i;
    return p;
  }
  std::vector<uint32_t> all;
  for (uint32_t i = prompt_pages; i < pool_pages; ++i) all.push_back(i);
  std::shuffle(all.begin(), all.end(), std::mt19937{42});
  std::copy_n(all.begin(), prompt_pages, p.begin());
  return p;
}

/// The put child: reads the parent's pool key (a line on stdin), puts the prompt's KV into it
/// put_reps times each way, and says the best times on stdout.
int put_child() {
  namespace xp = baton::transport;
  std::string line;
  std::getline(std::cin, line);
  auto say = [](const std::string& what) {
    std::cout << what << std::endl;
    return 0;
  };
  const auto key = xp::key_from_text(line);
  if (!key) return say("FAIL the parent's key line is malformed");
  std::string why;
  auto t = xp::make_cuda_ipc_transport({.name = "prefill"}, &why);
  if (!t) return say("FAIL " + why);
  xp::xfer_error err;
  const uint64_t src_bytes = uint64_t{kv_layers} * prompt_pages * page_bytes;
  std::byte* src = t->allocate_memory(src_bytes, &err);
  if (!src) return say("FAIL " + err.to_string());
  std::vector<uint8_t> host(src_bytes);
  for (uint64_t i = 0; i < src_bytes; ++i) host[i] = byte_pattern(i);
  // Synchronised: a pageable copy may return before its last bytes land, and the transport's
  // stream waits for no other.
  if (cudaMemcpy(src, host.data(), src_bytes, cudaMemcpyHostToDevice) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return say("FAIL filling the source");
  const auto src_key = t->register_region(src, src_bytes, &err);
  if (!src_key) return say("FAIL " + err.to_string());
  double best_ms[2] = {1e30, 1e30};
  for (int scattered = 0; scattered < 2; ++scattered) {
    const auto pages = dst_pages(scattered);
    for (int rep = 0; rep < put_reps; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<uint64_t> ids;
      for (uint32_t l = 0; l < kv_layers; ++l) {
        xp::put_desc d{1, l, "decode", src_key->region_id, *key, {}};
        for (uint32_t i = 0; i < prompt_pages; ++i)
          d.segments.push_back({(uint64_t{l} * prompt_pages + i) * page_bytes, (uint64_t{l} * pool_pages + pages[i]) * page_bytes,
                                page_bytes});
        ids.push_back(t->post_put(d));
      }
      for (auto id : ids) {
        xp::xfer_state s;
        for (int spin = 0; (s = t->poll(id, &err)) == xp::xfer_state::pending && spin < 10'000'000; ++spin) {
        }
        if (s != xp::xfer_state::done) return say("FAIL a put: " + (s == xp::xfer_state::pending ? "never settled" : err.to_string()));
        t->release(id);
      }
      best_ms[scattered] = std::min(best_ms[scattered],
                                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  char out[128];
  std::snprintf(out, sizeof out, "OK consecutive_ms=%.3f scattered_ms=%.3f", best_ms[0], best_ms[1]);
  return say(out);
}

/// The transport stage, in the parent (CUDA already initialised: the child is spawned, not forked).
int transport_stage(double local_gbps) {
  namespace xp = baton::transport;
  auto line = [](const std::string& what) { std::printf("cuda_ipc_transport: %s\n", what.c_str()); };
  std::string why;
  auto t = xp::make_cuda_ipc_transport({.name = "decode"}, &why);
  if (!t) return line("cannot start: " + why), 3;
  xp::xfer_error err;
  const uint64_t pool_bytes = uint64_t{kv_layers} * pool_pages * page_bytes;
  std::byte* pool = t->allocate_memory(pool_bytes, &err);
  if (!pool) return line(err.to_string()), 3;
  cudaMemset(pool, 0, pool_bytes);
  cudaDeviceSynchronize();
  const auto key = t->register_region(pool, pool_bytes, &err);
  if (!key) return line(err.to_string()), 3;
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return line("no pipe"), 3;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
  posix_spawn_file_actions_addclose(&fa, to_child[1]);
  posix_spawn_file_actions_addclose(&fa, from_child[0]);
  char arg0[] = "baton_cuda_ipc_probe", arg1[] = "--put-child";
  char* args[] = {arg0, arg1, nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, args, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(to_child[0]);
  close(from_child[1]);
  if (spawned != 0) return line("cannot start the put child"), 3;
  const std::string key_line = xp::key_to_text(*key) + "\n";
  if (write(to_child[1], key_line.data(), key_line.size()) < 0) std::perror("write");
  close(to_child[1]);
  // The answer, bounded (40 s: the part's whole budget is 60 s), else the child is killed.
  std::string reply;
  pollfd p{from_child[0], POLLIN, 0};
  for (int i = 0; i < 400 && reply.find('\n') == std::string::npos; ++i) {
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[256];
    const ssize_t n = read(from_child[0], buf, sizeof buf);
    if (n <= 0) break;
    reply.append(buf, static_cast<size_t>(n));
  }
  close(from_child[0]);
  if (reply.find('\n') == std::string::npos) kill(pid, SIGKILL);
  reply = reply.substr(0, reply.find('\n'));
  int status = 0;
  waitpid(pid, &status, 0);
  if (reply.rfind("OK ", 0) != 0) return line("FAIL the put child says: " + (reply.empty() ? "nothing" : reply)), 3;
  double consecutive_ms = 0, scattered_ms = 0;
  std::sscanf(reply.c_str(), "OK consecutive_ms=%lf scattered_ms=%lf", &consecutive_ms, &scattered_ms);
  // Every byte: the consecutive pages, then the scattered ones, of every layer; the rest zero.
  std::vector<uint8_t> got(pool_bytes), want(pool_bytes, 0);
  cudaMemcpy(got.data(), pool, pool_bytes, cudaMemcpyDeviceToHost);
  for (int scattered = 0; scattered < 2; ++scattered) {
    const auto pages = dst_pages(scattered);
    for (uint32_t l = 0; l < kv_layers; ++l)
      for (uint32_t i = 0; i < prompt_pages; ++i)
        for (uint64_t b = 0; b < page_bytes; ++b)
          want[(uint64_t{l} * pool_pages + pages[i]) * page_bytes + b] =
              byte_pattern((uint64_t{l} * prompt_pages + i) * page_bytes + b);
  }
  uint64_t bad = 0;
  for (uint64_t i = 0; i < pool_bytes; ++i) bad += got[i] != want[i];
  const double prompt_bytes = double(kv_layers) * prompt_pages * page_bytes;
  char out[512];
  std::snprintf(out, sizeof out,
                "| cuda_ipc transport | %s | 1K-token prompt, %u layers x %u pages of %llu KiB, a put per layer | "
                "consecutive pages %.3f ms (%.0f GB/s) | scattered pages %.3f ms (%.0f GB/s) | same-process D2D %.0f GB/s | "
                "bytes wrong: %llu |",
                bad == 0 ? "works" : "WRONG DATA", kv_layers, prompt_pages,
                static_cast<unsigned long long>(page_bytes >> 10), consecutive_ms, prompt_bytes / (consecutive_ms * 1e6),
                scattered_ms, prompt_bytes / (scattered_ms * 1e6), local_gbps, static_cast<unsigned long long>(bad));
  std::printf("%s\n", out);
  t->free_memory(pool);
  return bad == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--child") == 0) return child(std::atoi(argv[2]), std::atoi(argv[3]));
  if (argc == 2 && std::strcmp(argv[1], "--put-child") == 0) return put_child();
  uint64_t mib = 256;
  const bool sized = argc == 3 && std::strcmp(argv[1], "--mib") == 0;
  if (sized) mib = std::strtoull(argv[2], nullptr, 10);
  if ((argc != 1 && !sized) || mib == 0 || mib > 16384) {
    std::fprintf(stderr, "usage: baton_cuda_ipc_probe [--mib N], N in 1..16384 (got '%s')\n", argc > 1 ? argv[argc - 1] : "");
    return 1;
  }
  const uint64_t bytes = mib << 20;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("cuda_ipc: no GPU here: skipped\n");
    return 2;
  }
  // The child starts before this process initialises CUDA on a device: a forked CUDA context
  // is unusable, so the child execs at once and opens its own.
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return std::perror("pipe"), 1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(to_child[1]);
    close(from_child[0]);
    const std::string in = std::to_string(to_child[0]), out = std::to_string(from_child[1]);
    execl("/proc/self/exe", argv[0], "--child", in.c_str(), out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  auto finish = [&](int rc, const std::string& line) {
    std::printf("%s\n", line.c_str());
    close(to_child[1]);
    int status = 0;
    waitpid(pid, &status, 0);
    return rc;
  };
  std::string why;
  if (auto e = cudaSetDevice(0); e != cudaSuccess) return finish(3, "cuda_ipc: does not work: " + err("cudaSetDevice", e));
  void *buf = nullptr, *other = nullptr;
  if (auto e = cudaMalloc(&buf, bytes); e != cudaSuccess) return finish(3, "cuda_ipc: " + err("cudaMalloc", e));
  if (auto e = cudaMalloc(&other, bytes); e != cudaSuccess) return finish(3, "cuda_ipc: " + err("cudaMalloc", e));
  if (auto e = fill(buf, bytes, 1); e != cudaSuccess) return finish(3, "cuda_ipc: " + err("filling the buffer", e));
  const double local_gbps = copy_rate(other, buf, bytes, &why);  // the ceiling, in this process
  if (!why.empty()) return finish(3, "cuda_ipc: " + why);
  handoff h{};
  h.bytes = bytes;
  if (auto e = cudaIpcGetMemHandle(&h.mem, buf); e != cudaSuccess)
    return finish(3, "cuda_ipc: does not work here: " + err("cudaIpcGetMemHandle", e));
  cudaEvent_t done;
  cudaEventCreateWithFlags(&done, cudaEventInterprocess | cudaEventDisableTiming);
  if (auto e = cudaIpcGetEventHandle(&h.event, done); e != cudaSuccess)
    return finish(3, "cuda_ipc: does not work here: " + err("cudaIpcGetEventHandle", e));
  if (write(to_child[1], &h, sizeof h) != static_cast<ssize_t>(sizeof h)) return finish(3, "cuda_ipc: cannot reach the child");
  std::string reply;
  char c;
  while (read(from_child[0], &c, 1) == 1 && c != '\n') reply += c;
  if (reply.rfind("OK ", 0) != 0)
    return finish(3, "cuda_ipc: does not work here: the child says: " + (reply.empty() ? "nothing" : reply));
  // The child recorded `done` after its writes: waiting on it here orders them before our read.
  cudaStreamWaitEvent(nullptr, done, 0);
  const uint64_t bad = mismatches(buf, bytes, 2, &why);
  if (!why.empty()) return finish(3, "cuda_ipc: " + why);
  double open_ms = 0, gbps = 0;
  unsigned long long child_bad = 0;
  std::sscanf(reply.c_str(), "OK open_ms=%lf gbps=%lf bad_words=%llu", &open_ms, &gbps, &child_bad);
  char line[512];
  std::snprintf(line, sizeof line,
                "| cuda_ipc | %s | %llu MiB | open %.2f ms | peer -> own D2D %.1f GB/s | same-process D2D %.1f GB/s "
                "(%.0f %%) | words wrong: read %llu, written back %llu |",
                child_bad == 0 && bad == 0 ? "works" : "WRONG DATA", static_cast<unsigned long long>(mib), open_ms, gbps,
                local_gbps, 100.0 * gbps / local_gbps, child_bad, static_cast<unsigned long long>(bad));
  const int rc = finish(child_bad == 0 && bad == 0 ? 0 : 3, line);
  if (rc != 0) return rc;
  std::fflush(stdout);
  return transport_stage(local_gbps);
}
