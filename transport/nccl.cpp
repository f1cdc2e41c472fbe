#include "transport/nccl.hpp"

#include <cstring>

#if BATON_HAVE_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <map>
#include <mutex>
#include <type_traits>

#include "transport/cuda_stream_put.hpp"
#endif

namespace baton::transport {

namespace {
constexpr size_t unique_id_bytes = 128;  // NCCL_UNIQUE_ID_BYTES, checked below where nccl.h is seen
}  // namespace

std::string nccl_config::validate() const {
  if (name.empty()) return "nccl transport needs a rank name";
  if (device < 0) return "nccl transport " + name + ": device " + std::to_string(device) + " is negative";
  if (world_size < 1) return "nccl transport " + name + ": world_size " + std::to_string(world_size) + " must be at least 1";
  if (rank < 0 || rank >= world_size)
    return "nccl transport " + name + ": rank " + std::to_string(rank) + " is outside a world of " +
           std::to_string(world_size);
  if (unique_id.empty() && world_size > 1)
    return "nccl transport " + name + ": a world of " + std::to_string(world_size) +
           " ranks needs the communicator's unique_id (nccl_unique_id on rank 0)";
  std::vector<uint8_t> id_bytes;
  if (!unique_id.empty() && (unique_id.size() != 2 * unique_id_bytes || !bytes_of_hex(unique_id, &id_bytes)))
    return "nccl transport " + name + ": unique_id must be " + std::to_string(2 * unique_id_bytes) +
           " lowercase hex digits, got " + std::to_string(unique_id.size()) + " characters";
  return {};
}

#if !BATON_HAVE_NCCL

bool nccl_built() { return false; }

std::string nccl_unique_id(std::string* why) {
  if (why) *why = "this build has no NCCL (it needs CUDA and nccl.h at configure time)";
  return {};
}

std::unique_ptr<transport> make_nccl_transport(const nccl_config& cfg, std::string* why) {
  if (auto bad = cfg.validate(); !bad.empty()) {
    if (why) *why = bad;
    return nullptr;
  }
  if (why) *why = "nccl transport " + cfg.name + ": this build has no NCCL (it needs CUDA and nccl.h at configure time)";
  return nullptr;
}

#else

static_assert(unique_id_bytes == NCCL_UNIQUE_ID_BYTES);

namespace {

/// NCCL's entry points, looked up at run time: NCCL (some 200 MB) is loaded only by a process
/// that makes an NCCL transport, and a binary built with it still starts where it is missing.
struct nccl_api {
  std::string error;  ///< why NCCL could not be loaded (empty: loaded)
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclGetLastError) get_last_error = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
};

const nccl_api& nccl() {
  static const nccl_api api = [] {
    nccl_api a;
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      a.error = std::string{"cannot load libnccl.so.2: "} + (e ? e : "unknown error");
      return a;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && a.error.empty()) a.error = std::string{"libnccl.so.2 lacks "} + name;
    };
    sym(a.get_unique_id, "ncclGetUniqueId");
    sym(a.comm_init_rank, "ncclCommInitRank");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.comm_abort, "ncclCommAbort");
    sym(a.comm_get_async_error, "ncclCommGetAsyncError");
    sym(a.get_error_string, "ncclGetErrorString");
    sym(a.get_last_error, "ncclGetLastError");
    sym(a.group_start, "ncclGroupStart");
    sym(a.group_end, "ncclGroupEnd");
    sym(a.send, "ncclSend");
    sym(a.recv, "ncclRecv");
    return a;
  }();
  return api;
}

