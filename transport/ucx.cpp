#include "transport/ucx.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <ucp/api/ucp.h>

namespace baton::transport {

namespace {

/// The region_key's packed bytes: [remote base address u64][worker address length u32]
/// [worker address][rkey]. Everything a peer needs to put into the region.
std::vector<uint8_t> pack_key(uint64_t base, const void* worker_addr, uint32_t addr_len, const void* rkey,
                              size_t rkey_len) {
  std::vector<uint8_t> out(8 + 4 + addr_len + rkey_len);
  std::memcpy(out.data(), &base, 8);
  std::memcpy(out.data() + 8, &addr_len, 4);
  std::memcpy(out.data() + 12, worker_addr, addr_len);
  std::memcpy(out.data() + 12 + addr_len, rkey, rkey_len);
  return out;
}

struct unpacked_key {
  uint64_t base = 0;
  std::string worker_addr;  ///< bytes
  std::string rkey;         ///< bytes
};

bool unpack_key(const std::vector<uint8_t>& packed, unpacked_key* out) {
  if (packed.size() < 12) return false;
  uint32_t addr_len = 0;
  std::memcpy(&out->base, packed.data(), 8);
  std::memcpy(&addr_len, packed.data() + 8, 4);
  // Neither part may be empty: UCX parses both without a length, past the end of an empty one.
  if (addr_len == 0 || packed.size() <= 12 + size_t{addr_len}) return false;
  out->worker_addr.assign(reinterpret_cast<const char*>(packed.data()) + 12, addr_len);
  out->rkey.assign(reinterpret_cast<const char*>(packed.data()) + 12 + addr_len, packed.size() - 12 - addr_len);
  return true;
}

/// The header of an active-message put: where in the target's registered region the bytes go.
struct am_header {
  uint64_t region_id;
  uint64_t dst_offset;
};
constexpr unsigned put_am_id = 1;

uint64_t now_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

/// A peer's unpacked memory key. Dropped when idle (see ucx_config::key_idle_ms) unless a put
/// through it is in flight or a map_remote pointer hands out its mapping.
struct cached_key {
  ucp_rkey_h handle = nullptr;
  uint64_t in_flight = 0;
  uint64_t used_ms = 0;
  bool mapped = false;
};

/// One transfer: its puts, then a flush (or its active messages); done when all complete.
/// What a failed UCX call means for the put: a peer that went (or a request cancelled with
/// its endpoint) may be reached again or elsewhere; the target refusing an active message's
/// header (no such region, or outside it: its handler's UCS_ERR_INVALID_PARAM) and anything
/// else UCX reports are not mended by trying again.
void set_failure(xfer_error* err, ucs_status_t s, const char* call) {
  switch (s) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
      err->code = xfer_errc::peer_unreachable;
      err->retryable = true;
      break;
    case UCS_ERR_INVALID_PARAM:
      err->code = xfer_errc::unknown_region;
      err->retryable = false;
      break;
    default:
      err->code = xfer_errc::backend_error;
      err->retryable = false;
  }
  err->what = std::string{call} + " failed: " + ucs_status_string(s);
  if (s == UCS_ERR_INVALID_PARAM) err->what += " (the target refused it: no such region, or outside it)";
}

struct transfer {
  std::vector<am_header> headers;  ///< "am" mode: each send's header lives until it completes
  /// UCX requests still in flight, each with the call that made it (a failure names it).
  std::vector<std::pair<void*, const char*>> pending;
  xfer_state state = xfer_state::pending;
  xfer_error error;
  /// The peer's key it puts through, kept while it flies (keys in flight are never dropped,
  /// endpoints never are: the pointer stays valid).
  cached_key* key = nullptr;

