#include "policies/prefill_placement.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace baton::policies {

std::string bucket_config::validate() const {
  if (upper_bounds_tokens.size() > 15) return "bucket upper_bounds_tokens: at most 15 bounds (16 buckets)";
  for (size_t i = 0; i < upper_bounds_tokens.size(); ++i)
    if (upper_bounds_tokens[i] == 0 || (i > 0 && upper_bounds_tokens[i] <= upper_bounds_tokens[i - 1]))
      return "bucket upper_bounds_tokens must be positive and strictly increasing";
  if (!(demand_half_life_s > 0)) return "bucket demand_half_life_s must be > 0";
  if (hysteresis_engines < 0 || hysteresis_fraction < 0) return "bucket hysteresis values must be >= 0";
  if (min_move_interval_s < 0) return "bucket min_move_interval_s must be >= 0";
  return {};
}

bucket_allocator::bucket_allocator(bucket_config cfg, uint32_t num_engines) : cfg_(std::move(cfg)) {
  demand_.assign(num_buckets(), 0.0);
  demand_at_s_.assign(num_buckets(), 0.0);
  engine_bucket_.assign(num_engines, 0);
  bucket_engines_.resize(num_buckets());
  for (uint32_t e = 0; e < num_engines; ++e) bucket_engines_[0].push_back(e);
}

uint32_t bucket_allocator::bucket_of(uint64_t prompt_tokens) const {
  const auto& ub = cfg_.upper_bounds_tokens;
  return static_cast<uint32_t>(std::upper_bound(ub.begin(), ub.end(), prompt_tokens) - ub.begin());
}

double bucket_allocator::demand(uint32_t bucket, double now_s) const {
  const double age = std::max(0.0, now_s - demand_at_s_[bucket]);
  return demand_[bucket] * std::exp2(-age / cfg_.demand_half_life_s);
}

void bucket_allocator::record_demand(uint32_t bucket, double cost_us, double now_s) {
  demand_[bucket] = demand(bucket, now_s) + cost_us;
  demand_at_s_[bucket] = now_s;
}

std::vector<uint32_t> bucket_allocator::engine_counts() const {
  std::vector<uint32_t> n;
  for (const auto& e : bucket_engines_) n.push_back(static_cast<uint32_t>(e.size()));
  return n;
}

std::optional<engine_move> bucket_allocator::rebalance(double now_s) {
  if (engine_bucket_.empty()) return std::nullopt;
  const uint32_t nb = num_buckets();
  constexpr uint32_t max_buckets = 16;  // shares live on the stack: this runs on every decision
  double share[max_buckets];
  double count[max_buckets];
  if (nb > max_buckets) return std::nullopt;
  double total = 0.0;
  for (uint32_t b = 0; b < nb; ++b) {
    total += share[b] = demand(b, now_s);
    count[b] = static_cast<double>(bucket_engines_[b].size());
  }
  if (total <= 0.0) return std::nullopt;
  for (uint32_t b = 0; b < nb; ++b) share[b] = share[b] / total * static_cast<double>(engine_bucket_.size());
  auto bar = [&](uint32_t b) { return 0.5 + cfg_.hysteresis_engines + cfg_.hysteresis_fraction * share[b]; };
  std::optional<uint32_t> to, from;
  for (uint32_t b = 0; b < nb; ++b) {
    const double deficit = share[b] - count[b];
    if (deficit > bar(b) && (!to || deficit > share[*to] - count[*to])) to = b;
    // A giver keeps its last engine unless it has almost no demand of its own.
    const bool can_give = count[b] >= 2 || (count[b] == 1 && share[b] < 0.25);
    const double surplus = count[b] - share[b];
    if (can_give && surplus > bar(b) && (!from || surplus > count[*from] - share[*from])) from = b;
  }
  if (!to || !from) return std::nullopt;
  // Within the settling interval only an urgent move happens: the receiver is more than a whole
  // engine short beyond the hysteresis (a cold start, or demand that jumped).
  if (now_s - last_move_s_ < cfg_.min_move_interval_s && share[*to] - count[*to] <= bar(*to) + 1.0)
    return std::nullopt;
  // The giver's highest-numbered engine moves (a stable, explainable choice).
  auto& giver = bucket_engines_[*from];
  auto highest = std::max_element(giver.begin(), giver.end());
  const uint32_t e = *highest;
  giver.erase(highest);
  auto& taker = bucket_engines_[*to];
  taker.insert(std::upper_bound(taker.begin(), taker.end(), e), e);
  engine_bucket_[e] = *to;
  last_move_s_ = now_s;
  return engine_move{e, *from, *to};
}

