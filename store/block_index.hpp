#pragma once

// The store's metadata (seed 000 §2.2): which blocks exist, where, until when, and in which LRU
// order. Pure and single-owner (the block_index actor, a trace replay, or a block server ordering
// its own files for its disk's capacity): time is passed in.
//
// Eviction is leaf-first LRU: a prefix's leading blocks are always more recently used than its
// tail, so a chain is evicted from its leaves (traces/README.md §1 gives the same
// semantics and reference ratios). A hit touches the chain last block first; a block inserted
// goes right behind its parent when the parent is in this index (a write-back commits first
// block first). Likewise a block's ancestors expire no earlier than it does. Both hold within one
// index: with several index shards, a chain's blocks spread over them and each shard keeps its
// own order.
//
// After a restart the index is filled again by the block servers, each from its own directory,
// in whatever order their scans finish; the ring spreads a chain's blocks over the servers. So a
// block found on disk (an upsert with a hold) is not removed before its hold ends even if its
// retention ran out, and a parent that arrives after its descendants starts from their expiry:
// an old root that younger blocks on other servers continue is kept, as the live index kept it.

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/block_file.hpp"
#include "store/block_key.hpp"

namespace baton::store {

/// Retention classes of design.md §2: chat kept 7 days, agent 3 days, batch not stored.
enum class retention : uint8_t { chat = 0, agent = 1, batch = 2 };
std::optional<retention> parse_retention(const std::string& name);
std::string to_string(retention r);

struct retention_policy {
  double chat_ttl_s = 7 * 86400.0;
  double agent_ttl_s = 3 * 86400.0;
  double batch_ttl_s = 0.0;  ///< 0: the class is not written back at all
  double ttl_s(retention r) const;
};

/// For blocks a restarted server found on disk (scan_block_dir), what the live index does for
/// chains (block_index::extend_ancestors): each block takes the retention class and age of
/// whichever of itself and its descendants among `blocks` lives longest under `policy`. An old
/// block that starts many prompts -- a system prompt written weeks ago, read ever since -- is
/// otherwise expired at the restart by its own write time, and deleted, which cuts off every
/// younger block after it.
void keep_chains_alive(std::vector<found_block>& blocks, const retention_policy& policy);

struct block_meta {
  block_key key;
  block_key parent;               ///< empty for a prompt's first block
  std::vector<uint32_t> servers;  ///< block servers holding a copy (replicas), primary first
  uint64_t size_bytes = 0;
  retention cls = retention::chat;
  double expires_at_s = 0.0;
  double last_access_s = 0.0;
  /// Parallel to servers: the write of the copy each holds (block_commit::write_seq), which a
  /// delete names so that a server keeps a later write of the key that the index has not heard of.
  std::vector<uint64_t> write_seqs{};
};

class block_index {
 public:
  /// capacity_blocks = 0: unbounded.
  explicit block_index(uint64_t capacity_blocks = 0) : capacity_(capacity_blocks) {}

  /// How many leading keys are present and unexpired at now_s (CHECK). Touches nothing.
  size_t longest_prefix(const std::vector<block_key>& keys, double now_s) const;
  const block_meta* find(const block_key& key) const;
  /// Inserts, or refreshes an existing block: it becomes most recently used (behind its parent,
  /// when that is here), its expiry the later of the two (its ancestors' at least as late), its
  /// servers the union.
  ///
  /// `hold_until_s` > 0: the block was found on disk by a restarting server (block_commit::age_ms),
  /// and other servers may still be scanning theirs until then. Until then the block is not
  /// removed even once expired -- an expired one is not served (its expires_at_s is past, so a
  /// CHECK misses it) and is the first evicted -- so that a descendant committed meanwhile can
  /// extend it; and a parent that is not here yet and comes meanwhile starts from the expiry of
  /// the descendants it has here.
  void upsert(block_meta meta, double now_s, double hold_until_s = 0.0);
  /// Marks `keys` used, last one first (a read hit).
  void touch_chain(const std::vector<block_key>& keys, double now_s);
  void erase(const block_key& key);
  /// Evicts least recently used blocks until at most capacity remain, and (with a byte capacity)
  /// until their size_bytes fit it; returns them.
  std::vector<block_meta> evict_to_capacity();
  /// Room for a block of `incoming_bytes` about to be written as `key` under the byte capacity:
  /// least recently used blocks are evicted until the blocks here and the incoming one fit
  /// together (its file takes its room while it is written). When room is short, `key`'s own
  /// copy goes first: the write replaces it anyway. Returns them.
  std::vector<block_meta> evict_for(const block_key& key, uint64_t incoming_bytes);
  /// Evicts least recently used blocks until `bytes` of their size_bytes have gone (or none is
  /// left), whatever the capacity: room that the disk itself refused. Returns them.
  std::vector<block_meta> evict_bytes(uint64_t bytes);
  /// Server `server` deleted its copy of `key` (the write `write_seq`) to keep its disk within its
  /// capacity: that copy is no longer named. A copy known as a later write of the key stays. The
  /// block goes when no copy is left; returns whether it went.
  bool drop_copy(const block_key& key, uint32_t server, uint64_t write_seq);
  /// Removes every block whose expiry (and hold, if any) has passed; returns them.
  std::vector<block_meta> expire(double now_s);
  /// Takes server `server` off every block (it is gone for this index's life; a restarted head
  /// adopts its store node afresh, and it commits what its disk holds again) and removes the
  /// blocks it held alone, which it returns: they must not take room from blocks that can still
  /// be read.
  std::vector<block_meta> forget_server(uint32_t server);

