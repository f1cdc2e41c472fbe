#include "policies/placement.hpp"

#include <tuple>

namespace baton::policies {

std::optional<prefill_policy> parse_prefill_policy(const std::string& name) {
  if (name == "seed") return prefill_policy::seed;
  if (name == "least_loaded") return prefill_policy::least_loaded;
  if (name == "round_robin") return prefill_policy::round_robin;
  if (name == "cache_affinity") return prefill_policy::cache_affinity;
  if (name == "split") return prefill_policy::split;
  return std::nullopt;
}

std::optional<decode_policy> parse_decode_policy(const std::string& name) {
  if (name == "seed") return decode_policy::seed;
  if (name == "least_loaded") return decode_policy::least_loaded;
  if (name == "round_robin") return decode_policy::round_robin;
  return std::nullopt;
}

std::string to_string(prefill_policy p) {
  switch (p) {
    case prefill_policy::seed: return "seed";
    case prefill_policy::least_loaded: return "least_loaded";
    case prefill_policy::round_robin: return "round_robin";
    case prefill_policy::cache_affinity: return "cache_affinity";
    case prefill_policy::split: return "split";
  }
  return "?";
}

std::string to_string(decode_policy p) {
  switch (p) {
    case decode_policy::seed: return "seed";
    case decode_policy::least_loaded: return "least_loaded";
    case decode_policy::round_robin: return "round_robin";
  }
  return "?";
}

std::optional<size_t> least_loaded_prefill(const std::vector<prefill_rank_load>& ranks) {
  std::optional<size_t> best;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!ranks[i].available) continue;
    if (!best || std::tie(ranks[i].queued_tokens, ranks[i].num_running) <
                     std::tie(ranks[*best].queued_tokens, ranks[*best].num_running))
      best = i;
  }
  return best;
}

std::optional<size_t> least_loaded_decode(const std::vector<decode_rank_load>& ranks, uint32_t pages_needed) {
  std::optional<size_t> best;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    if (!r.available || r.num_free_pages < pages_needed) continue;
    if (!best || r.num_running < ranks[*best].num_running ||
        (r.num_running == ranks[*best].num_running && r.num_free_pages > ranks[*best].num_free_pages))
      best = i;
  }
  return best;
}

std::optional<size_t> round_robin(const std::vector<bool>& available, uint64_t& cursor) {
  const size_t n = available.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (cursor + k) % n;
    if (available[i]) {
      cursor = i + 1;
      return i;
    }
  }
  return std::nullopt;
}

std::optional<affinity_decision> cache_affinity_prefill(const std::vector<prefill_rank_load>& ranks,
                                                        const std::vector<uint64_t>& cached_tokens,
                                                        uint64_t max_queued_tokens) {
  std::optional<size_t> best;
  for (size_t i = 0; i < ranks.size() && i < cached_tokens.size(); ++i) {
    if (!ranks[i].available || cached_tokens[i] == 0 || ranks[i].queued_tokens > max_queued_tokens) continue;
    if (!best || cached_tokens[i] > cached_tokens[*best]) best = i;
  }
  if (best) return affinity_decision{*best, true, cached_tokens[*best]};
  auto fallback = least_loaded_prefill(ranks);
  if (!fallback) return std::nullopt;
  const uint64_t cached = *fallback < cached_tokens.size() ? cached_tokens[*fallback] : 0;
  return affinity_decision{*fallback, false, cached};
}

}  // namespace baton::policies