void bucket_allocator::resize(uint32_t num_engines, double now_s) {
  // Engines past the new count leave their buckets.
  while (engine_bucket_.size() > num_engines) {
    const auto e = static_cast<uint32_t>(engine_bucket_.size() - 1);
    auto& v = bucket_engines_[engine_bucket_[e]];
    v.erase(std::find(v.begin(), v.end(), e));
    engine_bucket_.pop_back();
  }
  // Each newcomer joins the bucket furthest below its share of the demand (bucket 0 when there
  // is no demand yet), so a rank that elastic P/D moves into prefill serves where it is short.
  const uint32_t nb = num_buckets();
  while (engine_bucket_.size() < num_engines) {
    const auto e = static_cast<uint32_t>(engine_bucket_.size());
    const double engines = static_cast<double>(e + 1);
    double total = 0.0;
    for (uint32_t b = 0; b < nb; ++b) total += demand(b, now_s);
    uint32_t best = 0;
    double best_deficit = -1e300;
    for (uint32_t b = 0; total > 0.0 && b < nb; ++b) {
      const double deficit = demand(b, now_s) / total * engines - static_cast<double>(bucket_engines_[b].size());
      if (deficit > best_deficit) best = b, best_deficit = deficit;
    }
    engine_bucket_.push_back(best);
    bucket_engines_[best].push_back(e);  // the highest index: the list stays sorted
  }
}

void bucket_allocator::remove_engine(uint32_t engine) {
  if (engine >= engine_bucket_.size()) return;
  engine_bucket_.erase(engine_bucket_.begin() + engine);
  for (auto& v : bucket_engines_) v.clear();
  for (uint32_t e = 0; e < engine_bucket_.size(); ++e) bucket_engines_[engine_bucket_[e]].push_back(e);
}

const std::vector<uint32_t>& bucket_allocator::engines_for(uint32_t bucket, bool* borrowed) const {
  const auto nb = static_cast<int>(num_buckets());
  // Distance 0 is the bucket itself; then the nearer neighbours, the shorter one first.
  for (int d = 0; d < nb; ++d)
    for (int b : {static_cast<int>(bucket) - d, static_cast<int>(bucket) + d}) {
      if (b < 0 || b >= nb || bucket_engines_[b].empty()) continue;
      if (borrowed) *borrowed = d != 0;
      return bucket_engines_[b];
    }
  return bucket_engines_[0];  // no engines anywhere: empty
}

std::vector<uint32_t> bucket_allocator::usable_engines_for(uint32_t bucket, const std::function<bool(uint32_t)>& usable,
                                                          bool* borrowed) const {
  const auto nb = static_cast<int>(num_buckets());
  for (int d = 0; d < nb; ++d)
    for (int b : {static_cast<int>(bucket) - d, static_cast<int>(bucket) + d}) {
      if (b < 0 || b >= nb) continue;
      std::vector<uint32_t> out;
      for (auto e : bucket_engines_[b])
        if (usable(e)) out.push_back(e);
      if (out.empty()) continue;
      if (borrowed) *borrowed = d != 0;
      return out;
    }
  return {};
}

double prefill_engine_view::remaining_quota_us() const {
  double used = 0.0;
  for (const auto& r : ranks) used += r.predicted_us;
  return quota_us - used;
}

std::string prefill_decision::explain(std::string_view rank_name) const {
  char head[192], tail[96];
  std::snprintf(head, sizeof head, "bucket %u%s -> engine %u (remaining quota %.0f us) -> ", bucket,
                borrowed          ? " (borrowed)"
                : lent_by_shorter ? " (queued: an idle engine of a shorter bucket, which keeps another idle)"
                : idle_lent       ? " (queued: an idle engine of a longer bucket)"
                                  : "",
                engine,
                engine_remaining_quota_us);
  std::snprintf(tail, sizeof tail, " (predicted load %.0f us); this request %.0f us", rank_predicted_us, predicted_us);
  return head + std::string{rank_name} + tail;
}

