#pragma once

// The block store's messages (store/, design.md §2): reads into a rank's pages, write slots and
// orders, commits to the index, and the handles of its actors. A part of actors/messages.hpp
// (which includes it), registered with the rest (actors/message_types.cpp).

#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include "actors/atoms_and_errors.hpp"
#include "actors/kv_region.hpp"
#include "actors/wire_float.hpp"

namespace baton {

/// A KV block of the store: its 128-bit key and the block servers holding a copy.
struct block_ref {
  uint64_t hi = 0;
  uint64_t lo = 0;
  std::vector<uint32_t> servers;  ///< indexes into the cluster's block servers, primary first
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, block_ref& x) {
  return f(caf::meta::type_name("block_ref"), x.hi, x.lo, x.servers);
}

/// Reader -> block server: put these blocks, every layer, into my KV pages.
struct store_read_order {
  uint64_t request_id = 0;
  std::vector<block_ref> blocks;       ///< blocks this server holds
  std::vector<uint32_t> block_index;   ///< each block's position in the prompt (block i = tokens [iB, (i+1)B))
  uint32_t block_tokens = 0;
  kv_region_desc region;               ///< the reader's KV pool
  std::vector<uint32_t> page_ids;      ///< the reader's pages for the whole prompt
  std::string reader;                  ///< for error messages and the transport's peer name
  caf::actor reader_actor;             ///< told store_layer_landed after each layer (may be null)
  /// The server starts no put for this order later than this after it took the order (0: no
  /// limit). The reader waits read_timeout_ms; half of it here leaves the other half for the
  /// last put and the answer, so that no put lands after the reader stopped waiting.
  uint32_t budget_ms = 0;
  /// The reader's name for this read, echoed in store_layer_landed: a request placed on the same
  /// rank again reads again, and a late notice of the earlier read must not count for the new one
  /// (a prefill rank uses the attempt's lease id).
  uint64_t tag = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_read_order& x) {
  return f(caf::meta::type_name("store_read_order"), x.request_id, x.blocks, x.block_index, x.block_tokens, x.region,
           x.page_ids, x.reader, x.reader_actor, x.budget_ms, x.tag);
}

/// A block server gives up one put of a read after this long. With the order's budget, it bounds
/// how long after a read's deadline a put of it can still land: a reader that stopped waiting
/// keeps the pages it named that much longer (read_timeout_ms + this) before reusing them.
inline constexpr uint32_t store_put_limit_ms = 10000;
/// A writer gives up waiting for a block server's answer to a write order after this long (the
/// server writes one block file: seconds even on a slow disk).
inline constexpr uint32_t store_write_order_timeout_ms = 60000;

/// Block server -> reader, while a read streams: layer `layer` of these blocks has landed in the
/// reader's pages (the pipeline of seed 000 §2.3: the reader computes layer l meanwhile).
struct store_layer_landed {
  uint64_t request_id = 0;
  uint32_t layer = 0;
  std::vector<uint32_t> block_index;  ///< blocks whose layer landed
  std::vector<uint64_t> checksums;    ///< their header checksum of this layer
  uint64_t tag = 0;                   ///< the read order's tag
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_layer_landed& x) {
  return f(caf::meta::type_name("store_layer_landed"), x.request_id, x.layer, x.block_index, x.checksums, x.tag);
}

/// Block server -> reader: what landed. Per block (in the order's order): an empty error and its
/// per-layer checksums from the block's header (the reader verifies its pages against them), or
/// the reason it could not be read (missing, corrupt, other model, transfer failed).
struct store_read_result {
  uint64_t request_id = 0;
  std::vector<uint32_t> block_index;
  std::vector<std::string> errors;
  std::vector<std::vector<uint64_t>> checksums;
  /// The server gave up on a put of this read still in flight (store_put_limit_ms, or it was
  /// stopping): its bytes may land later, so the reader holds the pages as if unanswered.
  bool puts_abandoned = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_read_result& x) {
  return f(caf::meta::type_name("store_read_result"), x.request_id, x.block_index, x.errors, x.checksums,
           x.puts_abandoned);
}

/// Writer -> block server: reserve room in your registered write staging for one block.
struct store_write_begin {
  uint64_t request_id = 0;
  uint64_t bytes = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_write_begin& x) {
  return f(caf::meta::type_name("store_write_begin"), x.request_id, x.bytes);
}

/// Block server -> writer: put the block's bytes at `offset` of `region` (its write staging).
struct store_write_slot {
  uint64_t slot_id = 0;
  uint64_t offset = 0;
  kv_region_desc region;  ///< only backend, region_id, size_bytes, packed_key are used
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_write_slot& x) {
  return f(caf::meta::type_name("store_write_slot"), x.slot_id, x.offset, x.region);
}

/// Writer -> block server: the block's KV, layer-major, has landed in slot `slot_id`; write it.
struct store_write_order {
  uint64_t request_id = 0;
  uint64_t slot_id = 0;
  uint64_t bytes = 0;     ///< num_layers × layer bytes
  block_ref block;
  uint64_t parent_hi = 0, parent_lo = 0;
  std::string retention;  ///< chat | agent
  uint32_t block_tokens = 0;
  uint32_t page_tokens = 0;
  uint32_t kv_dim = 0;
  std::vector<uint64_t> checksums;  ///< per layer
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_write_order& x) {
  return f(caf::meta::type_name("store_write_order"), x.request_id, x.slot_id, x.bytes, x.block, x.parent_hi,
           x.parent_lo, x.retention, x.block_tokens, x.page_tokens, x.kv_dim, x.checksums);
}

/// Block server -> index: a block is on disk.
struct block_commit {
  block_ref block;  ///< servers = {this server}
  uint64_t parent_hi = 0, parent_lo = 0;
  std::string retention;
  uint64_t size_bytes = 0;
  /// 0 for a block just written; for one a restarted server found on disk, how long ago it was
  /// written: its retention counts from then, not from the restart.
  uint64_t age_ms = 0;
  /// Which write of the block on this server it was (the server's counter, which starts at its
  /// process's start time in ns; that start for a block found on disk). A delete names it, so
  /// that it never removes a later write of the same key.
  uint64_t write_seq = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, block_commit& x) {
  return f(caf::meta::type_name("block_commit"), x.block, x.parent_hi, x.parent_lo, x.retention, x.size_bytes,
           x.age_ms, x.write_seq);
}

/// The most commits one message carries (a server's recovery; block_index_actor).
inline constexpr size_t commit_batch_blocks = 1024;

/// Counters of the store's actors (index and servers fill their own fields).
struct store_stats {
  uint64_t blocks = 0;           ///< index: blocks known
  uint64_t checks = 0;           ///< index: CHECK queries answered
  uint64_t hit_blocks = 0;       ///< index: blocks found by CHECK
  uint64_t evicted = 0;          ///< index: blocks evicted for capacity
  uint64_t expired = 0;          ///< index: blocks expired by retention class
  uint64_t blocks_written = 0;   ///< server: block files written
  uint64_t blocks_read = 0;      ///< server: blocks put to readers
  uint64_t read_failures = 0;    ///< server: blocks it could not serve (missing, corrupt, ...)
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t write_failures = 0;   ///< server: blocks not written (a layer off its checksum, the disk)
  uint64_t slots_reclaimed = 0;  ///< server: write slots given back unused (a failed put, a silent writer)
  uint64_t blocks_recovered = 0; ///< server: blocks of this model found on disk at start, committed again
  uint64_t files_removed = 0;    ///< server: unreadable block files and stale temporary files deleted at start
  uint64_t disk_bytes = 0;       ///< server: what its block files take (store::block_disk_bytes each), now
  uint64_t disk_evicted = 0;     ///< server: block files it deleted to stay within its capacity_bytes
  uint64_t write_no_space = 0;   ///< server: of write_failures, those the disk refused for room (ENOSPC, EDQUOT)
  uint64_t damaged_dropped = 0;  ///< server: of read_failures, damaged block files it deleted (and logged)
  /// server: 1 while it refuses every read (staging buffers wait on given-up puts, or it has no
  /// read staging), as of its last read: the router leaves it out of cluster_stats::store_servers_up.
  uint64_t refusing_reads = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_stats& x) {
  return f(caf::meta::type_name("store_stats"), x.blocks, x.checks, x.hit_blocks, x.evicted, x.expired,
           x.blocks_written, x.blocks_read, x.read_failures, x.bytes_read, x.bytes_written, x.write_failures,
           x.slots_reclaimed, x.blocks_recovered, x.files_removed, x.disk_bytes, x.disk_evicted, x.write_no_space,
           x.damaged_dropped, x.refusing_reads);
}

using block_server_actor = caf::typed_actor<
    caf::replies_to<store_read_order>::with<store_read_result>,
    caf::replies_to<store_write_begin>::with<store_write_slot>,  // write step 1: where to put it
    caf::replies_to<store_write_order>::with<uint64_t>,         // step 2 (after the put): bytes written (0: failed)
    caf::reacts_to<release_atom, uint64_t>,                     // or: the writer's put failed, the slot back
    caf::reacts_to<expire_atom, uint64_t>,                      // a slot's time is up (internal)
    caf::reacts_to<delete_atom, uint64_t, uint64_t, uint64_t>,  // key hi, lo, write_seq: evicted or expired
    caf::reacts_to<touch_atom, std::vector<uint64_t>>,          // keys (hi, lo, ...) CHECK hit, leading first
    caf::replies_to<stats_atom>::with<store_stats>,
    caf::reacts_to<io_atom, uint64_t>>;                         // an I/O job finished (internal)

/// Answers CHECK with metadata only; keeps retention and capacity in the background.
using block_index_actor = caf::typed_actor<
    // request id, keys -> the same keys, each with the servers holding it (none: absent)
    caf::replies_to<check_atom, uint64_t, std::vector<block_ref>>::with<std::vector<block_ref>>,
    // Blocks written (one), or found on disk by a server that starts (batches of up to
    // commit_batch_blocks: a disk of a million blocks is a few hundred messages, not a million,
    // and a probe behind them on the same link is answered in time).
    caf::reacts_to<commit_atom, std::vector<block_commit>>,
    // server id, key hi, lo, write_seq: that server deleted its copy to stay within its disk's capacity
    caf::reacts_to<delete_atom, uint32_t, uint64_t, uint64_t, uint64_t>,
    caf::reacts_to<timer_atom, uint64_t>,                       // housekeeping tick (internal)
    caf::reacts_to<std::vector<block_server_actor>>,            // the block servers (index = server id)
    // A store node that went down was adopted again (store_keeper): server id, its new actor.
    caf::reacts_to<adopt_atom, uint32_t, block_server_actor>,
    // The keeper gave up on server id's actor: it answered no probe (a store node hung, or cut
    // off while its TCP link lingers). Down as if its process had died, until adopted again.
    caf::reacts_to<lost_atom, uint32_t, block_server_actor>,
    caf::replies_to<servers_atom>::with<std::vector<block_server_actor>>,  // the servers now
    // A watch on server id: the generation of it the asker has (0: as the cluster started) and
    // whether it knows it down -> its actor, generation and whether it is down, answered once
    // either differs from what the asker knows (at once if it already does): how ranks in any
    // process learn that a store node went down, and that it came back adopted again. (A
    // generation, not the asker's old actor: a handle to a process that is gone is not sent
    // across the network again.)
    caf::replies_to<servers_atom, uint32_t, uint64_t, bool>::with<block_server_actor, uint64_t, bool>,
    caf::replies_to<stats_atom>::with<store_stats>>;

/// How to use the cluster's block store, for ranks that join from other processes (`baton node`
/// asks the decode balancer for it). No index: the store is off.
struct store_info {
  std::vector<block_index_actor> index;
  std::vector<block_server_actor> servers;
  std::string model_id;
  uint32_t num_layers = 0, kv_dim = 0, block_tokens = 0, page_tokens = 0;
  std::string dtype;
  uint32_t replicas = 1;
  uint32_t read_timeout_ms = 5000;
  uint32_t write_slot_timeout_ms = 5000;
  uint64_t max_pending_write_bytes = 0;
  double chat_ttl_s = 0, agent_ttl_s = 0, batch_ttl_s = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_info& x) {
  return f(caf::meta::type_name("store_info"), x.index, x.servers, x.model_id, x.num_layers, x.kv_dim,
           x.block_tokens, x.page_tokens, x.dtype, x.replicas, x.read_timeout_ms, x.write_slot_timeout_ms,
           x.max_pending_write_bytes,
           wire::f64{&x.chat_ttl_s}, wire::f64{&x.agent_ttl_s}, wire::f64{&x.batch_ttl_s});
}

/// The head -> a store node (`baton node --role store`): serve the cluster's blocks as server
/// `server_id`, committing to these index shards, for KV of this identity.
struct store_adoption {
  uint32_t server_id = 0;
  std::vector<block_index_actor> index;
  std::string model_id;
  uint32_t num_layers = 0, kv_dim = 0, block_tokens = 0, page_tokens = 0;
  std::string dtype;
  uint64_t staging_bytes = 0;
  double chat_ttl_s = 7 * 86400.0, agent_ttl_s = 3 * 86400.0, batch_ttl_s = 0.0;  ///< the index's retention (keep_chains_alive)
  /// One block's KV bytes (every layer, no header): the node refuses a capacity that cannot hold
  /// one block file. 0: not checked.
  uint64_t block_bytes = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, store_adoption& x) {
  return f(caf::meta::type_name("store_adoption"), x.server_id, x.index, x.model_id, x.num_layers, x.kv_dim,
           x.block_tokens, x.page_tokens, x.dtype, x.staging_bytes, wire::f64{&x.chat_ttl_s},
           wire::f64{&x.agent_ttl_s}, wire::f64{&x.batch_ttl_s}, x.block_bytes);
}

/// A store node's front: the head adopts its block server, which then lives in the store
/// node's process, with its files on that node's disk (3FS-style storage servers).
using store_host_actor = caf::typed_actor<caf::replies_to<adopt_atom, store_adoption>::with<block_server_actor>>;

}  // namespace baton
