#pragma once

// Moving KV bytes between ranks. One interface, several backends (in-process loopback, UCX
// between processes, NCCL between device regions, CUDA IPC into device memory of another process
// on the host), and a fault-injecting proxy for tests and sims.
//
// Lifecycle, as NIXL's backends: prepare (register_region on both sides, ship the region_key
// to the peer in a message) -> post_put -> poll until done or failed -> release.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace baton::transport {

/// Each code is documented as retryable (the same put may succeed later, or elsewhere) or fatal.
enum class xfer_errc : uint8_t {
  none = 0,
  unknown_region,    ///< fatal: the key names no registered region (stale key, wrong fabric)
  out_of_bounds,     ///< fatal: a segment leaves its region
  peer_unreachable,  ///< retryable: the peer's endpoint is gone
  injected_failure,  ///< retryable: the fault proxy failed the put on purpose
  backend_error,     ///< fatal: the backend library reported an error
};

struct xfer_error {
  xfer_errc code = xfer_errc::none;
  bool retryable = false;
  uint64_t request_id = 0;
  std::string peer;
  uint32_t layer = 0;
  std::string what;
  /// "request 7, peer decode-0, layer 3: segment [4096, 8192) outside region of 4096 bytes"
  std::string to_string() const;
};

/// Describes a registered region to a peer; travels inside messages (plain data only).
struct region_key {
  std::string backend;          ///< which backend made it ("loopback", "ucx")
  uint64_t region_id = 0;
  uint64_t size_bytes = 0;
  std::vector<uint8_t> packed;  ///< backend-specific remote key (e.g. a packed UCX rkey)
};

/// A key as one line of text, "<backend> <region id> <size> <hex of packed>", for handing keys
/// between processes over pipes (benchmarks, expert shards); key_from_text reads it back and
/// gives nothing for a malformed line.
std::string key_to_text(const region_key& k);
std::optional<region_key> key_from_text(const std::string& line);

struct capabilities {
  std::string name;
  bool one_sided_put = false;     ///< writes into the peer's memory without its CPU
  bool crosses_processes = false;
  bool device_memory = false;     ///< can register GPU memory
};

/// One contiguous copy; offsets are relative to the start of each region.
struct segment {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t size_bytes = 0;
};

/// Why a put's segments do not fit its regions (a segment past either end, or one whose end
/// overflows), naming the first such segment; empty when they fit. Every backend checks so.
std::string segments_outside(const std::vector<segment>& segments, uint64_t local_bytes, uint64_t remote_bytes);

/// The same copies in fewer segments: each segment that continues the one before it in both
/// regions joins it, and empty ones go (order kept). Backends that pay per copy call it (a KV
/// layer's pages are often consecutive on both sides).
std::vector<segment> coalesce_segments(const std::vector<segment>& segments);

/// Bytes as lowercase hex, and back (false for odd length or a character that is not one).
std::string hex_of(const uint8_t* bytes, size_t n);
bool bytes_of_hex(const std::string& hex, std::vector<uint8_t>* out);

struct put_desc {
  uint64_t request_id = 0;  ///< for error messages
  uint32_t layer = 0;       ///< for error messages and fault targeting
  std::string peer;         ///< the destination rank's name
  uint64_t local_region = 0;
  region_key remote;
  std::vector<segment> segments;
};

enum class xfer_state : uint8_t { pending, done, failed };

/// What a backend holds for its peers, for operators and tests (zeros where it keeps nothing).
struct transport_stats {
  uint64_t peers = 0;      ///< endpoints to peers kept open
  uint64_t keys = 0;       ///< peers' memory keys kept unpacked
  uint64_t in_flight = 0;  ///< transfers not yet settled (released ones too)
};

