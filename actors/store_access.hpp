#pragma once

// What the request, prefill and decode actors need to use the block store: the index, the
// servers, and how keys are made. Default-constructed (no index): the store is off.

#include <vector>

#include "actors/messages.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"

namespace baton {

struct store_access {
  std::vector<block_index_actor> index;     ///< the index shards (store::block_key -> shard_of)
  std::vector<block_server_actor> servers;  ///< index = server id
  store::kv_identity identity;              ///< identity.block_tokens is B
  uint32_t replicas = 1;
  uint32_t read_timeout_ms = 5000;
  uint64_t max_pending_write_bytes = 64ull << 20;
  store::retention_policy retention;

  bool enabled() const { return !index.empty() && !servers.empty(); }
  uint32_t block_tokens() const { return identity.block_tokens; }
};

}  // namespace baton
