#include "transport/loopback.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace baton::transport {

class loopback_fabric {
public:
  struct region {
    std::byte* base;
    uint64_t size_bytes;
  };
  uint64_t add(std::byte* base, uint64_t size) {
    std::lock_guard<std::shared_mutex> lock{mutex_};
    regions_.emplace(++last_id_, region{base, size});
    return last_id_;
  }
  void remove(uint64_t id) {
    std::lock_guard<std::shared_mutex> lock{mutex_};
    regions_.erase(id);
  }
  std::optional<region> find(uint64_t id) {
    std::shared_lock<std::shared_mutex> lock{mutex_};
    auto i = regions_.find(id);
    if (i == regions_.end()) return std::nullopt;
    return i->second;
  }
  /// Runs fn(source, destination) -- null where not registered -- with both registrations held
  /// for its whole run: an owner deregistering a region (and then freeing it, as a rank that
  /// stops does) waits for a copy into it to finish instead of racing it.
  template <class F>
  void with_regions(uint64_t src, uint64_t dst, F fn) {
    std::shared_lock<std::shared_mutex> lock{mutex_};
    const auto s = regions_.find(src), d = regions_.find(dst);
    fn(s == regions_.end() ? nullptr : &s->second, d == regions_.end() ? nullptr : &d->second);
  }
  /// Memory an endpoint gave back: freed with the fabric, since a peer that mapped it
  /// (map_remote) may still store into it after its owner let go.
  void retire(std::byte* p) {
    std::lock_guard<std::shared_mutex> lock{mutex_};
    retired_.push_back(p);
  }
  ~loopback_fabric() {
    for (auto* p : retired_) std::free(p);
  }

private:
  std::shared_mutex mutex_;
  uint64_t last_id_ = 0;
  std::unordered_map<uint64_t, region> regions_;
  std::vector<std::byte*> retired_;
};

std::shared_ptr<loopback_fabric> make_loopback_fabric() { return std::make_shared<loopback_fabric>(); }

namespace {

class loopback_transport final : public transport {
public:
  loopback_transport(std::shared_ptr<loopback_fabric> fabric, std::string name, bool copy_bytes,
                     std::shared_ptr<link_timing> timing = nullptr)
    : fabric_(std::move(fabric)), name_(std::move(name)), copy_bytes_(copy_bytes), timing_(std::move(timing)) {}

  capabilities caps() const override { return {copy_bytes_ ? "loopback" : "modelled", true, false, false}; }

  std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error*) override {
    return region_key{"loopback", fabric_->add(base, size_bytes), size_bytes, {}};
  }

  void deregister_region(uint64_t region_id) override { fabric_->remove(region_id); }

  void free_memory(std::byte* base) override {
    if (base) fabric_->retire(base);
  }

  /// Every region of the fabric is in this process. The modelled link offers no pointer: its
  /// puts copy nothing, and direct stores would bypass its timing.
  std::byte* map_remote(const region_key& key) override {
    if (!copy_bytes_ || key.backend != "loopback") return nullptr;
    auto r = fabric_->find(key.region_id);
    return r ? r->base : nullptr;
  }

  uint64_t post_put(const put_desc& d) override {
    xfer_error err{xfer_errc::none, false, d.request_id, d.peer, d.layer, {}};
    copy(d, err);
    std::lock_guard<std::mutex> lock{mutex_};
    int64_t done_at = 0;
    if (timing_ && err.code == xfer_errc::none) done_at = schedule(d);
    finished_.emplace(++last_xfer_, put_outcome{std::move(err), done_at});
    return last_xfer_;
  }

  xfer_state poll(uint64_t xfer_id, xfer_error* err) override {
    std::lock_guard<std::mutex> lock{mutex_};
    auto i = finished_.find(xfer_id);
    if (i == finished_.end()) {
      if (err) *err = {xfer_errc::unknown_region, false, 0, {}, 0, "unknown transfer id " + std::to_string(xfer_id)};
      return xfer_state::failed;
    }
    if (i->second.done_at_ns && timing_->now_ns() < i->second.done_at_ns) return xfer_state::pending;
    if (i->second.error.code == xfer_errc::none) return xfer_state::done;
    if (err) *err = i->second.error;
    return xfer_state::failed;
  }

