#pragma once

// The baseline and alternative placement policies the seed's policies are compared with
// (design.md §4; seed 001 §2.1 and seed 002's scheduling table). Pure: value snapshots in, a
// decision out; ties go to the lowest index, so decisions are deterministic.

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace baton::policies {

/// Placement policies selectable by name in the cluster configuration.
enum class prefill_policy { seed, least_loaded, round_robin, cache_affinity, split };
enum class decode_policy { seed, least_loaded, round_robin };
/// "seed" | "least_loaded" | "round_robin" | "cache_affinity" | "split"; nullopt for anything else.
std::optional<prefill_policy> parse_prefill_policy(const std::string& name);
std::optional<decode_policy> parse_decode_policy(const std::string& name);
std::string to_string(prefill_policy p);
std::string to_string(decode_policy p);

struct prefill_rank_load {
  uint64_t queued_tokens = 0;  ///< prompt tokens accepted but not yet computed
  uint32_t num_running = 0;    ///< prompts in progress
  bool available = true;       ///< false: the rank stopped reporting or is draining
};

struct decode_rank_load {
  uint32_t num_running = 0;      ///< sequences decoding or holding a lease
  uint32_t num_free_pages = 0;
  uint32_t num_total_pages = 0;
  bool available = true;
};

/// The rank with the fewest queued tokens (then fewest running prompts).
std::optional<size_t> least_loaded_prefill(const std::vector<prefill_rank_load>& ranks);

/// Among ranks with at least `pages_needed` free pages, the one with the fewest running
/// sequences (then the most free pages). Never a rank that cannot hold the request.
std::optional<size_t> least_loaded_decode(const std::vector<decode_rank_load>& ranks, uint32_t pages_needed);

/// The next available rank at or after `cursor` (cyclically); advances the cursor past it.
std::optional<size_t> round_robin(const std::vector<bool>& available, uint64_t& cursor);

/// Seed 001 §2.1, KV-cache-aware routing: the rank holding the longest cached prefix of this
/// request (`cached_tokens[i]` on rank i), unless its queue exceeds `max_queued_tokens`, in
/// which case (or when no rank holds any prefix) the least-loaded rank.
struct affinity_decision {
  size_t rank = 0;
  bool by_affinity = false;  ///< false: fell back to least-loaded
  uint64_t cached_tokens = 0;
};
std::optional<affinity_decision> cache_affinity_prefill(const std::vector<prefill_rank_load>& ranks,
                                                        const std::vector<uint64_t>& cached_tokens,
                                                        uint64_t max_queued_tokens);

/// Seed 002, hybrid PD: prompts with fewer than `threshold_tokens` new tokens are prefilled on
/// the decode rank itself (no KV transfer); longer ones go to the prefill pool. 0 = never.
inline bool prefill_on_decode_rank(uint64_t new_tokens, uint64_t threshold_tokens) {
  return new_tokens < threshold_tokens;
}

/// Seed 002, request-level priority queues: interactive items before batch items, except that
/// a batch item at the head of its queue is passed over by at most `max_bypass` interactive
/// items in a row (so batch work is never starved). State has one owner: the queue's holder.
template <class T>
class priority_classes {
 public:
  explicit priority_classes(uint32_t max_bypass) : max_bypass_(max_bypass) {}

  void push(T item, bool batch) { (batch ? batch_ : interactive_).push_back(std::move(item)); }
  /// Puts an item back at the head of its class (it continues before others of its class).
  void push_front(T item, bool batch) { (batch ? batch_ : interactive_).push_front(std::move(item)); }
  bool empty() const { return interactive_.empty() && batch_.empty(); }
  size_t size() const { return interactive_.size() + batch_.size(); }

  /// The item pop() would return, without taking it (nullptr when empty).
  const T* peek() const {
    if (empty()) return nullptr;
    return take_batch() ? &batch_.front() : &interactive_.front();
  }

  /// The next item. `counts` false: it steps aside, to be put back (push_front) -- it passes
  /// no batch item, so the bypass count stays.
  std::optional<T> pop(bool counts = true) {
    if (empty()) return std::nullopt;
    const bool from_batch = take_batch();
    auto& q = from_batch ? batch_ : interactive_;
    T out = std::move(q.front());
    q.pop_front();
    if (counts) bypassed_ = from_batch ? 0 : (batch_.empty() ? 0 : bypassed_ + 1);
    return out;
  }

  /// Removes and returns the first item (interactive first) for which `pred` holds.
  template <class Pred>
  std::optional<T> take_if(Pred pred) {
    for (auto* q : {&interactive_, &batch_})
      for (auto it = q->begin(); it != q->end(); ++it)
        if (pred(*it)) {
          T out = std::move(*it);
          q->erase(it);
          return out;
        }
    return std::nullopt;
  }

  /// Visits every queued item (interactive first) — for load reports and keepalives.
  template <class F>
  void for_each(F f) const {
    for (const auto& x : interactive_) f(x);
    for (const auto& x : batch_) f(x);
  }

 private:
  bool take_batch() const { return !batch_.empty() && (interactive_.empty() || bypassed_ >= max_bypass_); }

  std::deque<T> interactive_, batch_;
  uint32_t max_bypass_;
  uint32_t bypassed_ = 0;
};

}  // namespace baton::policies
