#include "policies/placement.hpp"

#include <tuple>

namespace baton::policies {

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

}  // namespace baton::policies
