#pragma once

#include <functional>
#include <memory>
#include <string>

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}
namespace baton::transport {
class transport;
}

namespace baton {

struct store_host_config {
  std::string name = "store";  ///< the node's name; its server is <name> in reads and errors
  std::string dir;             ///< server i keeps its files in <dir>/server-<i>
  /// Fault injection for tests (a slow disk): each layer of a read waits this long first. 0 = off.
  uint32_t fault_layer_delay_ms = 0;
  /// The node's disk budget (`--store-capacity-gib`), its server's block_server_config::capacity_bytes.
  /// An adoption whose blocks cannot fit it even once is refused. 0 = unbounded.
  uint64_t capacity_bytes = 0;
};

/// Makes the transport of the adopted block server (UCX in a store node).
using store_transport_factory =
    std::function<std::shared_ptr<transport::transport>(const std::string& name, std::string* why)>;

/// A store node's front (`baton node --role store`): when the head adopts it, it starts the block
/// server the head asked for, in this process and on this node's disk, and answers with its
/// handle. A second adoption (the head restarted, or it lost its link to this node and adopts
/// it again) replaces the server once the old one has stopped: the index forgot the old
/// server's blocks, and the new one commits what the disk holds as it starts. The host stops
/// its server when it stops.
store_host_actor spawn_store_host(caf::actor_system& sys, store_host_config cfg, store_transport_factory make_transport);

}  // namespace baton
