#include "transport/cuda_ipc.hpp"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#if BATON_HAVE_CUDA
#include <cuda.h>  // driver types only: the driver is reached through the runtime
#include <cuda_runtime.h>

#include "transport/cuda_stream_put.hpp"

#include <chrono>
#include <map>
#include <mutex>
#endif

namespace baton::transport {

namespace {

// The packed key: [version u32][pid u32][host u64][device u32][reserved u32][process u64]
// [offset u64][handle 64].
constexpr size_t packed_bytes = 4 + 4 + 8 + 4 + 4 + 8 + 8 + 64;

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

uint64_t cuda_ipc_process_id() {
  static const uint64_t id = [] {
    std::random_device rd;
    uint64_t v = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid()) ^
                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return v ? v : 1;
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
  put_le<uint64_t>(out, 24, k.process);
  put_le<uint64_t>(out, 32, k.offset);
  std::memcpy(out.data() + 40, k.handle.data(), k.handle.size());
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
  k.process = get_le<uint64_t>(key.packed, 24);
  k.offset = get_le<uint64_t>(key.packed, 32);
  std::memcpy(k.handle.data(), key.packed.data() + 40, k.handle.size());
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
constexpr uint64_t block_bytes = 2 << 20;  // cudaMalloc's sub-allocation granularity for IPC

using cuda_detail::listener_box;

std::string cuda_text(const std::string& what, cudaError_t e) { return what + ": " + cudaGetErrorString(e); }

/// The start and size of the allocation holding `p`, from the driver (cuMemGetAddressRange,
/// found through the runtime: no link against libcuda); false where the driver does not say.
bool allocation_of(const void* p, std::byte** start, uint64_t* size) {
  using range_fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const range_fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<range_fn>(nullptr);
    }
    return reinterpret_cast<range_fn>(f);
  }();
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (!fn || fn(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return false;
  *start = reinterpret_cast<std::byte*>(base);
  *size = bytes;
  return true;
}

/// Every region of every cuda_ipc transport of this process, by its allocation's handle: a put
/// between two of them (two ranks in one process) finds the allocation here, as CUDA opens no
/// handle of its own process.
struct local_allocations {
  std::mutex mutex;
  std::map<std::string, std::pair<std::byte*, uint32_t>> by_handle;  ///< allocation start, regions over it
};
local_allocations& local_registry() {
  static local_allocations r;
  return r;
}

class cuda_ipc_transport final : public transport {
public:
  cuda_ipc_transport(cuda_ipc_config cfg, cudaStream_t stream)
    : cfg_(std::move(cfg)), stream_(stream) {}

  ~cuda_ipc_transport() override {
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no host callback may run after the listener box is gone
    for (auto& [id, x] : xfers_)
      if (x.done) cudaEventDestroy(x.done);
    for (auto& [handle, o] : opened_) cudaIpcCloseMemHandle(o.base);
    for (auto& c : closing_) {
      cudaIpcCloseMemHandle(c.base);
      cudaEventDestroy(c.passed);
    }
    for (auto& [id, r] : regions_) forget_local(r.handle);
    for (auto& [base, size] : allocations_) cudaFree(base);
    cudaStreamDestroy(stream_);
  }

  capabilities caps() const override { return {"cuda_ipc", true, true, true}; }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) override {
    auto refuse = [&](std::string what) {
      cudaGetLastError();  // clear what a refused call left
      if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, std::move(what)};
      return std::nullopt;
    };
    cudaSetDevice(cfg_.device);
    if (auto why = cuda_detail::not_device_memory("cuda_ipc", cfg_.device, base); !why.empty())
      return refuse(std::move(why));
    // The handle names the whole allocation; the key carries where the region starts in it.
    std::byte* alloc = nullptr;
    uint64_t alloc_size = 0;
    if (!allocation_of(base, &alloc, &alloc_size))
      return refuse("the driver does not say which allocation holds the region (cuMemGetAddressRange)");
    const uint64_t offset = static_cast<uint64_t>(base - alloc);
    if (offset + size_bytes > alloc_size)
      return refuse("the region of " + std::to_string(size_bytes) + " bytes at offset " + std::to_string(offset) +
                    " runs past its allocation of " + std::to_string(alloc_size) + " bytes");
    cudaIpcMemHandle_t handle;
    if (auto e = cudaIpcGetMemHandle(&handle, alloc); e != cudaSuccess)
      return refuse(cuda_text("CUDA refused an IPC handle for the region's allocation", e));
    cuda_ipc_key k;
    k.host = cuda_ipc_host_id();
    k.pid = static_cast<uint32_t>(getpid());
    k.process = cuda_ipc_process_id();
    k.device = static_cast<uint32_t>(cfg_.device);
    k.offset = offset;
    std::memcpy(k.handle.data(), &handle, sizeof handle);
    const std::string handle_bytes(reinterpret_cast<const char*>(k.handle.data()), k.handle.size());
    {
      auto& reg = local_registry();
      std::lock_guard<std::mutex> lock{reg.mutex};
      auto& entry = reg.by_handle[handle_bytes];
      entry.first = alloc;
      ++entry.second;
    }
    std::lock_guard<std::mutex> lock{mutex_};
    const uint64_t id = ++last_region_;
    regions_[id] = {base, size_bytes, handle_bytes};
    return region_key{"cuda_ipc", id, size_bytes, pack_cuda_ipc_key(k)};
  }