  /// Keeps a request UCX returned: in flight (a pointer), done at once (null), or refused, which
  /// fails the transfer naming the call. False once the transfer has failed.
  bool track(ucs_status_ptr_t req, const char* call) {
    if (UCS_PTR_IS_ERR(req)) {
      set_failure(&error, UCS_PTR_STATUS(req), call);
      state = xfer_state::failed;
      return false;
    }
    if (req) pending.emplace_back(req, call);
    return true;
  }
};

struct remote_peer {
  ucp_ep_h ep = nullptr;
  std::map<std::string, cached_key> keys;  ///< by packed rkey bytes
};

class ucx_transport final : public transport {
public:
  explicit ucx_transport(ucx_config cfg) : cfg_(std::move(cfg)) {}

  bool init(std::string* why) {
    ucp_config_t* config = nullptr;
    if (auto s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) return fail(why, "ucp_config_read", s);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    auto s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return fail(why, "ucp_init", s);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
    if (s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK) return fail(why, "ucp_worker_create", s);
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    if (s = ucp_worker_get_address(worker_, &addr, &len); s != UCS_OK) return fail(why, "ucp_worker_get_address", s);
    worker_addr_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    if (s = ucp_worker_get_efd(worker_, &ucx_fd_); s != UCS_OK) return fail(why, "ucp_worker_get_efd", s);
    ucp_am_handler_param_t ah{};
    ah.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ah.id = put_am_id;
    ah.cb = &ucx_transport::on_am;
    ah.arg = this;
    if (s = ucp_worker_set_am_recv_handler(worker_, &ah); s != UCS_OK) return fail(why, "ucp_worker_set_am_recv_handler", s);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return fail(why, "eventfd", UCS_ERR_IO_ERROR);
    thread_ = std::thread([this] { progress_loop(); });
    return true;
  }

  ~ucx_transport() override {
    quiesce();
    if (wake_fd_ >= 0) close(wake_fd_);
    if (worker_) ucp_worker_destroy(worker_);
    // Only now, with no worker left to land a peer's late put in them.
    for (auto& [base, a] : allocations_) ucp_mem_unmap(context_, a.memh);
    if (context_) ucp_cleanup(context_);
  }

  capabilities caps() const override { return {"ucx", true, true, false}; }

