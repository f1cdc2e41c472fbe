#pragma once

// Byte ranges of a registered staging buffer handed out for transfers in flight (write-back
// slots on both ends). First fit, neighbours merged on release. Pure; one owner.

#include <cstdint>
#include <map>
#include <optional>

namespace baton::store {

class staging_pool {
 public:
  explicit staging_pool(uint64_t total_bytes) : total_(total_bytes) {
    if (total_bytes) free_[0] = total_bytes;
  }
  uint64_t capacity() const { return total_; }
  /// An offset with `bytes` reserved there, or nothing when no free range is large enough.
  std::optional<uint64_t> acquire(uint64_t bytes) {
    if (bytes == 0) return std::nullopt;  // it would share its offset with the next range given out
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const uint64_t off = it->first, left = it->second - bytes;
      free_.erase(it);
      if (left) free_[off + bytes] = left;
      used_[off] = bytes;
      return off;
    }
    return std::nullopt;
  }
  void release(uint64_t offset) {
    auto u = used_.find(offset);
    if (u == used_.end()) return;
    uint64_t off = offset, len = u->second;
    used_.erase(u);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && next->first == off + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += len;
        return;
      }
    }
    free_[off] = len;
  }
  uint64_t used_bytes() const {
    uint64_t n = 0;
    for (const auto& [o, l] : used_) n += l;
    return n;
  }

 private:
  uint64_t total_ = 0;
  std::map<uint64_t, uint64_t> free_;  ///< offset -> length
  std::map<uint64_t, uint64_t> used_;
};

}  // namespace baton::store