  void deregister_region(uint64_t region_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto r = regions_.find(region_id);
    if (r == regions_.end()) return;
    forget_local(r->second.handle);
    regions_.erase(r);
  }

  uint64_t post_put(const put_desc& d) override {
    std::lock_guard<std::mutex> lock{mutex_};
    const uint64_t id = ++last_xfer_;
    auto& x = xfers_[id];
    x.request_id = d.request_id, x.peer = d.peer, x.layer = d.layer;  // for failures found later, in poll
    auto fail = [&](xfer_errc code, bool retryable, std::string what) {
      cudaGetLastError();  // clear what a failed call left, so no later check reports it
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
    reap_closed();
    std::byte* remote = nullptr;
    const std::string handle(reinterpret_cast<const char*>(key->handle.data()), key->handle.size());
    if (key->process == cuda_ipc_process_id()) {  // a region of this process: CUDA opens no handle of its own
      auto& reg = local_registry();
      std::lock_guard<std::mutex> reg_lock{reg.mutex};
      auto a = reg.by_handle.find(handle);
      if (a == reg.by_handle.end())
        return fail(xfer_errc::unknown_region, false, "no region " + std::to_string(d.remote.region_id) +
                                                          " of this process's cuda_ipc transports (deregistered?)");
      remote = a->second.first + key->offset;
    } else {
      close_idle();
      auto o = opened_.find(handle);
      if (o == opened_.end()) {
        if (opened_.size() >= cfg_.max_open_peer_allocations) close_least_recent();
        cudaIpcMemHandle_t h;
        std::memcpy(&h, key->handle.data(), sizeof h);
        void* base = nullptr;
        if (auto e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
          // The owner may be gone, its allocation with it: retryable, the request goes elsewhere.
          // Devices that cannot reach each other stay so.
          const bool lasting = e == cudaErrorPeerAccessUnsupported || e == cudaErrorNotSupported ||
                               e == cudaErrorInvalidDevice;
          return fail(lasting ? xfer_errc::backend_error : xfer_errc::peer_unreachable, !lasting,
                      cuda_text("cannot open the device memory of process " + std::to_string(key->pid), e));
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
    if (auto bad = cuda_detail::end_put(x, stream_, has_listener_ ? &listener_ : nullptr); !bad.empty())
      return fail(xfer_errc::backend_error, false, std::move(bad));
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
      cuda_detail::settle(x);
      reap_closed();
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
    // Whole 2 MiB blocks: an IPC handle exports the block, so no other allocation may share it.
    const uint64_t bytes = (size_bytes + block_bytes - 1) / block_bytes * block_bytes;
    void* p = nullptr;
    if (auto e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      cudaGetLastError();
      if (err)
        *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0,
                "cannot allocate " + std::to_string(size_bytes) + " bytes on device " + std::to_string(cfg_.device) +
                    ": " + cudaGetErrorString(e)};
      return nullptr;
    }
    std::lock_guard<std::mutex> lock{mutex_};
    allocations_[static_cast<std::byte*>(p)] = bytes;
    return static_cast<std::byte*>(p);
  }

  void free_memory(std::byte* base) override {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      if (!allocations_.erase(base)) return;
    }
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no put may still read it (outside the lock: polls go on meanwhile)
    cudaFree(base);
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
    std::string handle;  ///< its allocation's IPC handle, as bytes
  };
  struct opening {
    std::byte* base = nullptr;  ///< where the peer's allocation is mapped here
    clock_type::time_point last_used;
  };
  /// An opening let go: closed once the stream has passed `passed` (no put still writes through it).
  struct closing {
    std::byte* base = nullptr;
    cudaEvent_t passed = nullptr;
  };
  using xfer = cuda_detail::stream_put;

  static void forget_local(const std::string& handle) {
    auto& reg = local_registry();
    std::lock_guard<std::mutex> lock{reg.mutex};
    auto a = reg.by_handle.find(handle);
    if (a != reg.by_handle.end() && --a->second.second == 0) reg.by_handle.erase(a);
  }

  /// Lets `o` go without waiting: it closes once the puts posted before now have passed.
  void close(std::map<std::string, opening>::iterator o) {
    cudaEvent_t passed = nullptr;
    if (cudaEventCreateWithFlags(&passed, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(passed, stream_) != cudaSuccess) {
      cudaGetLastError();
      if (passed) cudaEventDestroy(passed);
      cudaStreamSynchronize(stream_);  // no event to wait on: wait here (rare)
      cudaIpcCloseMemHandle(o->second.base);
    } else {
      closing_.push_back({o->second.base, passed});
    }
    opened_.erase(o);
  }
  void reap_closed() {
    for (auto c = closing_.begin(); c != closing_.end();)
      if (cudaEventQuery(c->passed) == cudaSuccess) {
        cudaIpcCloseMemHandle(c->base);
        cudaEventDestroy(c->passed);
        c = closing_.erase(c);
      } else {
        cudaGetLastError();  // cudaErrorNotReady is no error to keep
        ++c;
      }
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
  std::mutex mutex_;
  std::map<uint64_t, region> regions_;
  std::map<std::byte*, uint64_t> allocations_;  ///< allocate_memory's, by base
  std::map<std::string, opening> opened_;       ///< peers' allocations, by their handle's bytes
  std::vector<closing> closing_;
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
