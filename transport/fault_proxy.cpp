#include "transport/fault_proxy.hpp"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace baton::transport {

namespace {

class fault_proxy_impl final : public fault_proxy {
public:
  fault_proxy_impl(std::unique_ptr<transport> inner, fault_plan plan) : inner_(std::move(inner)), plan_(plan) {}

  ~fault_proxy_impl() override {
    if (scratch_key_) inner_->deregister_region(scratch_key_->region_id);
  }

  capabilities caps() const override {
    auto c = inner_->caps();
    c.name = "fault_proxy(" + c.name + ")";
    return c;
  }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) override {
    auto key = inner_->register_region(base, size_bytes, err);
    if (key) {
      std::lock_guard<std::mutex> lock{mutex_};
      local_bases_[key->region_id] = {base, size_bytes};
    }
    return key;
  }

  void deregister_region(uint64_t region_id) override {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      local_bases_.erase(region_id);
    }
    inner_->deregister_region(region_id);
  }

  std::byte* allocate_memory(uint64_t size_bytes, xfer_error* err) override { return inner_->allocate_memory(size_bytes, err); }
  void free_memory(std::byte* base) override { inner_->free_memory(base); }
  /// None: a direct store would pass the proxy by, and its faults need every byte to be a put.
  std::byte* map_remote(const region_key&) override { return nullptr; }
  void set_settled_listener(std::function<void()> fn) override { inner_->set_settled_listener(std::move(fn)); }
  transport_stats stats() override { return inner_->stats(); }

  uint64_t post_put(const put_desc& d) override {
    std::unique_lock<std::mutex> lock{mutex_};
    if (disconnected_) {
      const uint64_t id = ++last_own_id_ | own_bit_;
      own_[id] = {xfer_errc::peer_unreachable, true, d.request_id, d.peer, d.layer, "fault proxy: peer disconnected"};
      return id;
    }
    const bool hit = injected_ < plan_.max_faults && (!plan_.at_layer || *plan_.at_layer == d.layer) &&
                     (!plan_.for_request || *plan_.for_request == d.request_id) && !d.segments.empty();
    if (!hit) {
      lock.unlock();
      return inner_->post_put(d);
    }
    ++injected_;
    const uint64_t id = ++last_own_id_ | own_bit_;
    switch (plan_.kind) {
      case fault_kind::fail:
        own_[id] = {xfer_errc::injected_failure, true, d.request_id, d.peer, d.layer, "fault proxy failed this put"};
        return id;
      case fault_kind::refuse:
        own_[id] = {xfer_errc::out_of_bounds, false, d.request_id, d.peer, d.layer, "fault proxy refused this put as out of bounds"};
        return id;
      case fault_kind::stall:
        stalled_.insert(id);
        return id;
      case fault_kind::drop:
        dropped_.insert(id);
        return id;
      case fault_kind::late:
        late_[id] = {d, false, false, {}};
        return id;
      case fault_kind::disconnect:
        disconnected_ = true;
        own_[id] = {xfer_errc::peer_unreachable, true, d.request_id, d.peer, d.layer, "fault proxy: peer disconnected"};
        return id;
      case fault_kind::delay: {
        lock.unlock();
        const uint64_t real = inner_->post_put(d);
        lock.lock();
        delayed_[real] = plan_.delay_polls;
        return real;
      }
      case fault_kind::corrupt_byte:
        break;
    }
    // Land the put, then overwrite one byte at the destination with its flipped value, sent
    // from a one-byte scratch region through the inner transport.
    lock.unlock();
    const uint64_t real = inner_->post_put(d);
    lock.lock();
    uint64_t r = plan_.seed * 0x9E3779B97F4A7C15ull + injected_;
    // Only a segment with bytes can have one flipped (a put of no segments, or of empty ones, has none).
    std::vector<const segment*> sized;
    for (const auto& s : d.segments)
      if (s.size_bytes > 0) sized.push_back(&s);
    if (sized.empty()) return real;
    const auto& seg = *sized[r % sized.size()];
    const uint64_t off = (r >> 16) % seg.size_bytes;
    auto base = local_bases_.find(d.local_region);
    if (base == local_bases_.end()) return real;  // unknown local region: the inner put reports it
    // A put outside its regions fails in the inner backend; its source byte must not be read here.
    if (!segments_outside(d.segments, base->second.second, d.remote.size_bytes).empty()) return real;
    if (!scratch_key_) {
      xfer_error ignored;
      scratch_key_ = inner_->register_region(&scratch_, 1, &ignored);
      if (!scratch_key_) return real;  // no flip possible: the put lands intact (the test sees no fault)
    }
    const auto flipped = static_cast<std::byte>(~static_cast<uint8_t>(base->second.first[seg.src_offset + off]));
    put_desc flip{d.request_id, d.layer, d.peer, scratch_key_->region_id, d.remote, {{0, seg.dst_offset + off, 1}}};
    lock.unlock();
    // The flip must land after the put, and read its own byte: one flip at a time. The loopback
    // backend completes puts in post order (in virtual time too, where waiting here would never
    // end); a backend across processes (UCX's worker thread) does not: there the flip is posted
    // once the put has settled, and waited for in turn -- this post blocks, as a fault may.
    std::lock_guard<std::mutex> one_flip{flip_mutex_};
    const bool in_order = !inner_->caps().crosses_processes;
    xfer_error ignored;
    if (!in_order) settle_inner(real, &ignored);
    scratch_ = flipped;
    const uint64_t f = inner_->post_put(flip);
    if (!in_order) settle_inner(f, &ignored);  // (in order: the flip lands after the put, whenever)
    inner_->release(f);
    return real;
  }

  void quiesce() override { inner_->quiesce(); }

  xfer_state poll(uint64_t xfer_id, xfer_error* err) override {
    if (!(xfer_id & own_bit_)) {
      {
        std::lock_guard<std::mutex> lock{mutex_};
        if (auto d = delayed_.find(xfer_id); d != delayed_.end() && d->second > 0) {
          --d->second;
          return xfer_state::pending;
        }
      }
      return inner_->poll(xfer_id, err);
    }
    std::lock_guard<std::mutex> lock{mutex_};
    if (stalled_.count(xfer_id)) return xfer_state::pending;
    if (auto l = late_.find(xfer_id); l != late_.end()) {
      if (!l->second.landed) return xfer_state::pending;
      if (l->second.error.code == xfer_errc::none) return xfer_state::done;
      if (err) *err = l->second.error;
      return xfer_state::failed;
    }
    if (dropped_.count(xfer_id)) return xfer_state::done;
    auto i = own_.find(xfer_id);
    if (i == own_.end()) {
      if (err) *err = {xfer_errc::unknown_region, false, 0, {}, 0, "fault proxy: unknown transfer id " + std::to_string(xfer_id)};
      return xfer_state::failed;
    }
    if (err) *err = i->second;
    return xfer_state::failed;
  }

  void release(uint64_t xfer_id) override {
    if (!(xfer_id & own_bit_)) {
      {
        std::lock_guard<std::mutex> lock{mutex_};
        delayed_.erase(xfer_id);
      }
      return inner_->release(xfer_id);
    }
    std::lock_guard<std::mutex> lock{mutex_};
    own_.erase(xfer_id);
    stalled_.erase(xfer_id);
    dropped_.erase(xfer_id);
    if (auto l = late_.find(xfer_id); l != late_.end()) {
      if (l->second.landed)
        late_.erase(l);
      else
        l->second.released = true;  // it still lands, when land_late() says so
    }
  }

  void land_late() override {
    std::vector<std::pair<uint64_t, put_desc>> due;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (auto& [id, l] : late_)
        if (!l.landed) due.emplace_back(id, l.desc);
    }
    for (auto& [id, d] : due) {
      const uint64_t real = inner_->post_put(d);
      xfer_error err;
      const xfer_state s = settle_inner(real, &err);  // loopback: at once
      inner_->release(real);
      std::lock_guard<std::mutex> lock{mutex_};
      auto l = late_.find(id);
      if (l == late_.end()) continue;
      if (l->second.released) {
        late_.erase(l);
        continue;
      }
      l->second.landed = true;
      if (s != xfer_state::done) l->second.error = s == xfer_state::failed ? err : xfer_error{xfer_errc::injected_failure, true, d.request_id, d.peer, d.layer, "fault proxy: the late put never settled"};
    }
  }

  uint32_t num_injected() const override {
    std::lock_guard<std::mutex> lock{mutex_};
    return injected_;
  }