  /// Joins the progress thread, which closes the endpoints first (see progress_loop's end).
  void quiesce() override {
    std::lock_guard<std::mutex> once{quiesce_mutex_};
    if (!thread_.joinable()) return;
    run_on_thread([this] { stop_ = true; });
    thread_.join();
    // Commands queued while the thread ended: run here (each sees stop_ and does nothing), so
    // that no caller waits for ever.
    std::deque<std::function<void()>> left;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      stopped_ = true;
      left.swap(queue_);
    }
    std::lock_guard<std::mutex> inline_lock{inline_mutex_};
    for (auto& fn : left) fn();
  }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) override {
    return run_on_thread([&]() -> std::optional<region_key> {
      if (stop_) {
        if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, "the transport has stopped (quiesce)"};
        return std::nullopt;
      }
      // Inside memory of ours: its mapping serves (and its rkey lets peers store into it).
      ucp_mem_h memh = nullptr;
      bool owned = false;
      if (auto a = allocations_.upper_bound(base); a != allocations_.begin()) {
        --a;
        if (!a->second.freed && base + size_bytes <= a->first + a->second.size_bytes) memh = a->second.memh;
      }
      if (!memh) {
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = base;
        mp.length = size_bytes;
        if (auto s = ucp_mem_map(context_, &mp, &memh); s != UCS_OK) {
          if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, std::string{"ucp_mem_map: "} + ucs_status_string(s)};
          return std::nullopt;
        }
        owned = true;
      }
      void* rkey = nullptr;
      size_t rkey_len = 0;
      if (auto s = ucp_rkey_pack(context_, memh, &rkey, &rkey_len); s != UCS_OK) {
        if (owned) ucp_mem_unmap(context_, memh);
        if (err) *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0, std::string{"ucp_rkey_pack: "} + ucs_status_string(s)};
        return std::nullopt;
      }
      const uint64_t id = ++last_region_;
      regions_[id] = {base, size_bytes, memh, owned};
      region_key key{"ucx", id, size_bytes,
                     pack_key(reinterpret_cast<uint64_t>(base), worker_addr_.data(),
                              static_cast<uint32_t>(worker_addr_.size()), rkey, rkey_len)};
      ucp_rkey_buffer_release(rkey);
      return key;
    });
  }

  void deregister_region(uint64_t region_id) override {
    run_on_thread([&] {
      auto i = regions_.find(region_id);
      if (i == regions_.end()) return;
      if (i->second.owned) ucp_mem_unmap(context_, i->second.memh);
      regions_.erase(i);
    });
  }

  /// UCX allocates it (UCX_ALLOC_PRIO: a System V or POSIX shared-memory segment first), so its
  /// rkey carries the segment and peers on this host attach it and store into it directly.
  std::byte* allocate_memory(uint64_t size_bytes, xfer_error* err) override {
    return run_on_thread([&]() -> std::byte* {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      mp.address = nullptr;
      mp.length = std::max<uint64_t>(size_bytes, 1);
      mp.flags = UCP_MEM_MAP_ALLOCATE;
      ucp_mem_h memh = nullptr;
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      auto s = ucp_mem_map(context_, &mp, &memh);
      if (s == UCS_OK && (s = ucp_mem_query(memh, &attr)) != UCS_OK) ucp_mem_unmap(context_, memh);
      if (s != UCS_OK) {
        if (err)
          *err = {xfer_errc::backend_error, false, 0, cfg_.name, 0,
                  "cannot allocate " + std::to_string(size_bytes) + " bytes: ucp_mem_map: " + ucs_status_string(s)};
        return nullptr;
      }
      auto* base = static_cast<std::byte*>(attr.address);
      allocations_[base] = {memh, attr.length, false};
      return base;
    });
  }

  /// Kept mapped until the transport goes (see the destructor): over TCP a peer's put is
  /// written by our progress thread, and one arriving late must not find the pages unmapped.
  void free_memory(std::byte* base) override {
    run_on_thread([&] {
      if (auto a = allocations_.find(base); a != allocations_.end()) a->second.freed = true;
    });
  }

  std::byte* map_remote(const region_key& key) override {
    return run_on_thread([&]() -> std::byte* {
      if (stop_) return nullptr;  // its peers' keys and endpoints are gone
      unpacked_key k;
      if (key.backend != "ucx" || !unpack_key(key.packed, &k)) return nullptr;
      xfer_error ignored;
      auto* rkey = remote_rkey(k, &ignored);
      void* p = nullptr;
      if (!rkey || ucp_rkey_ptr(rkey, k.base, &p) != UCS_OK) return nullptr;
      peers_[k.worker_addr].keys[k.rkey].mapped = true;  // the pointer must stay valid: never dropped
      return static_cast<std::byte*>(p);
    });
  }

  uint64_t post_put(const put_desc& desc) override {
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      id = ++last_xfer_;
      if (stopped_) {  // nothing would ever start it
        status_[id] = {xfer_state::failed,
                       {xfer_errc::backend_error, false, desc.request_id, desc.peer, desc.layer, "the transport has stopped (quiesce)"}};
        return id;
      }
      status_[id] = {xfer_state::pending, {}};
      queue_.push_back([this, id, desc] { start(id, desc); });
    }
    wake();
    return id;
  }

  xfer_state poll(uint64_t xfer_id, xfer_error* err) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto i = status_.find(xfer_id);
    if (i == status_.end()) {
      if (err) *err = {xfer_errc::unknown_region, false, 0, cfg_.name, 0, "unknown transfer id " + std::to_string(xfer_id)};
      return xfer_state::failed;
    }
    if (i->second.first == xfer_state::failed && err) *err = i->second.second;
    return i->second.first;
  }

  void release(uint64_t xfer_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    status_.erase(xfer_id);  // a transfer still in flight finishes unobserved
  }

  transport_stats stats() override {
    return run_on_thread([&] {
      transport_stats out;
      out.peers = peers_.size();
      for (const auto& [addr, p] : peers_) out.keys += p.keys.size();
      out.in_flight = inflight_.size();
      return out;
    });
  }

