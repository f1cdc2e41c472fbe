#include "transport/cuda_ipc.hpp"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>

#if BATON_HAVE_CUDA
#include <cuda_runtime.h>

#include <chrono>
#include <map>
#include <mutex>
#endif

namespace baton::transport {

namespace {

// The packed key: [version u32][pid u32][host u64][device u32][reserved u32][offset u64][handle 64].
constexpr size_t packed_bytes = 4 + 4 + 8 + 4 + 4 + 8 + 64;

template <class T>
void put_le(std::vector<uint8_t>& out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof v);  // every host Baton runs on is little-endian
}
template <class T>
T get_le(const std::vector<uint8_t>& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

}  // namespace

std::string cuda_ipc_config::validate() const {
  if (name.empty()) return "cuda_ipc transport needs a rank name";
  if (device < 0) return "cuda_ipc transport " + name + ": device " + std::to_string(device) + " is negative";
  if (max_open_peer_allocations == 0)
    return "cuda_ipc transport " + name + ": max_open_peer_allocations must be at least 1";
  if (peer_idle_ms == 0) return "cuda_ipc transport " + name + ": peer_idle_ms must be at least 1";
  return {};
}

uint64_t cuda_ipc_host_id() {
  static const uint64_t id = [] {
    std::string boot;
    std::ifstream in{"/proc/sys/kernel/random/boot_id"};
    std::getline(in, boot);
    if (boot.empty()) {  // no procfs: the host name, which two hosts may share (then opening fails, by name)
      char host[256] = {};
      gethostname(host, sizeof host - 1);
      boot = host;
    }
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char c : boot) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h;
  }();
  return id;
}

std::vector<uint8_t> pack_cuda_ipc_key(const cuda_ipc_key& k) {
  std::vector<uint8_t> out(packed_bytes);
  put_le<uint32_t>(out, 0, cuda_ipc_key::version);
  put_le<uint32_t>(out, 4, k.pid);
  put_le<uint64_t>(out, 8, k.host);
  put_le<uint32_t>(out, 16, k.device);
  put_le<uint32_t>(out, 20, 0);
  put_le<uint64_t>(out, 24, k.offset);
  std::memcpy(out.data() + 32, k.handle.data(), k.handle.size());
  return out;
}

std::optional<cuda_ipc_key> unpack_cuda_ipc_key(const region_key& key, std::string* why) {
  auto refuse = [&](std::string what) {
    if (why) *why = std::move(what);
    return std::nullopt;
  };
  if (key.backend != "cuda_ipc") return refuse("the key is a " + key.backend + " key, not a cuda_ipc one");
  if (key.packed.size() != packed_bytes)
    return refuse("a cuda_ipc key has " + std::to_string(packed_bytes) + " packed bytes, this one " +
                  std::to_string(key.packed.size()));
  if (const auto v = get_le<uint32_t>(key.packed, 0); v != cuda_ipc_key::version)
    return refuse("the cuda_ipc key is of version " + std::to_string(v) + ", this build reads version " +
                  std::to_string(cuda_ipc_key::version));
  cuda_ipc_key k;
  k.pid = get_le<uint32_t>(key.packed, 4);
  k.host = get_le<uint64_t>(key.packed, 8);
  k.device = get_le<uint32_t>(key.packed, 16);
  k.offset = get_le<uint64_t>(key.packed, 24);
  std::memcpy(k.handle.data(), key.packed.data() + 32, k.handle.size());
  return k;
}

#if !BATON_HAVE_CUDA

bool cuda_ipc_built() { return false; }

std::unique_ptr<transport> make_cuda_ipc_transport(const cuda_ipc_config& cfg, std::string* why) {
  if (auto bad = cfg.validate(); !bad.empty()) {
    if (why) *why = bad;
    return nullptr;
  }
  if (why) *why = "cuda_ipc transport " + cfg.name + ": this build has no CUDA (it needs nvcc at configure time)";
  return nullptr;
}

#else

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cuda_ipc_key::handle holds a cudaIpcMemHandle_t");

namespace {

using clock_type = std::chrono::steady_clock;

/// Who the settled listener is; a host callback on the stream reads it.
struct listener_box {
  std::mutex mutex;
  std::function<void()> fn;
};

void CUDART_CB notify_settled(void* p) {
  auto* box = static_cast<listener_box*>(p);
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock{box->mutex};
    fn = box->fn;
  }
  if (fn) fn();
}

