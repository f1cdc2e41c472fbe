#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace baton::transport {

/// The regions of one process, shared by every loopback endpoint in it: the in-process
/// "network". Ranks in one process each get an endpoint on the same fabric.
class loopback_fabric;

std::shared_ptr<loopback_fabric> make_loopback_fabric();

/// An in-process backend that really copies bytes (memcpy) from the local region into the
/// peer's region; puts complete during post.
std::unique_ptr<transport> make_loopback_transport(std::shared_ptr<loopback_fabric> fabric, std::string name);
/// Virtual time for the modelled link (sims): every endpoint has one NIC, a FIFO queue shared by
/// its puts in and out, so concurrent transfers slow each other down. A put starts when both the
/// sender's and the receiver's NIC are free and takes latency + modelled bytes / bandwidth.
struct link_timing {
  std::function<int64_t()> now_ns;  ///< the owner's (virtual) clock
  double gbps = 50.0;               ///< one NIC, GB/s (1e9 B/s)
  double bytes_scale = 1.0;         ///< modelled bytes per byte the put names (carrier KV -> real KV)
  int64_t latency_ns = 5000;        ///< per put
  std::map<std::string, int64_t> nic_free_ns;  ///< by endpoint name: when its queue drains
  /// Endpoints whose NICs differ from `gbps` (a decode instance of another width, a degraded
  /// link from a fault's virtual time on): their GB/s. A put moves at its slower end's rate.
  std::map<std::string, double> endpoint_gbps;
  uint64_t modelled_bytes = 0;                 ///< every put's modelled bytes, summed
  /// Guards the queues and counters above: every rank's link shares this one object, and each
  /// link's own lock does not cover another's puts.
  std::mutex mutex;
};

/// The same, but a put is checked (regions, bounds) and completes without copying a byte: the
/// link of sims whose modelled executors write no KV (copying it would be most of their time).
/// With `timing`, a put stays pending until its modelled completion time; without, it is done at
/// once.
std::unique_ptr<transport> make_modelled_link(std::shared_ptr<loopback_fabric> fabric, std::string name,
                                              std::shared_ptr<link_timing> timing = nullptr);

}  // namespace baton::transport
