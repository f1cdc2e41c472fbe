#pragma once

// Seed 000 §3.2: decode placement in two dimensions. A step's cost has two parts: the batch
// size (linear and MoE layers, communication) and the total KV length (the attention scan and
// HBM capacity). Short-context requests go where few sequences run, even if that rank holds a
// lot of KV; long-context requests go where the KV total is small. Never over KV capacity.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace baton::policies {

/// On-demand KV: the pages a decode rank of `total_pages` keeps free for its running sequences
/// to grow into, never a newcomer's (vLLM's 1 % watermark, at least one page).
inline uint32_t on_demand_watermark_pages(uint32_t total_pages) { return total_pages / 100 > 1 ? total_pages / 100 : 1; }

/// The most pages a newcomer can ever be granted on such a rank, even with nothing running.
inline uint32_t grantable_pages(uint32_t total_pages, bool on_demand) {
  if (!on_demand) return total_pages;
  const uint32_t kept = on_demand_watermark_pages(total_pages);
  return total_pages > kept ? total_pages - kept : 0;
}

struct decode_rank_view {
  uint32_t num_running = 0;        ///< sequences decoding or holding a lease
  uint64_t kv_tokens = 0;          ///< tokens of KV held (running + leased)
  uint64_t kv_free_tokens = 0;     ///< room left, in tokens (whole free pages × page size)
  uint64_t kv_capacity_tokens = 0;
  bool available = true;
  /// Room this request needs on this rank, in tokens (whole pages of its size; a rank that
  /// allocates on demand needs only the prompt and its headroom). 0: the request's context.
  uint64_t need_tokens = 0;
};

struct decode_2d_config {
  /// A request whose context (prompt + output budget) is at least this long counts as long.
  uint64_t long_context_tokens = 8192;
  /// Short requests avoid ranks whose KV would be fuller than this fraction after placement
  /// (when another rank can take them): a nearly full rank is kept for what it already holds.
  double kv_high_watermark = 0.9;

  std::string validate() const;
};

struct decode_decision {
  size_t rank = 0;
  bool long_context = false;
  uint32_t rank_running = 0;
  uint64_t rank_kv_tokens = 0;
  /// The choice in words, the rank by its name (`rank` is an index into the caller's list).
  std::string explain(std::string_view rank_name) const;
};

/// The rank for a request needing `context_tokens` of KV, or nullopt if none can hold it.
std::optional<decode_decision> place_decode_2d(const std::vector<decode_rank_view>& ranks, uint64_t context_tokens,
                                               const decode_2d_config& cfg);

}  // namespace baton::policies
