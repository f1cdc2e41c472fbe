#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <caf/expected.hpp>

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// Reaches a store node's host again (blocking: the keeper calls it on a thread of its own).
/// The argument is the node's place in local_cluster_config::remote_store_hosts.
using store_host_connector = std::function<caf::expected<store_host_actor>(size_t node)>;

struct store_keeper_config {
  store_host_connector reconnect;
  uint32_t retry_interval_ms = 1000;  ///< store_config::readopt_interval_ms
  uint32_t adopt_timeout_ms = 10000;  ///< an adoption not answered by then is tried again
  /// Each adopted server is asked for its stats this often (one probe in flight at a time); one
  /// that leaves a probe unanswered for missed_probes intervals is given up as if it were down
  /// (its node hung, or cut off while TCP has not yet noticed): the index stops naming it, ranks
  /// stop reading from and writing to it, and it is adopted again as soon as its host answers.
  /// 0: no probes.
  uint32_t probe_interval_ms = 1000;   ///< store_config::probe_interval_ms
  uint32_t missed_probes = 3;          ///< store_config::missed_probes
  /// One line per event (a node lost, adopted again); null: silent (tests).
  std::function<void(const std::string&)> log;
};

/// A store node the head adopted: what it was asked to serve, and the server it started.
struct kept_store_node {
  std::string name;        ///< "store node <i>" in log lines
  store_adoption adoption;  ///< server id, index shards, KV identity: asked again as it was
  block_server_actor server;
};

using store_keeper_actor = caf::typed_actor<caf::reacts_to<timer_atom, uint64_t>,  // try node i again (internal)
                                            caf::reacts_to<poll_atom>,              // probe the servers (internal)
                                            caf::reacts_to<adopt_atom, uint64_t, store_host_actor>,  // node i answers (internal)
                                            caf::reacts_to<adopt_atom, uint64_t, std::string>>;  // or not: why (internal)

/// The head's keeper of its store nodes (`baton node --role store`): when one's block server goes
/// down (the process died, or the link to it broke) or stops answering its probes (the process
/// hangs, or the network drops its packets), it reconnects to the node's host every
/// retry_interval_ms and adopts it again under the same server id. The new server commits what
/// the node's disk holds as it starts; the index shards learn its actor (adopt_atom), and ranks
/// ask them for it (store_watch.hpp). Meanwhile the cluster serves without that server's blocks:
/// prefixes there are computed again, write-backs go to the next live servers.
store_keeper_actor spawn_store_keeper(caf::actor_system& sys, store_keeper_config cfg, std::vector<kept_store_node> nodes);

}  // namespace baton
