#pragma once

// Elastic P/D (issue 15; seed 001 §4 "dynamic quota and P/D role conversion", seed 002 "elastic
// PD"): decides when a rank should change role, prefill <-> decode, from live signals: the
// prefill ranks' predicted queue time against the TTFT target, the decode ranks' step time
// against the TBT target and their KV occupancy. A pool's pressure (signal over target,
// averaged over the pool and smoothed over `smooth_s` of time, so a burst is not a trend) is hot
// at or above `hot`, cold at or below `cold`; a rank moves from a cold pool to a hot one only
// after that has held for `hold_s` (hysteresis in time), at most one move per `cooldown_s`
// cluster-wide, never a rank that changed role less than `dwell_s` ago, never below a pool's
// minimum. So it cannot oscillate faster than the dwell time, whatever the load does, and a
// load that flips faster than the smoothing moves nothing.
// Pure: signals and the time in, a decision (with the reason, numbers included) out.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace baton::policies {

enum class rank_role { prefill, decode };
const char* to_string(rank_role r);

struct role_planner_config {
  double ttft_target_ms = 2000;  ///< prefill pressure = predicted queue time / this
  double tbt_target_ms = 100;    ///< decode pressure = max(step time / this, KV used / kv_full)
  double kv_full = 0.9;          ///< KV occupancy that counts as full pressure
  double hot = 0.8;              ///< a pool at or above this pressure needs ranks
  double cold = 0.4;             ///< a pool at or below it can give one
  double smooth_s = 60;          ///< time constant of the pressures' exponential average
  double hold_s = 10;            ///< hot/cold must hold this long before a move
  double cooldown_s = 30;        ///< at most one move per this, cluster-wide
  double dwell_s = 120;          ///< a rank keeps a new role at least this long
  uint32_t min_prefill = 1, min_decode = 1;
  /// How a pool's ranks make its pressure: "mean" (a hot pool, not one hot rank) or "max" (the
  /// most loaded rank: a tail signal, for SLOs judged on their tail).
  std::string pool_signal = "mean";
  std::string validate() const;
};

/// One rank's live signals.
struct rank_signal {
  std::string name;
  rank_role role = rank_role::prefill;
  double predicted_queue_ms = 0;  ///< prefill: the cost model's time for its queued work
  double step_ms = 0;             ///< decode: recent step time
  double kv_used = 0;             ///< decode: fraction of KV pages in use
  uint32_t running = 0;           ///< prompts in progress / sequences decoding
  bool movable = true;            ///< false: a rank that serves one role only (it counts, never moves)
  /// false: it takes no work now (its executor stepped aside): it does not count toward a
  /// pool's minimum, which is about ranks that serve.
  bool open = true;
  /// prefill: the length bucket its engine serves (the prefill balancer's seed policy; 0 for the
  /// others). Buckets split the pool: see role_planner::pressure.
  uint32_t bucket = 0;
};

struct role_move {
  std::string rank;
  rank_role from = rank_role::decode, to = rank_role::prefill;
  std::string why;  ///< the pressures and targets that made the move, and why this rank
};

class role_planner {
public:
  explicit role_planner(role_planner_config cfg) : cfg_(std::move(cfg)) {}

  /// The move to make now, if any. Call it with every rank's signals as they change (or on a
  /// timer); `now_s` only grows. A returned move is taken as done: the rank's dwell starts.
  std::optional<role_move> plan(double now_s, const std::vector<rank_signal>& ranks);

  /// A pool's pressure now (for logs and tests): prefill from queue times, decode from steps and
  /// KV, the mean (or max, pool_signal) over the pool's ranks. plan() smooths it over time.
  /// Prefill ranks in length buckets (seed 000 §3.1) are pools of their own for prompts of their
  /// lengths: with the mean, the prefill pressure is that of the hottest bucket, so a starved
  /// bucket asks for a rank even while the pool's mean is cold. (The bucket allocator trades
  /// engines between buckets by demand share; a bucket still hot after the planner's hold time is
  /// short of capacity, not of its share.) A rank that joins goes to the bucket furthest below its
  /// share of the demand (bucket_allocator::resize).
  double pressure(rank_role pool, const std::vector<rank_signal>& ranks) const;
  /// The smoothed pressures plan() last decided on.
  double smoothed(rank_role pool) const { return pool == rank_role::prefill ? smooth_p_ : smooth_d_; }

private:
  struct bucket_pressure {
    uint32_t bucket = 0;
    double mean = 0;
    uint32_t ranks = 0;
  };
  /// The prefill bucket with the highest mean pressure, and how many buckets have ranks.
  bucket_pressure hottest_bucket(const std::vector<rank_signal>& ranks, uint32_t* num_buckets) const;
  struct changed {
    std::string rank;
    double at_s = 0;
  };
  bool settled(const std::string& rank, double now_s) const;

  role_planner_config cfg_;
  std::optional<double> want_decode_since_, want_prefill_since_;  ///< when each condition began
  std::optional<double> last_move_s_;
  std::optional<double> last_plan_s_;
  double smooth_p_ = 0, smooth_d_ = 0;
  std::vector<changed> changes_;  ///< each rank's last role change
};

}  // namespace baton::policies