std::optional<prefill_decision> place_prefill(const bucket_allocator& buckets,
                                              const std::vector<prefill_engine_view>& engines,
                                              const cost_model& model, uint64_t q, uint64_t c) {
  prefill_decision d;
  d.bucket = buckets.bucket_of(q + c);
  d.predicted_us = model.prefill_us(q, c);
  std::optional<uint32_t> best_engine;
  double best_remaining = 0.0;
  const auto usable = [&](uint32_t e) {
    return e < engines.size() && std::any_of(engines[e].ranks.begin(), engines[e].ranks.end(), [](auto& r) { return r.available; });
  };
  for (uint32_t e : buckets.usable_engines_for(d.bucket, usable, &d.borrowed)) {
    const auto& ev = engines[e];
    const double remaining = ev.remaining_quota_us();
    if (!best_engine || remaining > best_remaining) best_engine = e, best_remaining = remaining;
  }
  if (!best_engine) return std::nullopt;
  const auto least_loaded_rank = [&](uint32_t e) {
    std::optional<uint32_t> best;
    for (uint32_t r = 0; r < engines[e].ranks.size(); ++r) {
      if (!engines[e].ranks[r].available) continue;
      if (!best || engines[e].ranks[r].predicted_us < engines[e].ranks[*best].predicted_us) best = r;
    }
    return best;
  };
  std::optional<uint32_t> best_rank = least_loaded_rank(*best_engine);
  // Loads are reports plus charges taken back by subtraction: "idle" is under a microsecond.
  constexpr double idle_us = 1.0;
  if (engines[*best_engine].ranks[*best_rank].predicted_us >= idle_us) {
    // Queued behind work: an idle engine of a longer-prompt bucket takes it (the lowest-numbered,
    // a stable choice).
    const auto& owner = buckets.engine_buckets();
    const auto idle = [&](uint32_t e) {
      const auto& ranks = engines[e].ranks;
      return usable(e) && !std::any_of(ranks.begin(), ranks.end(), [&](auto& r) { return r.available && r.predicted_us >= idle_us; });
    };
    for (uint32_t e = 0; e < engines.size() && e < owner.size(); ++e) {
      if (owner[e] <= d.bucket || !idle(e)) continue;
      best_engine = e;
      best_rank = least_loaded_rank(e);
      d.idle_lent = true;
      break;
    }
    // A long prompt that would wait longer than it computes takes an idle engine of a shorter
    // bucket, while that bucket keeps another idle one for its own prompts (which then wait
    // behind nobody): on the Mooncake trace the long-prompt engines queued minutes while the
    // short ones idled at 40-70% (docs/sims.md, (a)).
    if (!d.idle_lent && engines[*best_engine].ranks[*best_rank].predicted_us >= d.predicted_us) {
      std::vector<uint32_t> idle_in(buckets.num_buckets(), 0);
      for (uint32_t e = 0; e < engines.size() && e < owner.size(); ++e)
        if (idle(e)) ++idle_in[owner[e]];
      for (uint32_t e = 0; e < engines.size() && e < owner.size(); ++e) {
        if (owner[e] >= d.bucket || !idle(e) || idle_in[owner[e]] < 2) continue;
        best_engine = e;
        best_rank = least_loaded_rank(e);
        d.idle_lent = d.lent_by_shorter = true;
        break;
      }
    }
  }
  const auto& ev = engines[*best_engine];
  d.engine = *best_engine;
  d.rank = *best_rank;
  d.engine_remaining_quota_us = ev.remaining_quota_us();
  d.rank_predicted_us = ev.ranks[*best_rank].predicted_us;
  return d;
}

std::vector<uint64_t> engine_step_chunks(const cost_model& m, const std::vector<rank_head>& heads, double budget_us) {
  std::vector<uint64_t> out;
  out.reserve(heads.size());
  for (const auto& h : heads) out.push_back(largest_chunk(m, h.context, h.remaining, budget_us));
  return out;
}

}  // namespace baton::policies
