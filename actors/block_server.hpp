#pragma once

#include <memory>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "store/block_key.hpp"

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
};

/// A 3FS-style block server (seed 000 §2.2): owns a directory of block files. Reads put every
/// layer of the requested blocks, layer-major, into the reader's registered KV pages through the
/// transport, and answer with each block's header checksums (the reader verifies its pages) or
/// why a block could not be served. Writes store a block file and commit it to the index. All
/// file I/O runs on the server's own I/O thread; the actor never blocks.
block_server_actor spawn_block_server(caf::actor_system& sys, block_server_config cfg,
                                      std::shared_ptr<transport::transport> xport,
                                      std::vector<block_index_actor> index_shards);

}  // namespace baton