  size_t size() const { return entries_.size(); }
  uint64_t capacity() const { return capacity_; }
  void set_capacity(uint64_t blocks) { capacity_ = blocks; }
  /// The blocks' size_bytes together, and the most they may take (0 = unbounded).
  uint64_t bytes() const { return bytes_; }
  uint64_t capacity_bytes() const { return capacity_bytes_; }
  void set_capacity_bytes(uint64_t bytes) { capacity_bytes_ = bytes; }

 private:
  struct entry {
    block_meta meta;
    std::list<block_key>::iterator lru;  ///< position in lru_ (front = most recent)
    /// In by_expiry_ at the later of meta.expires_at_s and hold_until_s: when it is removed.
    std::multimap<double, block_key>::iterator expiry;
    double hold_until_s = 0.0;  ///< see upsert: found on disk at a restart, kept until then
  };
  /// A parent named by blocks here that is not here itself, while servers may still be
  /// recovering it (see upsert): the latest expiry of those blocks, and until when it may come.
  struct awaited_parent {
    double expires_at_s = 0.0;
    double until_s = 0.0;
  };
  void make_recent(entry& e);
  /// Takes the least recently used block out (lru_ not empty) and adds it to `out`.
  void evict_last(std::vector<block_meta>& out);
  void place(entry& e);
  /// Sets the block's expiry, and its place in by_expiry_ (never before its hold ends).
  void set_expiry(entry& e, double expires_at_s);
  void extend_ancestors(const block_meta& child, double now_s);
  std::unordered_map<block_key, entry, block_key_hash> entries_;
  std::list<block_key> lru_;
  std::multimap<double, block_key> by_expiry_;
  /// Only filled while a hold lasts (recovery_until_s_): bounded by the blocks committed
  /// meanwhile, and emptied as the holds end (expire).
  std::unordered_map<block_key, awaited_parent, block_key_hash> awaited_parents_;
  double recovery_until_s_ = 0.0;  ///< the latest hold given: servers may be recovering until then
  uint64_t capacity_;
  uint64_t capacity_bytes_ = 0;
  uint64_t bytes_ = 0;  ///< sum of the entries' size_bytes
};

/// Consistent hashing of keys onto block servers (with virtual nodes, so adding a server moves
/// ~1/n of the keys): the servers that should hold `key`, `replicas` distinct ones.
class server_ring {
 public:
  explicit server_ring(uint32_t num_servers, uint32_t virtual_nodes = 64);
  /// The `replicas` servers after the key's point on the ring, skipping those marked in `down`
  /// (the next live ones take their keys, so a lost server's share moves instead of vanishing).
  std::vector<uint32_t> servers_for(const block_key& key, uint32_t replicas,
                                    const std::vector<bool>* down = nullptr) const;
  uint32_t num_servers() const { return num_servers_; }

 private:
  uint32_t num_servers_;
  std::vector<std::pair<uint64_t, uint32_t>> ring_;  ///< (point, server), sorted
};

}  // namespace baton::store
