#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <cstdint>
#include <string>

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

struct node_directory_config {
  uint32_t heartbeat_interval_ms = 500;  ///< told to every joining node
  uint32_t missed_heartbeats = 4;        ///< a node silent this many intervals counts as gone
  /// The head's model (model_fingerprint): a node that says another is refused at its join.
  /// Empty: not checked.
  std::string model;
  /// The head's weights (weights_identity) and KV page size: a node that says others is refused
  /// at its join too. Empty / 0: not checked.
  std::string weights;
  uint32_t page_tokens = 0;
  /// One line per change an on-call engineer wants in the head's log: a node joined, was given
  /// up (its process went down, it missed its heartbeats, a new process took its name), came
  /// back. Null: silent (tests, sims).
  std::function<void(const std::string&)> log;
  std::string validate() const {
    if (heartbeat_interval_ms == 0 || missed_heartbeats == 0)
      return "node directory: heartbeat_interval_ms and missed_heartbeats must be >= 1";
    return {};
  }
};

/// The head's register of node processes (`baton node`, `baton gateway`): a node's agent joins
/// with its name and roles and gets what it needs to start its actors (`welcome`); it then
/// heartbeats. A node whose agent goes down, or misses heartbeats, is marked gone; one that
/// announces a drain is marked draining until it leaves. `baton launch` reads the register to
/// know when every node has joined.
node_directory_actor spawn_node_directory(caf::actor_system& sys, node_directory_config cfg, cluster_welcome welcome);

/// Blocks (a tool's thread, never an actor's) until none of `names` is in the directory's
/// register other than as gone -- each drained and left, or was given up on -- or until `budget`
/// has passed; returns those still there (empty: all gone). A directory that does not answer
/// counts as every node gone (the head itself is going).
std::vector<std::string> wait_nodes_gone(caf::actor_system& sys, const node_directory_actor& directory,
                                         std::vector<std::string> names, std::chrono::milliseconds budget);

}  // namespace baton
