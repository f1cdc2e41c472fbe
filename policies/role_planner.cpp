#include "policies/role_planner.hpp"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstdio>

namespace baton::policies {

const char* to_string(rank_role r) { return r == rank_role::prefill ? "prefill" : "decode"; }

std::string role_planner_config::validate() const {
  if (!(ttft_target_ms > 0) || !(tbt_target_ms > 0) || !(kv_full > 0 && kv_full <= 1))
    return "role planner targets must be positive (kv_full in (0, 1])";
  if (!(cold >= 0 && cold < hot)) return "role planner needs 0 <= cold < hot";
  if (smooth_s < 0 || hold_s < 0 || cooldown_s < 0 || dwell_s < 0) return "role planner times must be >= 0";
  if (min_prefill == 0 || min_decode == 0) return "role planner pools need at least one rank each";
  if (pool_signal != "mean" && pool_signal != "max")
    return "role planner pool_signal \"" + pool_signal + "\" is unknown (mean or max)";
  return {};
}

role_planner::bucket_pressure role_planner::hottest_bucket(const std::vector<rank_signal>& ranks,
                                                          uint32_t* num_buckets) const {
  std::map<uint32_t, std::pair<double, uint32_t>> by_bucket;  // sum, ranks
  for (const auto& r : ranks)
    if (r.role == rank_role::prefill) {
      auto& b = by_bucket[r.bucket];
      b.first += r.predicted_queue_ms / cfg_.ttft_target_ms;
      ++b.second;
    }
  *num_buckets = static_cast<uint32_t>(by_bucket.size());
  bucket_pressure top;
  for (const auto& [bucket, b] : by_bucket)
    if (const double mean = b.first / b.second; top.ranks == 0 || mean > top.mean) top = {bucket, mean, b.second};
  return top;
}

double role_planner::pressure(rank_role pool, const std::vector<rank_signal>& ranks) const {
  // The mean over the pool: one hot rank is the balancers' business, a hot pool is ours. Or the
  // max: an SLO judged on its tail fails with the most loaded rank, before the mean says so.
  if (pool == rank_role::prefill && cfg_.pool_signal == "mean") {
    uint32_t buckets = 0;
    return hottest_bucket(ranks, &buckets).mean;  // one bucket: the pool's mean
  }
  double sum = 0, top = 0;
  size_t n = 0;
  for (const auto& r : ranks) {
    if (r.role != pool) continue;
    ++n;
    const double x = pool == rank_role::prefill ? r.predicted_queue_ms / cfg_.ttft_target_ms
                                                : std::max(r.step_ms / cfg_.tbt_target_ms, r.kv_used / cfg_.kv_full);
    sum += x;
    top = std::max(top, x);
  }
  if (cfg_.pool_signal == "max") return top;
  return n ? sum / static_cast<double>(n) : 0.0;
}

bool role_planner::settled(const std::string& rank, double now_s) const {
  for (const auto& c : changes_)
    if (c.rank == rank) return now_s - c.at_s >= cfg_.dwell_s;
  return true;
}

std::optional<role_move> role_planner::plan(double now_s, const std::vector<rank_signal>& ranks) {
  // Exponential averages over smooth_s, started at the first observation.
  const double p_now = pressure(rank_role::prefill, ranks), d_now = pressure(rank_role::decode, ranks);
  if (!last_plan_s_) {
    smooth_p_ = p_now, smooth_d_ = d_now;
  } else {
    const double dt = std::max(0.0, now_s - *last_plan_s_);
    const double k = cfg_.smooth_s > 0 ? 1.0 - std::exp(-dt / cfg_.smooth_s) : 1.0;
    smooth_p_ += k * (p_now - smooth_p_);
    smooth_d_ += k * (d_now - smooth_d_);
  }
  last_plan_s_ = now_s;
  const double p = smooth_p_, d = smooth_d_;
  const auto count = [&](rank_role role) {  // the ranks that serve it: a pool's minimum is about them
    return static_cast<uint32_t>(std::count_if(ranks.begin(), ranks.end(), [&](auto& r) { return r.role == role && r.open; }));
  };
  // Each condition's clock starts when it first holds and stops as soon as it does not.
  const bool prefill_needs = p >= cfg_.hot && d <= cfg_.cold && count(rank_role::decode) > cfg_.min_decode;
  const bool decode_needs = d >= cfg_.hot && p <= cfg_.cold && count(rank_role::prefill) > cfg_.min_prefill;
  if (!prefill_needs) want_prefill_since_.reset();
  else if (!want_prefill_since_) want_prefill_since_ = now_s;
  if (!decode_needs) want_decode_since_.reset();
  else if (!want_decode_since_) want_decode_since_ = now_s;
  if (last_move_s_ && now_s - *last_move_s_ < cfg_.cooldown_s) return std::nullopt;

  const bool to_prefill = want_prefill_since_ && now_s - *want_prefill_since_ >= cfg_.hold_s;
  const bool to_decode = want_decode_since_ && now_s - *want_decode_since_ >= cfg_.hold_s;
  if (!to_prefill && !to_decode) return std::nullopt;
  const rank_role from = to_prefill ? rank_role::decode : rank_role::prefill;
  // The least busy settled rank of the giving pool: the cheapest to drain.
  const rank_signal* pick = nullptr;
  for (const auto& r : ranks) {
    if (r.role != from || !r.movable || !settled(r.name, now_s)) continue;
    const auto load = [&](const rank_signal& x) { return from == rank_role::prefill ? x.predicted_queue_ms : x.kv_used; };
    if (!pick || r.running < pick->running || (r.running == pick->running && load(r) < load(*pick))) pick = &r;
  }
  if (!pick) return std::nullopt;  // every candidate changed role too recently
  role_move m{pick->name, from, from == rank_role::prefill ? rank_role::decode : rank_role::prefill, {}};
  char why[400];
  const char* over = cfg_.pool_signal.c_str();
  std::snprintf(why, sizeof why,
                "%s pool hot, %s pool cold for %.1f s: prefill pressure %.2f (%s predicted queue / TTFT target "
                "%.0f ms, smoothed), decode pressure %.2f (%s over ranks of the max of step / TBT target %.0f ms and "
                "KV used / %.2f, smoothed); %s has the least work of its pool (%u running)",
                to_string(m.to), to_string(m.from), now_s - (to_prefill ? *want_prefill_since_ : *want_decode_since_), p,
                over, cfg_.ttft_target_ms, d, over, cfg_.tbt_target_ms, cfg_.kv_full, pick->name.c_str(), pick->running);
  m.why = why;
  if (uint32_t buckets = 0; to_prefill && cfg_.pool_signal == "mean") {
    const auto hot = hottest_bucket(ranks, &buckets);
    if (buckets > 1) {
      char more[200];
      std::snprintf(more, sizeof more,
                    "; the prefill pressure is length bucket %u's, the hottest of %u (%.2f now over its %u rank%s)",
                    hot.bucket, buckets, hot.mean, hot.ranks, hot.ranks == 1 ? "" : "s");
      m.why += more;
    }
  }
  last_move_s_ = now_s;
  want_prefill_since_.reset();
  want_decode_since_.reset();
  auto c = std::find_if(changes_.begin(), changes_.end(), [&](auto& x) { return x.rank == m.rank; });
  if (c == changes_.end()) changes_.push_back({m.rank, now_s});
  else c->at_s = now_s;
  return m;
}

}  // namespace baton::policies