std::string cuda_text(const char* what, cudaError_t e) { return std::string{what} + ": " + cudaGetErrorString(e); }

class cuda_ipc_transport final : public transport {
public:
  cuda_ipc_transport(cuda_ipc_config cfg, cudaStream_t stream)
    : cfg_(std::move(cfg)), stream_(stream), pid_(static_cast<uint32_t>(getpid())) {}

  ~cuda_ipc_transport() override {
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no host callback may run after the listener box is gone
    for (auto& [id, x] : xfers_)
      if (x.done) cudaEventDestroy(x.done);
    for (auto& [handle, o] : opened_) cudaIpcCloseMemHandle(o.base);
    for (auto& [base, size] : allocations_) cudaFree(base);
    cudaStreamDestroy(stream_);
  }

  capabilities caps() const override { return {"cuda_ipc", true, true, true}; }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) override {
    auto refuse = [&](std::string what) {
      if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, std::move(what)};
      return std::nullopt;
    };
    cudaSetDevice(cfg_.device);
    cudaPointerAttributes attr{};
    const auto rc = cudaPointerGetAttributes(&attr, base);
    if (rc != cudaSuccess || attr.type != cudaMemoryTypeDevice || attr.device != cfg_.device) {
      cudaGetLastError();  // clear the query's error
      return refuse("cuda_ipc registers memory of device " + std::to_string(cfg_.device) + " only: the region at " +
                    std::to_string(reinterpret_cast<uintptr_t>(base)) + " is " +
                    (rc != cudaSuccess || attr.type == cudaMemoryTypeUnregistered ? std::string{"host memory"}
                     : attr.type == cudaMemoryTypeHost                           ? std::string{"pinned host memory"}
                     : attr.type == cudaMemoryTypeManaged                        ? std::string{"managed memory"}
                                                          : "memory of device " + std::to_string(attr.device)));
    }
    std::lock_guard<std::mutex> lock{mutex_};
    // The allocation the handle will name: one of ours that holds the region, else the region's
    // own start (which must then be a cudaMalloc allocation's).
    std::byte* alloc = base;
    for (const auto& [a, size] : allocations_)
      if (base >= a && base < a + size) {
        if (static_cast<uint64_t>(base - a) + size_bytes > size)
          return refuse("the region of " + std::to_string(size_bytes) + " bytes runs past its allocation of " +
                        std::to_string(size) + " bytes");
        alloc = a;
      }
    cuda_ipc_key k;
    k.host = cuda_ipc_host_id();
    k.pid = pid_;
    k.device = static_cast<uint32_t>(cfg_.device);
    k.offset = static_cast<uint64_t>(base - alloc);
    cudaIpcMemHandle_t handle;
    if (auto e = cudaIpcGetMemHandle(&handle, alloc); e != cudaSuccess) {
      cudaGetLastError();
      return refuse(cuda_text("CUDA refused an IPC handle for the region (it must start at a cudaMalloc allocation, or "
                              "lie in this transport's allocate_memory)",
                              e));
    }
    std::memcpy(k.handle.data(), &handle, sizeof handle);
    const uint64_t id = ++last_region_;
    regions_[id] = {base, size_bytes};
    return region_key{"cuda_ipc", id, size_bytes, pack_cuda_ipc_key(k)};
  }

  void deregister_region(uint64_t region_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    regions_.erase(region_id);
  }

  uint64_t post_put(const put_desc& d) override {
    std::lock_guard<std::mutex> lock{mutex_};
    const uint64_t id = ++last_xfer_;
    auto& x = xfers_[id];
    x.request_id = d.request_id, x.peer = d.peer, x.layer = d.layer;  // for failures found later, in poll
    auto fail = [&](xfer_errc code, bool retryable, std::string what) {
      x.state = xfer_state::failed;
      x.err = {code, retryable, d.request_id, d.peer, d.layer, std::move(what)};
      return id;
    };
    auto local = regions_.find(d.local_region);
    if (local == regions_.end()) return fail(xfer_errc::unknown_region, false, "no local region " + std::to_string(d.local_region));
    std::string why;
    const auto key = unpack_cuda_ipc_key(d.remote, &why);
    if (!key) return fail(xfer_errc::unknown_region, false, std::move(why));
    if (key->host != cuda_ipc_host_id())
      return fail(xfer_errc::unknown_region, false,
                  "the region is on another host: CUDA IPC reaches device memory of this host only");
    if (auto bad = segments_outside(d.segments, local->second.size, d.remote.size_bytes); !bad.empty())
      return fail(xfer_errc::out_of_bounds, false, std::move(bad));
    cudaSetDevice(cfg_.device);
    std::byte* remote = nullptr;
    if (key->pid == pid_) {  // a region of this process (CUDA opens no handle of its own process)
      auto r = regions_.find(d.remote.region_id);
      if (r == regions_.end() || r->second.size != d.remote.size_bytes)
        return fail(xfer_errc::unknown_region, false,
                    "no region " + std::to_string(d.remote.region_id) + " of this process (deregistered?)");
      remote = r->second.base;
    } else {
      close_idle();
      const std::string handle(reinterpret_cast<const char*>(key->handle.data()), key->handle.size());
      auto o = opened_.find(handle);
      if (o == opened_.end()) {
        if (opened_.size() >= cfg_.max_open_peer_allocations) close_least_recent();
        cudaIpcMemHandle_t h;
        std::memcpy(&h, key->handle.data(), sizeof h);
        void* base = nullptr;
        if (auto e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
          cudaGetLastError();
          // The owner may be gone (its allocation with it): retryable, the request goes elsewhere.
          return fail(xfer_errc::peer_unreachable, true,
                      cuda_text(("cannot open process " + std::to_string(key->pid) + "'s device memory").c_str(), e));
        }
        o = opened_.emplace(handle, opening{static_cast<std::byte*>(base), clock_type::now()}).first;
      }
      o->second.last_used = clock_type::now();
      remote = o->second.base + key->offset;
    }
    for (const auto& s : coalesce_segments(d.segments))
      if (auto e = cudaMemcpyAsync(remote + s.dst_offset, local->second.base + s.src_offset, s.size_bytes,
                                   cudaMemcpyDeviceToDevice, stream_);
          e != cudaSuccess)
        return fail(xfer_errc::backend_error, false, cuda_text("a device-to-device copy", e));
    if (auto e = cudaEventCreateWithFlags(&x.done, cudaEventDisableTiming); e != cudaSuccess) {
      x.done = nullptr;
      return fail(xfer_errc::backend_error, false, cuda_text("cannot create an event", e));
    }
    if (auto e = cudaEventRecord(x.done, stream_); e != cudaSuccess)
      return fail(xfer_errc::backend_error, false, cuda_text("cannot record an event", e));
    // Without the notice the owner still finds the put settled at its next poll.
    if (has_listener_ && cudaLaunchHostFunc(stream_, notify_settled, &listener_) != cudaSuccess) cudaGetLastError();
    return id;
  }

  xfer_state poll(uint64_t xfer_id, xfer_error* err) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto i = xfers_.find(xfer_id);
    if (i == xfers_.end()) {
      if (err) *err = {xfer_errc::unknown_region, false, 0, cfg_.name, 0, "no transfer " + std::to_string(xfer_id)};
      return xfer_state::failed;
    }
    auto& x = i->second;
    if (x.state == xfer_state::pending) {
      cudaSetDevice(cfg_.device);
      const auto q = cudaEventQuery(x.done);
      if (q == cudaSuccess) {
        x.state = xfer_state::done;
      } else if (q != cudaErrorNotReady) {
        x.state = xfer_state::failed;
        x.err = {xfer_errc::backend_error, false, x.request_id, x.peer, x.layer, cuda_text("the put's stream failed", q)};
      }
    }
    if (x.state == xfer_state::failed && err) *err = x.err;
    return x.state;
  }

  void release(uint64_t xfer_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto i = xfers_.find(xfer_id);
    if (i == xfers_.end()) return;
    if (i->second.done) cudaEventDestroy(i->second.done);  // CUDA frees a pending one once the stream passes it
    xfers_.erase(i);
  }

  std::byte* allocate_memory(uint64_t size_bytes, xfer_error* err) override {
    cudaSetDevice(cfg_.device);
    void* p = nullptr;
    if (auto e = cudaMalloc(&p, size_bytes); e != cudaSuccess) {
      cudaGetLastError();
      if (err)
        *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0,
                "cannot allocate " + std::to_string(size_bytes) + " bytes on device " + std::to_string(cfg_.device) +
                    ": " + cudaGetErrorString(e)};
      return nullptr;
    }
    std::lock_guard<std::mutex> lock{mutex_};
    allocations_[static_cast<std::byte*>(p)] = size_bytes;
    return static_cast<std::byte*>(p);
  }

  void free_memory(std::byte* base) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto a = allocations_.find(base);
    if (a == allocations_.end()) return;
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no put may still read it
    cudaFree(base);
    allocations_.erase(a);
  }

  void set_settled_listener(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock{mutex_};
    has_listener_ = static_cast<bool>(fn);
    std::lock_guard<std::mutex> box{listener_.mutex};
    listener_.fn = std::move(fn);
  }

  transport_stats stats() override {
    std::lock_guard<std::mutex> lock{mutex_};
    uint64_t pending = 0;
    for (const auto& [id, x] : xfers_) pending += x.state == xfer_state::pending;
    return {0, opened_.size(), pending};
  }