private:
  /// Marks the ids the proxy answers itself: a bit of its own per proxy (of the top 16, where
  /// no backend's ids reach), so that a proxy wrapping another tells its ids from the inner's.
  const uint64_t own_bit_ = uint64_t{1} << (63 - next_instance_.fetch_add(1) % 16);
  static inline std::atomic<uint32_t> next_instance_{0};

  std::unique_ptr<transport> inner_;
  fault_plan plan_;
  /// Waits until the inner transfer is no longer pending, and says how it ended; its state stays
  /// for whoever polls it next. Bounded: across processes 10 s (a test's fault, never a hang);
  /// in process (loopback, settled at once, or in virtual time, where waiting would never end)
  /// a burst of polls.
  xfer_state settle_inner(uint64_t xfer_id, xfer_error* err) {
    const bool waits = inner_->caps().crosses_processes;
    xfer_state s = inner_->poll(xfer_id, err);
    for (int i = 0; i < 100000 && s == xfer_state::pending; ++i) {
      if (waits) std::this_thread::sleep_for(std::chrono::microseconds{100});
      s = inner_->poll(xfer_id, err);
    }
    return s;
  }

  mutable std::mutex mutex_;
  std::mutex flip_mutex_;  ///< one corrupt_byte flip in flight at a time (it owns scratch_)
  uint32_t injected_ = 0;
  uint64_t last_own_id_ = 0;
  std::unordered_map<uint64_t, std::pair<std::byte*, uint64_t>> local_bases_;  ///< base and size by region id
  std::unordered_map<uint64_t, xfer_error> own_;
  std::unordered_set<uint64_t> stalled_;
  std::unordered_set<uint64_t> dropped_;
  std::unordered_map<uint64_t, uint32_t> delayed_;  ///< inner transfer id -> polls left
  struct late_put {
    put_desc desc;
    bool landed = false;
    bool released = false;
    xfer_error error{};  ///< code none: it landed
  };
  std::unordered_map<uint64_t, late_put> late_;
  bool disconnected_ = false;
  std::byte scratch_{};
  std::optional<region_key> scratch_key_;
};

}  // namespace

std::unique_ptr<fault_proxy> make_fault_proxy(std::unique_ptr<transport> inner, fault_plan plan) {
  return std::make_unique<fault_proxy_impl>(std::move(inner), plan);
}

}  // namespace baton::transport
