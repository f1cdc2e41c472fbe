#pragma once

// Least-loaded placement: the baseline policies of the balancers (design.md §4). Pure: value
// snapshots in, a decision out; ties go to the lowest index, so decisions are deterministic.

#include <cstdint>
#include <optional>
#include <vector>

namespace baton::policies {

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

}  // namespace baton::policies
