#include "policies/decode_placement.hpp"

#include <cstdio>
#include <tuple>

namespace baton::policies {

std::string decode_2d_config::validate() const {
  if (long_context_tokens == 0) return "decode long_context_tokens must be >= 1";
  if (!(kv_high_watermark > 0.0 && kv_high_watermark <= 1.0)) return "decode kv_high_watermark must be in (0, 1]";
  return {};
}

std::string decode_decision::explain(std::string_view rank_name) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, " (%u running, %llu KV tokens)", rank_running,
                static_cast<unsigned long long>(rank_kv_tokens));
  return std::string{long_context ? "long" : "short"} + " context -> " + std::string{rank_name} + buf;
}

std::optional<decode_decision> place_decode_2d(const std::vector<decode_rank_view>& ranks, uint64_t context_tokens,
                                               const decode_2d_config& cfg) {
  const bool long_ctx = context_tokens >= cfg.long_context_tokens;
  auto need = [&](const decode_rank_view& r) { return r.need_tokens ? r.need_tokens : context_tokens; };
  auto over_watermark = [&](const decode_rank_view& r) {
    return r.kv_capacity_tokens > 0 &&
           static_cast<double>(r.kv_tokens + need(r)) > cfg.kv_high_watermark * r.kv_capacity_tokens;
  };
  auto better = [&](const decode_rank_view& a, const decode_rank_view& b) {
    if (long_ctx) return std::tie(a.kv_tokens, a.num_running) < std::tie(b.kv_tokens, b.num_running);
    // Short: below the watermark first, then fewest running, then least KV.
    return std::make_tuple(over_watermark(a), a.num_running, a.kv_tokens) <
           std::make_tuple(over_watermark(b), b.num_running, b.kv_tokens);
  };
  std::optional<size_t> best;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    if (!r.available || r.kv_free_tokens < need(r)) continue;
    if (!best || better(r, ranks[*best])) best = i;
  }
  if (!best) return std::nullopt;
  return decode_decision{*best, long_ctx, ranks[*best].num_running, ranks[*best].kv_tokens};
}

}  // namespace baton::policies
