#pragma once

// A rank-local tier of the store (seed 001 §2.2): full prefix blocks kept in the rank's own KV
// pages after their prompt finished, shared (reference-counted, read-only) by later prompts with
// the same prefix, evicted leaf-first LRU when the rank needs pages. Pure bookkeeping over page
// ids; the owner (one rank actor) allocates and frees the pages themselves.

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "store/block_key.hpp"

namespace baton::store {

class prefix_cache {
 public:
  prefix_cache(uint32_t pages_per_block, uint64_t capacity_blocks)
    : ppb_(pages_per_block), capacity_(capacity_blocks) {}

  /// How many leading keys are cached.
  size_t match(const std::vector<block_key>& keys) const;
  /// Pins the first n blocks (they must match) and returns their pages in order (n × ppb).
  std::vector<uint32_t> acquire(const std::vector<block_key>& keys, size_t n);
  /// Unpins what acquire pinned.
  void release(const std::vector<block_key>& keys, size_t n);
  /// Adopts `pages` as block `key` (most recently used). If the block is cached already, the
  /// pages are handed back for the caller to free. Call for a chain's blocks last first.
  std::vector<uint32_t> insert(const block_key& key, std::vector<uint32_t> pages);
  /// Evicts unpinned blocks, least recently used first, until `pages_wanted` pages are handed
  /// back or nothing else can go; also down to capacity. Returns the pages to free.
  std::vector<uint32_t> evict(uint64_t pages_wanted);

  uint64_t blocks() const { return entries_.size(); }
  uint64_t pages() const { return entries_.size() * ppb_; }
  uint32_t pages_per_block() const { return ppb_; }

 private:
  struct entry {
    std::vector<uint32_t> pages;
    uint32_t pins = 0;
    std::list<block_key>::iterator lru;
  };
  uint32_t ppb_;
  uint64_t capacity_;
  std::unordered_map<block_key, entry, block_key_hash> entries_;
  std::list<block_key> lru_;  ///< front = most recent
};

}  // namespace baton::store
