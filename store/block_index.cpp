#include "store/block_index.hpp"

#include <algorithm>

namespace baton::store {

std::optional<retention> parse_retention(const std::string& name) {
  if (name == "chat") return retention::chat;
  if (name == "agent") return retention::agent;
  if (name == "batch") return retention::batch;
  return std::nullopt;
}

std::string to_string(retention r) {
  switch (r) {
    case retention::chat: return "chat";
    case retention::agent: return "agent";
    case retention::batch: return "batch";
  }
  return "?";
}

void keep_chains_alive(std::vector<found_block>& blocks, const retention_policy& policy) {
  std::unordered_map<block_key, size_t, block_key_hash> at;
  for (size_t i = 0; i < blocks.size(); ++i) at.emplace(blocks[i].key, i);
  const auto left_s = [&](const found_block& b) {
    return policy.ttl_s(static_cast<retention>(b.retention)) - static_cast<double>(b.age_ms) / 1e3;
  };
  // Youngest first (the scan lists them oldest first): a growing chain's newest block carries its
  // value to the root once, and the older ones then stop at their first ancestor.
  for (size_t i = blocks.size(); i-- > 0;) {
    const found_block from = blocks[i];
    // Up the chain while the ancestor would expire sooner. An ancestor that already lives as
    // long passed its own value up when it got it, so its ancestors do too: stop there.
    size_t steps = 0;
    for (auto p = at.find(from.parent); p != at.end() && steps < blocks.size(); p = at.find(blocks[p->second].parent), ++steps) {
      auto& a = blocks[p->second];
      if (left_s(a) >= left_s(from)) break;
      a.retention = from.retention;
      a.age_ms = from.age_ms;
    }
  }
}

double retention_policy::ttl_s(retention r) const {
  switch (r) {
    case retention::chat: return chat_ttl_s;
    case retention::agent: return agent_ttl_s;
    case retention::batch: return batch_ttl_s;
  }
  return 0.0;
}

size_t block_index::longest_prefix(const std::vector<block_key>& keys, double now_s) const {
  size_t n = 0;
  for (const auto& k : keys) {
    auto i = entries_.find(k);
    if (i == entries_.end() || i->second.meta.expires_at_s <= now_s) break;
    ++n;
  }
  return n;
}

const block_meta* block_index::find(const block_key& key) const {
  auto i = entries_.find(key);
  return i == entries_.end() ? nullptr : &i->second.meta;
}

void block_index::make_recent(entry& e) { lru_.splice(lru_.begin(), lru_, e.lru); }

void block_index::place(entry& e) {
  // Leaf-first: right behind its parent when the parent is here (a chain committed first block
  // first, as a decode rank's write-back does, keeps its root the most recent), else in front.
  auto p = e.meta.parent.empty() ? entries_.end() : entries_.find(e.meta.parent);
  lru_.splice(p == entries_.end() ? lru_.begin() : std::next(p->second.lru), lru_, e.lru);
}

void block_index::set_expiry(entry& e, double expires_at_s) {
  by_expiry_.erase(e.expiry);
  e.meta.expires_at_s = expires_at_s;
  e.expiry = by_expiry_.emplace(std::max(expires_at_s, e.hold_until_s), e.meta.key);
}

void block_index::extend_ancestors(const block_meta& child, double now_s) {
  // A chain is found from its root: an ancestor that expires before its descendant would leave
  // them unreachable, so each is kept at least as long (stops at the first that already is).
  for (auto k = child.parent; !k.empty();) {
    auto i = entries_.find(k);
    if (i == entries_.end()) {
      // A server still scanning its directory may commit it yet (after a restart the ring's
      // servers recover a chain's blocks in any order): it will start from this expiry.
      if (now_s < recovery_until_s_) {
        auto& a = awaited_parents_[k];
        a.expires_at_s = std::max(a.expires_at_s, child.expires_at_s);
        a.until_s = recovery_until_s_;
      }
      return;
    }
    auto& e = i->second;
    if (e.meta.expires_at_s >= child.expires_at_s) return;
    set_expiry(e, child.expires_at_s);
    k = e.meta.parent;
  }
}

void block_index::upsert(block_meta meta, double now_s, double hold_until_s) {
  recovery_until_s_ = std::max(recovery_until_s_, hold_until_s);
  auto i = entries_.find(meta.key);
  if (i == entries_.end()) {
    // Its descendants came first (from servers whose scans finished sooner): it lives as long.
    if (auto a = awaited_parents_.find(meta.key); a != awaited_parents_.end()) {
      if (a->second.until_s > now_s) meta.expires_at_s = std::max(meta.expires_at_s, a->second.expires_at_s);
      awaited_parents_.erase(a);
    }
    const bool expired = meta.expires_at_s <= now_s;
    const auto key = meta.key;
    meta.last_access_s = now_s;
    bytes_ += meta.size_bytes;
    lru_.push_front(key);
    auto& placed = entries_.emplace(key, entry{std::move(meta), lru_.begin(), by_expiry_.end(), hold_until_s}).first->second;
    placed.expiry = by_expiry_.emplace(std::max(placed.meta.expires_at_s, placed.hold_until_s), key);
    // Held past its retention (nothing has extended it yet): the first to go when room is short,
    // before any block that can be served.
    if (expired) lru_.splice(lru_.end(), lru_, placed.lru);
    else place(placed);
    extend_ancestors(placed.meta, now_s);
    return;
  }
  auto& e = i->second;
  e.meta.last_access_s = now_s;
  if (meta.size_bytes && meta.size_bytes != e.meta.size_bytes) {  // written again in another size
    bytes_ = bytes_ - e.meta.size_bytes + meta.size_bytes;
    e.meta.size_bytes = meta.size_bytes;
  }
  e.meta.write_seqs.resize(e.meta.servers.size());
  for (size_t k = 0; k < meta.servers.size(); ++k) {
    const uint64_t seq = k < meta.write_seqs.size() ? meta.write_seqs[k] : 0;
    auto at = std::find(e.meta.servers.begin(), e.meta.servers.end(), meta.servers[k]);
    if (at == e.meta.servers.end()) {
      e.meta.servers.push_back(meta.servers[k]);
      e.meta.write_seqs.push_back(seq);
    } else {
      auto& known = e.meta.write_seqs[static_cast<size_t>(at - e.meta.servers.begin())];
      known = std::max(known, seq);  // the same copy written again
    }
  }
  e.hold_until_s = std::max(e.hold_until_s, hold_until_s);
  if (meta.expires_at_s > e.meta.expires_at_s) {
    e.meta.cls = meta.cls;
    set_expiry(e, meta.expires_at_s);
    extend_ancestors(e.meta, now_s);
  } else if (hold_until_s > 0) {
    set_expiry(e, e.meta.expires_at_s);  // a longer hold: its removal moves with it
  }
  // An expired copy found again does not make a held block recent; a live one does.
  if (e.meta.expires_at_s > now_s) place(e);
}

void block_index::touch_chain(const std::vector<block_key>& keys, double now_s) {
  for (auto k = keys.rbegin(); k != keys.rend(); ++k) {
    auto i = entries_.find(*k);
    if (i == entries_.end()) continue;
    make_recent(i->second);
    i->second.meta.last_access_s = now_s;
  }
}

void block_index::erase(const block_key& key) {
  auto i = entries_.find(key);
  if (i == entries_.end()) return;
  lru_.erase(i->second.lru);
  by_expiry_.erase(i->second.expiry);
  bytes_ -= i->second.meta.size_bytes;
  entries_.erase(i);
}

bool block_index::drop_copy(const block_key& key, uint32_t server, uint64_t write_seq) {
  auto i = entries_.find(key);
  if (i == entries_.end()) return false;
  auto& m = i->second.meta;
  auto at = std::find(m.servers.begin(), m.servers.end(), server);
  if (at == m.servers.end()) return false;
  const auto k = static_cast<size_t>(at - m.servers.begin());
  if (k < m.write_seqs.size() && m.write_seqs[k] > write_seq) return false;  // a later write, its commit seen
  m.servers.erase(at);
  if (k < m.write_seqs.size()) m.write_seqs.erase(m.write_seqs.begin() + static_cast<ptrdiff_t>(k));
  if (!m.servers.empty()) return false;
  erase(key);
  return true;
}

std::vector<block_meta> block_index::forget_server(uint32_t server) {
  std::vector<block_meta> out;
  for (auto& [key, e] : entries_) {
    auto& m = e.meta;
    for (size_t k = m.servers.size(); k-- > 0;)
      if (m.servers[k] == server) {
        m.servers.erase(m.servers.begin() + static_cast<ptrdiff_t>(k));
        if (k < m.write_seqs.size()) m.write_seqs.erase(m.write_seqs.begin() + static_cast<ptrdiff_t>(k));
      }
    if (m.servers.empty()) out.push_back(m);
  }
  for (const auto& m : out) erase(m.key);
  return out;
}

void block_index::evict_last(std::vector<block_meta>& out) {
  auto e = entries_.find(lru_.back());
  out.push_back(e->second.meta);
  by_expiry_.erase(e->second.expiry);
  bytes_ -= e->second.meta.size_bytes;
  lru_.pop_back();
  entries_.erase(e);
}

std::vector<block_meta> block_index::evict_to_capacity() {
  std::vector<block_meta> out;
  while (!lru_.empty() && ((capacity_ && entries_.size() > capacity_) || (capacity_bytes_ && bytes_ > capacity_bytes_)))
    evict_last(out);
  return out;
}

std::vector<block_meta> block_index::evict_for(const block_key& key, uint64_t incoming_bytes) {
  std::vector<block_meta> out;
  if (capacity_bytes_ == 0) return out;
  if (auto i = entries_.find(key); i != entries_.end() && bytes_ + incoming_bytes > capacity_bytes_)
    lru_.splice(lru_.end(), lru_, i->second.lru);
  while (!lru_.empty() && bytes_ + incoming_bytes > capacity_bytes_) evict_last(out);
  return out;
}

std::vector<block_meta> block_index::evict_bytes(uint64_t bytes) {
  std::vector<block_meta> out;
  uint64_t freed = 0;
  while (!lru_.empty() && freed < bytes) {
    evict_last(out);
    freed += out.back().size_bytes;
  }
  return out;
}

std::vector<block_meta> block_index::expire(double now_s) {
  std::vector<block_meta> out;
  for (auto it = by_expiry_.begin(); it != by_expiry_.end() && it->first <= now_s;) {
    auto e = entries_.find(it->second);
    out.push_back(e->second.meta);
    lru_.erase(e->second.lru);
    bytes_ -= e->second.meta.size_bytes;
    entries_.erase(e);
    it = by_expiry_.erase(it);
  }
  // A parent not come by the end of the holds is not coming from a recovery.
  std::erase_if(awaited_parents_, [&](const auto& a) { return a.second.until_s <= now_s; });
  return out;
}

server_ring::server_ring(uint32_t num_servers, uint32_t virtual_nodes) : num_servers_(num_servers) {
  for (uint32_t s = 0; s < num_servers; ++s)
    for (uint32_t v = 0; v < virtual_nodes; ++v) {
      ring_.emplace_back(spread_words(uint64_t{0x5bd1e995} << 32 | s, v), s);
    }
  std::sort(ring_.begin(), ring_.end());
}

std::vector<uint32_t> server_ring::servers_for(const block_key& key, uint32_t replicas,
                                               const std::vector<bool>* down) const {
  std::vector<uint32_t> out;
  if (ring_.empty()) return out;
  replicas = std::min(replicas, num_servers_);
  auto it = std::lower_bound(ring_.begin(), ring_.end(), std::make_pair(key.hi, uint32_t{0}));
  for (size_t step = 0; step < ring_.size() && out.size() < replicas; ++step, ++it) {
    if (it == ring_.end()) it = ring_.begin();
    if (down && it->second < down->size() && (*down)[it->second]) continue;
    if (std::find(out.begin(), out.end(), it->second) == out.end()) out.push_back(it->second);
  }
  return out;
}

}  // namespace baton::store
