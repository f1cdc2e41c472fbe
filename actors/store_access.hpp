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
  uint32_t write_slot_timeout_ms = 5000;  ///< store_config::write_slot_timeout_ms
  uint64_t max_pending_write_bytes = 64ull << 20;
  store::retention_policy retention;
  /// No block servers, only each prefill rank's own tier of prompt blocks (sims: the store's
  /// disks are not modelled yet, the ranks' local prefix caches are real).
  bool local_tier_only = false;

  bool enabled() const { return !index.empty() && !servers.empty(); }
  /// Prompts are cut into keyed blocks (for a store, or only for the ranks' local tiers).
  bool keyed() const { return enabled() || local_tier_only; }
  uint32_t block_tokens() const { return identity.block_tokens; }

  store_info to_info() const {
    return {index, servers, identity.model_id, identity.num_layers, identity.kv_dim, identity.block_tokens,
            identity.page_tokens, identity.dtype, replicas, read_timeout_ms, write_slot_timeout_ms, max_pending_write_bytes,
            retention.chat_ttl_s, retention.agent_ttl_s, retention.batch_ttl_s};
  }
  static store_access from_info(const store_info& i) {
    store_access a;
    a.index = i.index;
    a.servers = i.servers;
    a.identity = {i.model_id, i.num_layers, i.kv_dim, i.block_tokens, i.page_tokens, i.dtype};
    a.replicas = i.replicas;
    a.read_timeout_ms = i.read_timeout_ms;
    a.write_slot_timeout_ms = i.write_slot_timeout_ms;
    a.max_pending_write_bytes = i.max_pending_write_bytes;
    a.retention = {i.chat_ttl_s, i.agent_ttl_s, i.batch_ttl_s};
    // Keyed, with no servers: the cluster keys prompts for the ranks' own tiers alone.
    a.local_tier_only = a.index.empty() && i.block_tokens > 0;
    return a;
  }
};

}  // namespace baton
