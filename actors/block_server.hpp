#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <caf/expected.hpp>

#include "actors/messages.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"
#include "store/staging_pool.hpp"
#include "transport/transport.hpp"

namespace caf {
class actor_system;
}
namespace baton::transport {
class transport;
}

namespace baton {

struct block_server_config {
  uint32_t server_id = 0;   ///< its index in the cluster's list of block servers
  std::string name = "store-0";
  std::string dir;          ///< where its block files live
  store::kv_identity identity;
  uint64_t staging_bytes = 64ull << 20;
  /// Fault injection for tests (a slow disk): each layer of a read waits this long first. 0 = off.
  uint32_t fault_layer_delay_ms = 0;
  /// Its directory's disk budget: its block files, each counted at store::block_disk_bytes, never
  /// take more. Before a block is written the least recently used ones (written or read; leaf-first,
  /// as the index orders them) are deleted to make room, and the index is told. 0 = unbounded.
  uint64_t capacity_bytes = 0;
  /// Fault injection for tests (a full or failing disk): after fault_write_after block file
  /// writes, the next fault_write_failures fail with errno fault_write_errno (ENOSPC, EIO) after
  /// their header is written. 0 = off.
  int fault_write_errno = 0;
  uint32_t fault_write_failures = 0;
  uint32_t fault_write_after = 0;
  /// A write slot whose write order has not come this long after it was granted is taken back:
  /// a writer that died, or whose put failed without a word, must not hold staging for good.
  uint32_t write_slot_ttl_ms = 30000;
  /// One put of a read is given up after this long (at most store_put_limit_ms, which readers
  /// count on; tests shorten it).
  uint32_t put_limit_ms = store_put_limit_ms;
  /// The index's retention: blocks found on disk at start keep their chains alive by it
  /// (store::keep_chains_alive) before they are committed.
  store::retention_policy retention{};
};

/// A block server's write slots: ranges of its registered write staging handed to writers for
/// their one-sided puts (write step 1), found again by id when the write order comes (step 2).
/// Shared by the real server and the sims' modelled one.
class write_slot_table {
public:
  /// Owns `bytes` of staging registered as `key` (empty: registration failed).
  void reset(uint64_t bytes, std::optional<transport::region_key> key) {
    pool_ = store::staging_pool{bytes};
    key_ = std::move(key);
  }
  /// A slot for `b`, or why not (naming the request and `server`): the server could not set up
  /// (`setup_error`), or its staging is full.
  caf::expected<store_write_slot> grant(const store_write_begin& b, const std::string& server,
                                        const std::string& setup_error);
  /// Where a granted slot lies in the staging.
  struct range {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  /// The slot's range, if granted and not yet released.
  std::optional<range> find(uint64_t slot_id) const;
  /// The same, and the slot is being written from now on: reclaim() leaves it alone.
  std::optional<range> claim(uint64_t slot_id);
  void release(uint64_t slot_id);
  /// Releases a slot that no write order has claimed; false when there is none such.
  bool reclaim(uint64_t slot_id);

private:
  struct slot {
    range at;
    bool writing = false;
  };
  store::staging_pool pool_{0};
  std::optional<transport::region_key> key_;
  std::unordered_map<uint64_t, slot> slots_;
  uint64_t last_ = 0;
};

/// A 3FS-style block server (seed 000 §2.2): owns a directory of block files. Reads put every
/// layer of the requested blocks, layer-major, into the reader's registered KV pages through the
/// transport, and answer with each block's header checksums (the reader verifies its pages) or
/// why a block could not be served. Writes store a block file and commit it to the index. All
/// file I/O runs on the server's own I/O thread, one job after another; the actor never blocks.
/// So a block is never deleted (by the index, or for capacity_bytes) while a read of it runs, and
/// a file once deleted is never reused: a new write of the key is a new file renamed into place.
block_server_actor spawn_block_server(caf::actor_system& sys, block_server_config cfg,
                                      std::shared_ptr<transport::transport> xport,
                                      std::vector<block_index_actor> index_shards);

}  // namespace baton