private:
  struct registered {
    std::byte* base;
    uint64_t size_bytes;
    ucp_mem_h memh;
    bool owned;  ///< mapped for this region (not an allocation's mapping)
  };
  struct allocation {
    ucp_mem_h memh;
    uint64_t size_bytes;
    bool freed;  ///< given back; unmapped when the transport goes
  };

  /// Progress thread: an active-message put arrived. Its bytes go straight into the region the
  /// header names; a header outside every region fails the sender's request with the status.
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<ucx_transport*>(arg);
    am_header h{};
    if (header_length != sizeof h) return UCS_ERR_INVALID_PARAM;
    std::memcpy(&h, header, sizeof h);
    auto r = self->regions_.find(h.region_id);
    // The target's own check on another process's header: no sum that can wrap.
    const bool fits = r != self->regions_.end() && h.dst_offset <= r->second.size_bytes &&
                      length <= r->second.size_bytes - h.dst_offset;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {  // eager (the sender forces rendezvous)
      if (fits) std::memcpy(r->second.base + h.dst_offset, data, length);
      return UCS_OK;
    }
    if (!fits) return UCS_ERR_INVALID_PARAM;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    rp.cb.recv_am = [](void* request, ucs_status_t, size_t, void*) { ucp_request_free(request); };
    auto req = ucp_am_recv_data_nbx(self->worker_, data, r->second.base + h.dst_offset, length, &rp);
    return UCS_PTR_IS_ERR(req) ? UCS_PTR_STATUS(req) : UCS_INPROGRESS;
  }

  static bool fail(std::string* why, const char* what, ucs_status_t s) {
    if (why) *why = std::string{what} + ": " + ucs_status_string(s);
    return false;
  }

  void wake() {
    uint64_t one = 1;
    [[maybe_unused]] auto n = write(wake_fd_, &one, sizeof(one));
  }

  /// Runs fn on the progress thread and waits for it (registration, shutdown: rare calls).
  template <class F>
  auto run_on_thread(F fn) -> decltype(fn()) {
    using R = decltype(fn());
    std::packaged_task<R()> task{std::move(fn)};
    auto fut = task.get_future();
    {
      // Looked at and queued under one lock: quiesce either runs what is queued by then, or this
      // sees it stopped. Quiesced: no thread to run it, and none that could race with it (its
      // state is this thread's after the join; callers are serialised here).
      std::unique_lock<std::mutex> lock{mutex_};
      if (stopped_) {
        lock.unlock();
        std::lock_guard<std::mutex> inline_lock{inline_mutex_};
        task();
        return fut.get();
      }
      queue_.push_back([&task] { task(); });
    }
    wake();
    return fut.get();
  }

  void set_settled_listener(std::function<void()> fn) override {
    auto shared = fn ? std::make_shared<const std::function<void()>>(std::move(fn)) : nullptr;
    std::lock_guard<std::mutex> lock{mutex_};
    listener_ = std::move(shared);
  }

  void finish(uint64_t id, xfer_state state, xfer_error err = {}) {
    std::shared_ptr<const std::function<void()>> listener;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto i = status_.find(id);
      if (i == status_.end()) return;  // released unobserved: nobody is waiting for it
      i->second = {state, std::move(err)};
      listener = listener_;
    }
    if (listener) (*listener)();
  }

  /// Progress thread: the endpoint to the key's worker and the key's unpacked rkey, made on first
  /// use; the endpoint is kept, the key while used (drop_idle, trim). Null with `err` filled
  /// when UCX refuses either.
  ucp_rkey_h remote_rkey(const unpacked_key& key, xfer_error* err) {
    const uint64_t now = now_ms();
    auto& peer = peers_[key.worker_addr];
    if (!peer.ep) {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep.address = reinterpret_cast<const ucp_address_t*>(key.worker_addr.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // PEER mode would disable shared memory
      if (auto s = ucp_ep_create(worker_, &ep, &peer.ep); s != UCS_OK) {
        peers_.erase(key.worker_addr);
        err->code = xfer_errc::peer_unreachable;
        err->retryable = true;
        err->what = std::string{"ucp_ep_create: "} + ucs_status_string(s);
        return nullptr;
      }
    }
    auto& cached = peer.keys[key.rkey];
    cached.used_ms = now;
    if (!cached.handle) {
      if (auto s = ucp_ep_rkey_unpack(peer.ep, key.rkey.data(), &cached.handle); s != UCS_OK) {
        peer.keys.erase(key.rkey);
        err->code = xfer_errc::backend_error;
        err->what = std::string{"ucp_ep_rkey_unpack: "} + ucs_status_string(s);
        return nullptr;
      }
      trim(peer, key.rkey);
    }
    return cached.handle;
  }

  /// Progress thread: past the cap, drops the least recently used keys of `peer`, keeping the one
  /// just used (`rkey`) and any in flight or mapped.
  void trim(remote_peer& peer, const std::string& rkey) {
    while (peer.keys.size() > cfg_.max_keys_per_peer) {
      auto victim = peer.keys.end();
      for (auto k = peer.keys.begin(); k != peer.keys.end(); ++k)
        if (k->first != rkey && k->second.in_flight == 0 && !k->second.mapped &&
            (victim == peer.keys.end() || k->second.used_ms < victim->second.used_ms))
          victim = k;
      if (victim == peer.keys.end()) break;  // every one is busy: over the cap until they settle
      ucp_rkey_destroy(victim->second.handle);
      peer.keys.erase(victim);
    }
  }

  /// Progress thread: drops the keys unused for cfg_.key_idle_ms, so a peer that died or moved
  /// keeps none of its memory attached here.
  void drop_idle(uint64_t now) {
    for (auto& [addr, peer] : peers_)
      for (auto k = peer.keys.begin(); k != peer.keys.end();) {
        if (k->second.in_flight == 0 && !k->second.mapped && now - k->second.used_ms >= cfg_.key_idle_ms) {
          ucp_rkey_destroy(k->second.handle);
          k = peer.keys.erase(k);
        } else {
          ++k;
        }
      }
  }

  /// Progress thread: validates and posts the puts of one transfer.
  void start(uint64_t id, const put_desc& d) {
    xfer_error err{xfer_errc::none, false, d.request_id, d.peer, d.layer, {}};
    if (stop_) {  // posted as the transport stopped: its endpoints are gone
      err.code = xfer_errc::backend_error;
      err.what = "the transport has stopped (quiesce)";
      return finish(id, xfer_state::failed, err);
    }
    auto local = regions_.find(d.local_region);
    unpacked_key key;
    if (d.remote.backend != "ucx" || !unpack_key(d.remote.packed, &key)) {
      err.code = xfer_errc::unknown_region;
      err.what = "remote key is not a UCX key (backend '" + d.remote.backend + "')";
      return finish(id, xfer_state::failed, err);
    }
    if (local == regions_.end()) {
      err.code = xfer_errc::unknown_region;
      err.what = "local region " + std::to_string(d.local_region) + " is not registered";
      return finish(id, xfer_state::failed, err);
    }
    if (auto bad = segments_outside(d.segments, local->second.size_bytes, d.remote.size_bytes); !bad.empty()) {
      err.code = xfer_errc::out_of_bounds;
      err.what = std::move(bad);
      return finish(id, xfer_state::failed, err);
    }
    auto* rkey = remote_rkey(key, &err);
    if (!rkey) return finish(id, xfer_state::failed, err);
    // A layer's pages are often consecutive on both sides: one put (or one rendezvous) for each
    // run of them, not one per page.
    const auto segments = coalesce_segments(d.segments);
    auto& peer = peers_[key.worker_addr];
    transfer t{{}, {}, xfer_state::pending, err, &peer.keys[key.rkey]};
    ++t.key->in_flight;
    ucp_request_param_t rp{};
    if (cfg_.send == "am") {
      // Rendezvous for every size: the send completes only once the target has the bytes, which
      // is what "done" promises (an eager send completes when the data left).
      ucp_request_param_t ap{};
      ap.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      ap.flags = UCP_AM_SEND_FLAG_RNDV;
      t.headers.reserve(segments.size());
      for (const auto& s : segments) {
        t.headers.push_back({d.remote.region_id, s.dst_offset});  // reserved: the pointer stays valid
        if (!t.track(ucp_am_send_nbx(peer.ep, put_am_id, &t.headers.back(), sizeof(am_header),
                                     local->second.base + s.src_offset, s.size_bytes, &ap),
                     "ucp_am_send_nbx"))
          break;
      }
      inflight_.emplace(id, std::move(t));
      return;
    }
    bool ok = true;
    for (const auto& s : segments)
      if (!(ok = t.track(ucp_put_nbx(peer.ep, local->second.base + s.src_offset, s.size_bytes, key.base + s.dst_offset,
                                     rkey, &rp),
                         "ucp_put_nbx")))
        break;
    // The flush completes when every put above is complete at the target.
    if (ok) t.track(ucp_ep_flush_nbx(peer.ep, &rp), "ucp_ep_flush_nbx");
    inflight_.emplace(id, std::move(t));
  }

  /// Progress thread: retires UCX requests, reports finished transfers.
  void check_inflight() {
    for (auto i = inflight_.begin(); i != inflight_.end();) {
      auto& t = i->second;
      for (auto r = t.pending.begin(); r != t.pending.end();) {
        const auto s = ucp_request_check_status(r->first);
        if (s == UCS_INPROGRESS) {
          ++r;
          continue;
        }
        if (s != UCS_OK && t.state == xfer_state::pending) {
          t.state = xfer_state::failed;
          set_failure(&t.error, s, r->second);
        }
        ucp_request_free(r->first);
        r = t.pending.erase(r);
      }
      if (!t.pending.empty()) {
        ++i;
        continue;
      }
      finish(i->first, t.state == xfer_state::pending ? xfer_state::done : xfer_state::failed, t.error);
      if (t.key) --t.key->in_flight;  // settled: its key may go when idle
      i = inflight_.erase(i);
    }
  }


  /// Sleeps up to `ms` unless UCX has events or a command is queued (wake()).
  void wait_for_events(int ms) {
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;
    pollfd fds[2] = {{ucx_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, ms);
    uint64_t drained;
    [[maybe_unused]] auto n = read(wake_fd_, &drained, sizeof(drained));
  }

  void progress_loop() {
    // The active-message receive handler may run on this thread only (thread mode single).
    while (!stop_) {
      std::deque<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock{mutex_};
        work.swap(queue_);
      }
      for (auto& fn : work) fn();
      // Bounded: a peer streaming active messages without pause must not starve the command
      // queue (run_on_thread callers block on it) or the settling of transfers.
      for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) {
      }
      check_inflight();
      if (stop_) break;
      if (const uint64_t now = now_ms(); now >= next_idle_check_ms_) {
        drop_idle(now);
        next_idle_check_ms_ = now + std::clamp<uint64_t>(cfg_.key_idle_ms / 4, 1, 1000);
      }
      if (!inflight_.empty()) {
        // Busy while transfers are in flight, but every so often let the other threads of this
        // core run: on a small machine the executor and the peer's progress thread (which some
        // shared-memory flushes wait for) need it too.
        if (only_unwatched_ || ++spins_ % 256 == 0) {
          // Transfers nobody polls any more (released: given up by their callers, e.g. a put to a
          // peer that died, which UCX never fails over shared memory) must not keep a core
          // spinning for ever: with only those left, wait up to a millisecond each pass, until a
          // transfer someone waits for is posted again -- woken at once by UCX's events (peers'
          // puts into this side over TCP, rendezvous of active messages) or a command.
          bool watched = false;
          {
            std::lock_guard<std::mutex> lock{mutex_};
            for (const auto& [id, t] : inflight_)
              if (status_.count(id)) {
                watched = true;
                break;
              }
          }
          only_unwatched_ = !watched;
          if (watched) std::this_thread::yield();
          else wait_for_events(1);
        }
        continue;
      }
      only_unwatched_ = false;
      // Idle: sleep until UCX has events (incoming puts over TCP need our progress) or a
      // command arrives.
      wait_for_events(static_cast<int>(cfg_.idle_wait_ms));
    }
    // Endpoints first: a forced close ends the requests still on them (transfers their callers
    // released, given up), which are then freed, and only then the remote keys they used.
    for (auto& [addr, peer] : peers_) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      auto req = ucp_ep_close_nbx(peer.ep, &rp);
      if (UCS_PTR_IS_PTR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker_);
        ucp_request_free(req);
      }
    }
    for (auto& [id, t] : inflight_) {
      for (const auto& [r, call] : t.pending) {
        for (int i = 0; i < 100000 && ucp_request_check_status(r) == UCS_INPROGRESS; ++i) ucp_worker_progress(worker_);
        if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);  // else left to the worker's end
      }
      // Settled for whoever still polls it (the transport may outlive this, quiesced): it will
      // not land now, its endpoint is gone.
      t.error.code = xfer_errc::backend_error;
      t.error.retryable = false;
      t.error.what = "the transport stopped (quiesce) with it in flight";
      finish(id, xfer_state::failed, t.error);
    }
    inflight_.clear();
    for (auto& [addr, peer] : peers_)
      for (auto& [bytes, k] : peer.keys) ucp_rkey_destroy(k.handle);
    peers_.clear();
    for (auto& [id, r] : regions_)
      if (r.owned) ucp_mem_unmap(context_, r.memh);
    regions_.clear();
  }

  ucx_config cfg_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string worker_addr_;
  int ucx_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  bool stop_ = false;  ///< set on the progress thread; read there, or inline once it is joined
  bool stopped_ = false;  ///< the thread is joined (quiesce): run_on_thread runs inline (under mutex_)
  std::mutex quiesce_mutex_;
  std::mutex inline_mutex_;
  uint64_t spins_ = 0;
  bool only_unwatched_ = false;  ///< in flight: only transfers their callers released (progress thread)

  // Progress-thread state.
  uint64_t last_region_ = 0;
  std::unordered_map<uint64_t, registered> regions_;
  std::map<std::byte*, allocation> allocations_;  ///< by base, ordered to find the one holding a pointer
  std::unordered_map<std::string, remote_peer> peers_;
  std::unordered_map<uint64_t, transfer> inflight_;
  uint64_t next_idle_check_ms_ = 0;

  // Shared with callers.
  std::mutex mutex_;
  std::deque<std::function<void()>> queue_;
  uint64_t last_xfer_ = 0;
  std::unordered_map<uint64_t, std::pair<xfer_state, xfer_error>> status_;
  std::shared_ptr<const std::function<void()>> listener_;  ///< see set_settled_listener
};

}  // namespace

std::unique_ptr<transport> make_ucx_transport(const ucx_config& cfg, std::string* why) {
  if (auto e = cfg.validate(); !e.empty()) {
    if (why) *why = e;
    return nullptr;
  }
  auto t = std::make_unique<ucx_transport>(cfg);
  if (!t->init(why)) return nullptr;
  return t;
}

}  // namespace baton::transport