/// The communicator's fingerprint in every key: FNV-1a of its unique id.
uint64_t fingerprint(const ncclUniqueId& id) {
  uint64_t h = 1469598103934665603ull;
  for (char c : id.internal) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

/// The packed part of a key: [owner rank u32][world u32][fingerprint u64], little-endian.
std::vector<uint8_t> pack_key(uint32_t rank, uint32_t world, uint64_t tag) {
  std::vector<uint8_t> out(16);
  std::memcpy(out.data(), &rank, 4);
  std::memcpy(out.data() + 4, &world, 4);
  std::memcpy(out.data() + 8, &tag, 8);
  return out;
}

using cuda_detail::listener_box;

class nccl_transport final : public transport {
public:
  nccl_transport(nccl_config cfg, ncclComm_t comm, cudaStream_t stream, uint64_t tag)
    : cfg_(std::move(cfg)), comm_(comm), stream_(stream), tag_(tag) {}

  ~nccl_transport() override {
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no host callback may run after the listener box is gone
    for (auto& [id, x] : xfers_)
      if (x.done) cudaEventDestroy(x.done);
    if (ncclResult_t async = ncclSuccess; nccl().comm_get_async_error(comm_, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress)
      nccl().comm_abort(comm_);  // destroying a communicator in error may hang
    else
      nccl().comm_destroy(comm_);
    cudaStreamDestroy(stream_);
  }

  // crosses_processes: not until a put to another rank works (see nccl.hpp).
  capabilities caps() const override { return {"nccl", false, false, true}; }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) override {
    cudaSetDevice(cfg_.device);
    if (auto why = cuda_detail::not_device_memory("nccl", cfg_.device, base); !why.empty()) {
      if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, std::move(why)};
      return std::nullopt;
    }
    std::lock_guard<std::mutex> lock{mutex_};
    const uint64_t id = ++last_region_;
    regions_[id] = {base, size_bytes};
    return region_key{"nccl", id, size_bytes,
                      pack_key(static_cast<uint32_t>(cfg_.rank), static_cast<uint32_t>(cfg_.world_size), tag_)};
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
    if (d.remote.backend != "nccl" || d.remote.packed.size() != 16)
      return fail(xfer_errc::unknown_region, false, "the key is a " + d.remote.backend + " key, not an nccl one");
    uint32_t owner = 0, world = 0;
    uint64_t tag = 0;
    std::memcpy(&owner, d.remote.packed.data(), 4);
    std::memcpy(&world, d.remote.packed.data() + 4, 4);
    std::memcpy(&tag, d.remote.packed.data() + 8, 8);
    if (tag != tag_ || world != static_cast<uint32_t>(cfg_.world_size) || owner >= world)
      return fail(xfer_errc::unknown_region, false, "the key comes from another NCCL communicator");
    if (auto bad = segments_outside(d.segments, local->second.size, d.remote.size_bytes); !bad.empty())
      return fail(xfer_errc::out_of_bounds, false, std::move(bad));
    if (owner != static_cast<uint32_t>(cfg_.rank))
      return fail(xfer_errc::backend_error, false,
                  "the region belongs to NCCL rank " + std::to_string(owner) + ", and a put to another rank needs it to "
                  "post the matching receive: Baton has no control channel for that yet (only one-rank puts are built)");
    auto remote = regions_.find(d.remote.region_id);
    if (remote == regions_.end() || remote->second.size != d.remote.size_bytes)
      return fail(xfer_errc::unknown_region, false, "no region " + std::to_string(d.remote.region_id) + " on rank " +
                                                        std::to_string(owner) + " (deregistered?)");
    cudaSetDevice(cfg_.device);
    // One group: NCCL pairs each send with the receive of the same peer in issue order.
    ncclResult_t rc = nccl().group_start();
    for (const auto& s : d.segments) {
      if (s.size_bytes == 0) continue;
      if (rc == ncclSuccess)
        rc = nccl().send(local->second.base + s.src_offset, s.size_bytes, ncclChar, cfg_.rank, comm_, stream_);
      if (rc == ncclSuccess)
        rc = nccl().recv(remote->second.base + s.dst_offset, s.size_bytes, ncclChar, cfg_.rank, comm_, stream_);
    }
    const ncclResult_t end = nccl().group_end();
    if (rc == ncclSuccess) rc = end;
    if (rc != ncclSuccess) return fail(xfer_errc::backend_error, false, nccl_error("send/recv", rc));
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
      if (ncclResult_t async = ncclSuccess; x.state == xfer_state::pending &&
                                            nccl().comm_get_async_error(comm_, &async) == ncclSuccess &&
                                            async != ncclSuccess && async != ncclInProgress) {
        x.state = xfer_state::failed;
        x.err = {xfer_errc::backend_error, false, x.request_id, x.peer, x.layer, nccl_error("the communicator", async)};
      }
    }
    if (x.state == xfer_state::failed && err) *err = x.err;
    return x.state;
  }

  void release(uint64_t xfer_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto i = xfers_.find(xfer_id);
    if (i == xfers_.end()) return;
    // CUDA frees an event still pending (an abandoned put's) once the stream passes it.
    if (i->second.done) cudaEventDestroy(i->second.done);
    xfers_.erase(i);
  }

  std::byte* allocate_memory(uint64_t size_bytes, xfer_error* err) override {
    cudaSetDevice(cfg_.device);
    void* p = nullptr;
    if (auto e = cudaMalloc(&p, size_bytes); e != cudaSuccess) {
      if (err)
        *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0,
                "cannot allocate " + std::to_string(size_bytes) + " bytes on device " + std::to_string(cfg_.device) + ": " +
                    cudaGetErrorString(e)};
      return nullptr;
    }
    return static_cast<std::byte*>(p);
  }

  void free_memory(std::byte* base) override {
    cudaSetDevice(cfg_.device);
    cudaStreamSynchronize(stream_);  // no put may still read or write it
    cudaFree(base);
  }

  void set_settled_listener(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock{mutex_};
    has_listener_ = static_cast<bool>(fn);
    std::lock_guard<std::mutex> box{listener_.mutex};
    listener_.fn = std::move(fn);
  }

