#include "store/prefix_cache.hpp"

namespace baton::store {

size_t prefix_cache::match(const std::vector<block_key>& keys) const {
  size_t n = 0;
  while (n < keys.size() && entries_.count(keys[n])) ++n;
  return n;
}

std::vector<uint32_t> prefix_cache::acquire(const std::vector<block_key>& keys, size_t n) {
  std::vector<uint32_t> out;
  for (size_t i = n; i-- > 0;) {  // last first: the leading blocks end most recent
    auto& e = entries_.at(keys[i]);
    ++e.pins;
    lru_.splice(lru_.begin(), lru_, e.lru);
  }
  for (size_t i = 0; i < n; ++i) {
    const auto& p = entries_.at(keys[i]).pages;
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

void prefix_cache::release(const std::vector<block_key>& keys, size_t n) {
  for (size_t i = 0; i < n && i < keys.size(); ++i)
    if (auto it = entries_.find(keys[i]); it != entries_.end() && it->second.pins > 0) --it->second.pins;
}

std::vector<uint32_t> prefix_cache::insert(const block_key& key, std::vector<uint32_t> pages) {
  if (auto it = entries_.find(key); it != entries_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return pages;
  }
  lru_.push_front(key);
  entries_.emplace(key, entry{std::move(pages), 0, lru_.begin()});
  return {};
}

std::vector<uint32_t> prefix_cache::evict(uint64_t pages_wanted) {
  std::vector<uint32_t> out;
  auto it = lru_.end();
  while (it != lru_.begin() && (out.size() < pages_wanted || entries_.size() > capacity_)) {
    --it;
    auto e = entries_.find(*it);
    if (e->second.pins > 0) continue;
    out.insert(out.end(), e->second.pages.begin(), e->second.pages.end());
    entries_.erase(e);
    it = lru_.erase(it);
  }
  return out;
}

}  // namespace baton::store
