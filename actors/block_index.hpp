#pragma once

#include <vector>

#include "actors/messages.hpp"
#include "store/block_index.hpp"

namespace caf {
class actor_system;
}

namespace baton {

struct block_index_config {
  uint64_t capacity_blocks = 0;  ///< 0 = unbounded
  store::retention_policy retention;
  uint32_t housekeeping_interval_ms = 60000;
};

/// The store's index (seed 000 §2.2): answers CHECK with the longest cached prefix of a key
/// chain and where its blocks live (metadata only, no KV bytes); learns blocks from the block
/// servers' commits; expires blocks by retention class and evicts leaf-first LRU beyond capacity
/// on a timer (the actor clock: virtual time in sims), telling the servers to delete the files.
/// `servers` receive the deletes (index i = server id i).
block_index_actor spawn_block_index(caf::actor_system& sys, block_index_config cfg,
                                    std::vector<block_server_actor> servers);

}  // namespace baton