private:
  struct region {
    std::byte* base = nullptr;
    uint64_t size = 0;
  };
  struct opening {
    std::byte* base = nullptr;  ///< where the peer's allocation is mapped here
    clock_type::time_point last_used;
  };
  struct xfer {
    uint64_t request_id = 0;
    std::string peer;
    uint32_t layer = 0;
    cudaEvent_t done = nullptr;
    xfer_state state = xfer_state::pending;
    xfer_error err;
  };

  /// Closes `o` once no put of this transport can still write through it.
  void close(std::map<std::string, opening>::iterator o) {
    cudaStreamSynchronize(stream_);
    cudaIpcCloseMemHandle(o->second.base);
    opened_.erase(o);
  }
  void close_least_recent() {
    auto oldest = opened_.begin();
    for (auto o = opened_.begin(); o != opened_.end(); ++o)
      if (o->second.last_used < oldest->second.last_used) oldest = o;
    if (oldest != opened_.end()) close(oldest);
  }
  void close_idle() {
    const auto cutoff = clock_type::now() - std::chrono::milliseconds{cfg_.peer_idle_ms};
    for (auto o = opened_.begin(); o != opened_.end();)
      if (o->second.last_used < cutoff)
        close(o++);
      else
        ++o;
  }

  const cuda_ipc_config cfg_;
  cudaStream_t stream_;
  const uint32_t pid_;
  std::mutex mutex_;
  std::map<uint64_t, region> regions_;
  std::map<std::byte*, uint64_t> allocations_;  ///< allocate_memory's, by base
  std::map<std::string, opening> opened_;       ///< peers' allocations, by their handle's bytes
  std::map<uint64_t, xfer> xfers_;
  uint64_t last_region_ = 0, last_xfer_ = 0;
  bool has_listener_ = false;
  listener_box listener_;
};

}  // namespace

bool cuda_ipc_built() { return true; }

std::unique_ptr<transport> make_cuda_ipc_transport(const cuda_ipc_config& cfg, std::string* why) {
  auto say = [&](std::string what) {
    if (why) *why = "cuda_ipc transport " + cfg.name + ": " + std::move(what);
    return nullptr;
  };
  if (auto bad = cfg.validate(); !bad.empty()) {
    if (why) *why = bad;
    return nullptr;
  }
  int devices = 0;
  if (auto e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    cudaGetLastError();
    return say(cuda_text("no CUDA device", e));
  }
  if (cfg.device >= devices)
    return say("device " + std::to_string(cfg.device) + " does not exist (" + std::to_string(devices) + " here)");
  if (auto e = cudaSetDevice(cfg.device); e != cudaSuccess) return say(cuda_text("cannot use the device", e));
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t stream = nullptr;
  if (auto e = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest); e != cudaSuccess)
    return say(cuda_text("cannot create a stream", e));
  return std::make_unique<cuda_ipc_transport>(cfg, stream);
}

#endif

}  // namespace baton::transport