private:
  std::string nccl_error(const char* what, ncclResult_t rc) const {
    std::string out = std::string{"NCCL "} + what + ": " + nccl().get_error_string(rc);
    if (const char* last = nccl().get_last_error(comm_); last && *last) out += std::string{" ("} + last + ")";
    return out;
  }

  struct region {
    std::byte* base = nullptr;
    uint64_t size = 0;
  };
  using xfer = cuda_detail::stream_put;

  const nccl_config cfg_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  const uint64_t tag_;
  std::mutex mutex_;  // NCCL calls on one communicator are never concurrent
  std::map<uint64_t, region> regions_;
  std::map<uint64_t, xfer> xfers_;
  uint64_t last_region_ = 0, last_xfer_ = 0;
  bool has_listener_ = false;
  listener_box listener_;
};

}  // namespace

bool nccl_built() { return true; }

std::string nccl_unique_id(std::string* why) {
  ncclUniqueId id;
  if (!nccl().error.empty()) {
    if (why) *why = nccl().error;
    return {};
  }
  if (auto rc = nccl().get_unique_id(&id); rc != ncclSuccess) {
    if (why) *why = std::string{"NCCL cannot make a unique id: "} + nccl().get_error_string(rc);
    return {};
  }
  return hex_of(reinterpret_cast<const uint8_t*>(id.internal), sizeof id.internal);
}

std::unique_ptr<transport> make_nccl_transport(const nccl_config& cfg, std::string* why) {
  auto say = [&](std::string what) {
    if (why) *why = "nccl transport " + cfg.name + ": " + std::move(what);
    return nullptr;
  };
  if (auto bad = cfg.validate(); !bad.empty()) {
    if (why) *why = bad;
    return nullptr;
  }
  if (!nccl().error.empty()) return say(nccl().error);
  int devices = 0;
  if (auto e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    cudaGetLastError();
    return say(std::string{"no CUDA device: "} + cudaGetErrorString(e));
  }
  if (cfg.device >= devices)
    return say("device " + std::to_string(cfg.device) + " does not exist (" + std::to_string(devices) + " here)");
  if (auto e = cudaSetDevice(cfg.device); e != cudaSuccess) return say(std::string{"cannot use the device: "} + cudaGetErrorString(e));
  ncclUniqueId id;
  if (cfg.unique_id.empty()) {
    if (auto rc = nccl().get_unique_id(&id); rc != ncclSuccess) return say(std::string{"no unique id: "} + nccl().get_error_string(rc));
  } else {
    std::vector<uint8_t> bytes;
    bytes_of_hex(cfg.unique_id, &bytes);  // validate() checked it: 128 bytes of hex
    std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  }
  ncclComm_t comm = nullptr;
  if (auto rc = nccl().comm_init_rank(&comm, cfg.world_size, id, cfg.rank); rc != ncclSuccess)
    return say(std::string{"cannot join the communicator: "} + nccl().get_error_string(rc));
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t stream = nullptr;
  if (auto e = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest); e != cudaSuccess) {
    nccl().comm_destroy(comm);
    return say(std::string{"cannot create a stream: "} + cudaGetErrorString(e));
  }
  return std::make_unique<nccl_transport>(cfg, comm, stream, fingerprint(id));
}

#endif

}  // namespace baton::transport