/// Backends are thread-safe: posts may come from an executor's thread while the owning actor
/// polls. A post never blocks on the transfer itself.
class transport {
public:
  virtual ~transport() = default;
  virtual capabilities caps() const = 0;
  /// prepare: makes [base, base + size_bytes) reachable by peers holding the returned key.
  virtual std::optional<region_key> register_region(std::byte* base, uint64_t size_bytes, xfer_error* err) = 0;
  virtual void deregister_region(uint64_t region_id) = 0;
  /// Starts a put; the returned id is polled. Errors (also validation errors) surface in poll.
  virtual uint64_t post_put(const put_desc& desc) = 0;
  virtual xfer_state poll(uint64_t xfer_id, xfer_error* err) = 0;
  /// Forgets a finished (or abandoned) transfer.
  virtual void release(uint64_t xfer_id) = 0;

  /// Memory that peers reach fastest once registered (a receive buffer, a KV pool); page
  /// aligned, committed as it is touched, not necessarily zeroed; null and `err` when none is
  /// left. UCX gives a shared-memory segment: a peer on this host then puts into it with plain
  /// stores and never waits for this side's progress, where puts into ordinary memory are
  /// emulated with messages this side must progress (measured here: 5 against 10 GB/s at 1 MiB,
  /// 3 against 0.4 us for an 8-byte put and flush). The default is the heap.
  virtual std::byte* allocate_memory(uint64_t size_bytes, xfer_error* err);
  /// Gives back what allocate_memory returned, after every region over it is deregistered. A
  /// backend whose peers may still write may keep the pages until it is itself destroyed.
  virtual void free_memory(std::byte* base);
  /// A pointer through which this process writes a peer's registered region with plain stores
  /// (UCX over shared memory, the in-process loopback), or null where only puts reach it. Valid
  /// while this transport and the peer's region live. Stores through it complete when they
  /// retire; the peer observes them in program order when it reads a flag the writer stores
  /// last with release semantics (and loads with acquire).
  virtual std::byte* map_remote(const region_key& key);
  /// Called after a transfer settles (done or failed), on the backend's own thread, so that its
  /// owner polls at once instead of on its next timer tick. Must be cheap, must not block and must
  /// not call into the transport. Backends whose puts settle inside post_put (loopback) never
  /// call it: their owner finds the transfer settled at its first poll. One per transport; setting
  /// another replaces it, an empty one removes it.
  virtual void set_settled_listener(std::function<void()> fn);
  virtual transport_stats stats();
  /// Stops moving bytes, for good, before its owner frees buffers it registered: when it returns
  /// no put of this side reads a source and no peer's put is written by this side any more (a
  /// backend with its own thread has joined it). Its memory (allocate_memory) stays mapped until
  /// it is destroyed; a later post fails, and other calls do nothing harmful. Others may still
  /// hold the transport (a deleter that deregisters, the pool's memory), so destruction alone
  /// does not say when. The default does nothing: backends without a thread of their own (the
  /// loopback's puts complete inside post_put) have nothing in flight.
  virtual void quiesce() {}
};

/// allocate_memory from `t`, freed when the last holder lets go, and holding `t` until then (a
/// rank's KV pool must not outlive the transport its pages came from); null and `err` when `t`
/// has none.
std::shared_ptr<std::byte> transport_memory(std::shared_ptr<transport> t, uint64_t size_bytes, xfer_error* err);

/// Stands in for a backend that could not start: every call fails with the reason, so the
/// rank owning it refuses work with a clear error instead of crashing.
class failed_transport final : public transport {
public:
  explicit failed_transport(std::string why) : why_(std::move(why)) {}
  capabilities caps() const override { return {"failed", false, false, false}; }
  std::optional<region_key> register_region(std::byte*, uint64_t, xfer_error* err) override {
    if (err) *err = {xfer_errc::backend_error, false, 0, {}, 0, why_};
    return std::nullopt;
  }
  void deregister_region(uint64_t) override {}
  uint64_t post_put(const put_desc&) override { return 0; }
  xfer_state poll(uint64_t, xfer_error* err) override {
    if (err) *err = {xfer_errc::backend_error, false, 0, {}, 0, why_};
    return xfer_state::failed;
  }
  void release(uint64_t) override {}

private:
  std::string why_;
};

}  // namespace baton::transport