  void release(uint64_t xfer_id) override {
    std::lock_guard<std::mutex> lock{mutex_};
    finished_.erase(xfer_id);
  }

private:
  struct put_outcome {
    xfer_error error;
    int64_t done_at_ns = 0;  ///< modelled completion (0: at once)
  };

  /// The put's modelled completion: after both NICs' queues and its own bytes.
  int64_t schedule(const put_desc& d) {
    uint64_t bytes = 0;
    for (const auto& s : d.segments) bytes += s.size_bytes;
    auto& t = *timing_;
    std::lock_guard<std::mutex> lock{t.mutex};
    const double modelled = static_cast<double>(bytes) * t.bytes_scale;
    t.modelled_bytes += static_cast<uint64_t>(modelled);
    auto& out = t.nic_free_ns[name_];
    auto& in = t.nic_free_ns[d.peer];
    const int64_t start = std::max({t.now_ns(), out, in});
    const auto rate = [&](const std::string& end) {
      auto e = t.endpoint_gbps.find(end);
      return e != t.endpoint_gbps.end() ? e->second : t.gbps;
    };
    const double out_gbps = rate(name_), in_gbps = rate(d.peer);
    // The put moves at its slower end's rate; each end's queue is busy for the time its own NIC
    // takes to move the bytes (GB/s = B/ns), so a fat end (a wide instance's many NICs) serves
    // several thin senders at once instead of one after another.
    const int64_t done = start + t.latency_ns + static_cast<int64_t>(modelled / std::min(out_gbps, in_gbps));
    out = start + static_cast<int64_t>(modelled / out_gbps);
    in = start + static_cast<int64_t>(modelled / in_gbps);
    return std::max<int64_t>(done, 1);
  }

  void copy(const put_desc& d, xfer_error& err) {
    if (d.remote.backend != "loopback") {
      err.code = xfer_errc::unknown_region;
      err.what = "remote key comes from backend '" + d.remote.backend + "', not loopback";
      return;
    }
    fabric_->with_regions(d.local_region, d.remote.region_id, [&](const auto* src, const auto* dst) {
      if (!src || !dst) {
        err.code = xfer_errc::unknown_region;
        err.what = std::string{!src ? "local" : "remote"} + " region " +
                   std::to_string(!src ? d.local_region : d.remote.region_id) + " is not registered";
        return;
      }
      if (auto bad = segments_outside(d.segments, src->size_bytes, dst->size_bytes); !bad.empty()) {
        err.code = xfer_errc::out_of_bounds;
        err.what = std::move(bad);
        return;
      }
      if (copy_bytes_)
        for (const auto& s : d.segments) std::memcpy(dst->base + s.dst_offset, src->base + s.src_offset, s.size_bytes);
    });
  }

  std::shared_ptr<loopback_fabric> fabric_;
  std::string name_;
  bool copy_bytes_;
  std::shared_ptr<link_timing> timing_;
  std::mutex mutex_;
  uint64_t last_xfer_ = 0;
  std::unordered_map<uint64_t, put_outcome> finished_;
};

}  // namespace

std::unique_ptr<transport> make_loopback_transport(std::shared_ptr<loopback_fabric> fabric, std::string name) {
  return std::make_unique<loopback_transport>(std::move(fabric), std::move(name), true);
}

std::unique_ptr<transport> make_modelled_link(std::shared_ptr<loopback_fabric> fabric, std::string name,
                                              std::shared_ptr<link_timing> timing) {
  return std::make_unique<loopback_transport>(std::move(fabric), std::move(name), false, std::move(timing));
}

}  // namespace baton::transport
