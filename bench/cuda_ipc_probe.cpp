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
// Exit code: 0 it works, 3 it does not (the line says which call refused), 2 no GPU.
//   baton_cuda_ipc_probe [--mib N]

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--child") == 0) return child(std::atoi(argv[2]), std::atoi(argv[3]));
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
  return finish(child_bad == 0 && bad == 0 ? 0 : 3, line);
}
