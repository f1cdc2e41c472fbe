#pragma once

#include <functional>
#include <vector>

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// The actors a node process runs, as its agent started them.
struct node_actors {
  node_ranks ranks;               ///< drained before the node leaves
  std::vector<caf::actor> others;  ///< stopped when the node leaves (block servers, gateways)
};

/// Starts the node's actors from what the directory told it; an empty string, or why not.
using node_start = std::function<std::string(caf::actor_system&, const cluster_welcome&, node_actors*)>;

struct node_agent_config {
  node_hello hello;
  uint32_t join_timeout_ms = 10000;
  uint32_t drain_timeout_ms = 60000;  ///< a drain that takes longer stops the node anyway
  uint32_t drain_poll_ms = 50;
  /// Called on the agent's thread when the directory says members of a data-parallel group this
  /// node belongs to were lost with their node (group, member indices, why, false), or came back
  /// to a group that had shrunk without them (..., true); unset: ignored.
  std::function<void(const std::string&, const std::vector<uint32_t>&, const std::string&, bool)> on_member_gone;
  /// Called on the agent's thread when the head's directory went away, after the node's actors
  /// were told to stop and before the agent ends (its exit reason then says so too).
  std::function<void()> on_head_lost;
  /// Called on the agent's thread when the directory says a newer process (this pid) took the
  /// node's name, after the node's actors were told to stop and before the agent ends.
  std::function<void(int32_t)> on_replaced;
};

/// A node process's agent (design.md §1):
///
///   joining --welcome: start the node's actors (heartbeating meanwhile)--> serving --drain--> draining --idle--> gone
///      |                                             |                   (or drain timeout)
///      +--no answer / start failed--> gone           +--directory down--> gone
///
/// Draining tells the directory and the balancers (no new placements on the node's ranks), waits
/// until the ranks hold no prompt, sequence, lease or write-back in flight, then stops them and
/// itself. Its exit reason says why it ended (normal after a drain).
node_agent_actor spawn_node_agent(caf::actor_system& sys, node_directory_actor directory, node_agent_config cfg,
                                  node_start start);

}  // namespace baton
