#pragma once

// Seed 000 §3.1: the four levels of prefill placement.
//   (1) length buckets <16K, 16K-64K, 64K-256K, >=256K, each owning a number of engines that
//       follows the bucket's live compute demand (bucket_allocator, stateful, one owner: the
//       prefill balancer);
//   (2) among the bucket's engines (DP groups), the one with the most remaining compute quota;
//       no prefix affinity, because the KV lives in the shared store;
//   (3) within that engine, the DP rank with the least predicted load;
//   (4) per step, the largest chunk that fits the step's time budget (cost_model.hpp:
//       plan_chunks / engine_step_chunks), so the ranks of one engine finish each step together.
// Pure: snapshots and the clock value in, decisions out.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "policies/cost_model.hpp"

namespace baton::policies {

struct bucket_config {
  /// Upper bounds (exclusive) of every bucket but the last, in prompt tokens (prefix included).
  std::vector<uint64_t> upper_bounds_tokens = {16 * 1024, 64 * 1024, 256 * 1024};
  /// Demand is an exponentially decayed sum of predicted prefill time; this is its half-life.
  /// Long prompts are rare and heavy, so their bucket's estimate is noisy: a long half-life
  /// averages over enough of them.
  double demand_half_life_s = 600.0;
  /// A move happens only when the receiving bucket is short of its fair share by more than
  /// 0.5 + hysteresis_engines + hysteresis_fraction·share engines, and the giving bucket has
  /// at least as many too many (by its own share). The fraction absorbs the estimate's noise,
  /// which grows with the share.
  double hysteresis_engines = 0.25;
  double hysteresis_fraction = 0.1;
  /// At least this long between two non-urgent moves (settling time for the demand estimate).
  double min_move_interval_s = 300.0;

  std::string validate() const;
};

struct engine_move {
  uint32_t engine = 0;
  uint32_t from_bucket = 0;
  uint32_t to_bucket = 0;
};

/// Level 1. Engines start in bucket 0 (short prompts, usually the bulk); rebalance() moves one
/// engine at a time toward each bucket's share of the demand: at once while a bucket is more
/// than a whole engine short, otherwise at most once per min_move_interval_s. A bucket with
/// demand is never starved: while it owns no engine its requests borrow the nearest bucket's
/// engines, and its demand wins it an engine.
class bucket_allocator {
 public:
  bucket_allocator(bucket_config cfg, uint32_t num_engines);

  uint32_t num_buckets() const { return static_cast<uint32_t>(cfg_.upper_bounds_tokens.size() + 1); }
  uint32_t bucket_of(uint64_t prompt_tokens) const;
  /// Counts `cost_us` of predicted work against `bucket` at time `now_s`.
  void record_demand(uint32_t bucket, double cost_us, double now_s);
  /// The bucket's decayed demand at `now_s` (predicted microseconds).
  double demand(uint32_t bucket, double now_s) const;
  /// Moves at most one engine toward the demand shares; returns it.
  std::optional<engine_move> rebalance(double now_s);
  /// The pool grew or shrank (elastic P/D moved a rank): engines keep their buckets by index,
  /// the highest-numbered leave first, and each new one joins the bucket furthest below its share
  /// of the demand, which is kept. Engines are numbered in registration order; a known leaver
  /// goes through remove_engine first, so resize only ever drops engines it cannot name.
  void resize(uint32_t num_engines, double now_s);
  /// Engine `engine` left (its rank was forgotten: elastic P/D moved it, or its node left): the
  /// engines after it take its number's place and keep their own buckets.
  void remove_engine(uint32_t engine);
  /// Engines of `bucket`, or (when it owns none) of the nearest bucket that owns some; sets
  /// `*borrowed` accordingly. Empty when there are no engines at all.
  const std::vector<uint32_t>& engines_for(uint32_t bucket, bool* borrowed = nullptr) const;
  /// The same, counting only engines that pass `usable`: a bucket whose engines are all
  /// unavailable (draining, their ranks gone) lends nothing, and its prompts borrow from the
  /// nearest bucket that can take them instead of waiting for engines that will not come.
  std::vector<uint32_t> usable_engines_for(uint32_t bucket, const std::function<bool(uint32_t)>& usable,
                                           bool* borrowed = nullptr) const;
  const std::vector<uint32_t>& engine_buckets() const { return engine_bucket_; }
  std::vector<uint32_t> engine_counts() const;

 private:
  bucket_config cfg_;
  std::vector<uint32_t> engine_bucket_;
  std::vector<std::vector<uint32_t>> bucket_engines_;  ///< kept in step with engine_bucket_
  std::vector<double> demand_;
  std::vector<double> demand_at_s_;
  double last_move_s_ = -1e300;
};

/// Level 2-3 inputs: what each prefill rank reported, grouped by engine.
struct prefill_rank_view {
  double predicted_us = 0.0;  ///< predicted time of the work queued on the rank
  bool available = true;
};
struct prefill_engine_view {
  double quota_us = 0.0;  ///< compute the engine can absorb per scheduling window
  std::vector<prefill_rank_view> ranks;
  double remaining_quota_us() const;
};

struct prefill_decision {
  uint32_t bucket = 0;
  bool borrowed = false;        ///< the bucket owned no engine; a neighbour's was used
  /// The bucket's engines all had work queued, and an idle engine of a longer-prompt bucket
  /// took the prompt instead (place_prefill: the buckets keep long prompts off short ones'
  /// engines, not idle engines from waiting prompts).
  bool idle_lent = false;
  /// ... and that engine was a shorter-prompt bucket's: a long prompt that would wait longer than
  /// it computes takes an idle engine of a bucket that keeps another idle one (place_prefill).
  bool lent_by_shorter = false;
  uint32_t engine = 0;
  uint32_t rank = 0;            ///< index within the engine
  double predicted_us = 0.0;    ///< cost(q, c) of this request
  double engine_remaining_quota_us = 0.0;
  double rank_predicted_us = 0.0;  ///< the chosen rank's load before this request
  /// The choice in words, the rank by its name (`rank` is its index within the engine).
  std::string explain(std::string_view rank_name) const;
};

/// Levels 1-3 for a prompt of q new tokens after c cached ones. nullopt when no engine of the
/// (possibly borrowed) bucket has an available rank. Work-conserving: when the chosen rank has
/// work queued and an engine of a longer-prompt bucket is idle (every available rank of it
/// predicts nothing), that engine takes the prompt; failing that, when the prompt would wait
/// longer than it computes, an idle engine of a shorter-prompt bucket that keeps another idle
/// one for its own prompts takes it (on the Mooncake trace the long-prompt engines queued
/// minutes while the short ones idled at 40-70%). A short prompt delays a long one that
/// arrives meanwhile by little; the buckets exist so that long prompts do not hold up short
/// ones, and partitioned engines otherwise left idle while prompts queue (at low load, the
/// buckets' demand estimate lags) cost more than the seed's isolation gains.
std::optional<prefill_decision> place_prefill(const bucket_allocator& buckets,
                                              const std::vector<prefill_engine_view>& engines,
                                              const cost_model& model, uint64_t q, uint64_t c);

/// Level 4 across an engine: given each rank's head prompt (remaining new tokens, context
/// already computed), the chunk each rank runs this step. Every chunk is the largest that fits
/// `budget_us`, so every rank's step has (nearly) the same predicted time.
struct rank_head {
  uint64_t remaining = 0;
  uint64_t context = 0;
};
std::vector<uint64_t> engine_step_chunks(const cost_model& m, const std::vector<rank_head>& heads, double budget_us);

}  // namespace baton::policies
