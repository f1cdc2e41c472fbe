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
  /// A block a restarting server finds on disk is kept this many housekeeping intervals at least
  /// (10 minutes by default), unserved if its retention ran out: the other servers' scans, which
  /// may hold descendants that keep it alive, come in meanwhile (store::block_index::upsert). In
  /// intervals because only housekeeping removes it, so tests that shorten one shorten both.
  uint32_t recovery_hold_intervals = 10;
};

/// One shard of the store's index (seed 000 §2.2; keys are sharded by `shard_of`): answers CHECK
/// with where each asked block lives, if anywhere (metadata only, no KV bytes); learns blocks from the block
/// servers' commits; expires blocks by retention class and evicts leaf-first LRU beyond capacity
/// on a timer (the actor clock: virtual time in sims), telling the servers to delete the files;
/// forgets the copies a server deleted itself to stay within its disk's capacity.
/// `servers` receive the deletes (index i = server id i).
/// The index shard that owns `key` among `num_shards`.
inline uint32_t shard_of(const store::block_key& key, uint32_t num_shards) {
  return num_shards <= 1 ? 0 : static_cast<uint32_t>(key.hi % num_shards);
}

block_index_actor spawn_block_index(caf::actor_system& sys, block_index_config cfg,
                                    std::vector<block_server_actor> servers);

}  // namespace baton
