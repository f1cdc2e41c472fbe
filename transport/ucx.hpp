#pragma once

// The UCX backend (UCX 1.13.1 from Debian): one UCP worker per rank, driven by its own progress
// thread so the owning actor never blocks. Peers learn each other's worker address and memory
// key from the region_key that travels in CAF messages (out-of-band address exchange: no
// listener, so UCX_TLS=sm works). One-sided puts land in the peer's registered KV pool; a flush
// after each transfer makes it remote-complete before poll() says done.
//
// Memory from allocate_memory is UCX's own (ucp_mem_map with ALLOCATE: a shared-memory segment
// when UCX can make one), and its rkey lets a peer on the same host map it: puts into it are then
// plain copies by the sender, and map_remote gives the pointer itself. Puts into memory merely
// registered are emulated over shared memory with messages this side's progress thread must
// serve (half the bandwidth at 1 MiB, 8x the latency of an 8-byte put, and no progress without
// that thread). Receive buffers should therefore come from allocate_memory.
//
// Transports come from UCX's configuration (UCX_TLS, UCX_NET_DEVICES): shared memory between
// processes of one host (sysv/posix/cma), TCP, or RDMA verbs where such hardware exists (verbs are
// compiled into Debian's UCX but untested here). Error mode NONE, because PEER mode disables
// UCX's shared-memory transports (platform-notes §2).

#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace baton::transport {

struct ucx_config {
  std::string name;          ///< this endpoint's rank name, for errors
  /// How long the progress thread sleeps when idle, unless UCX's wakeup fd or a command wakes it.
  /// Puts into ordinary memory over shared memory once needed the target's progress to complete
  /// a peer's flush without signalling that fd (a 1 ms wait was chosen for them); the targets
  /// Baton puts into now complete without it (the same handoff and TTFT at 1 ms and 100 ms,
  /// docs/perf.md), and every wakeup costs a core ~25 us on a VM: 20 ms bounds what a path
  /// still needing it could lose, at 1/20 of the idle cost.
  uint32_t idle_wait_ms = 20;
  /// How a put's bytes travel:
  ///   "put": one-sided RMA puts, then a flush (shared memory, RDMA);
  ///   "am":  active messages forced to rendezvous: the target's progress thread receives each
  ///          segment straight into the registered region at its offset, and the send completes
  ///          once the data is there. For TCP, where UCX's RMA emulation is very slow
  ///          (platform-notes §2). Every endpoint receives either kind; the sender chooses.
  std::string send = "put";
  /// How long a peer's unpacked memory key is kept unused before it is dropped (and unpacked
  /// again on the next put, for a few microseconds). Over shared memory an unpacked key holds the
  /// peer's segment attached: a KV pool of gigabytes that outlives its process (a rank that died
  /// or restarted under a new address) for as long as the key is kept.
  uint32_t key_idle_ms = 60'000;
  /// At most this many keys per peer are kept; past it the least recently used one with nothing
  /// in flight is dropped at once. Keys behind a map_remote pointer are never dropped (the
  /// pointer must stay valid). Endpoints are kept (a few kilobytes each): UCX pairs the two
  /// workers' endpoints, so closing ours would also cut the peer's puts to us.
  uint32_t max_keys_per_peer = 16;

  std::string validate() const {
    if (name.empty()) return "ucx transport needs a rank name";
    if (send != "put" && send != "am") return "ucx send mode must be put or am, not " + send;
    if (max_keys_per_peer == 0) return "ucx max_keys_per_peer must be at least 1";
    return {};
  }
};

/// Creates a UCX endpoint, or nothing with `*why` saying what UCX refused.
std::unique_ptr<transport> make_ucx_transport(const ucx_config& cfg, std::string* why);

}  // namespace baton::transport
