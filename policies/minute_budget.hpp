#pragma once

// A caller's budget per minute (an API key's requests_per_minute, tokens_per_minute), as a token
// bucket: the budget refills evenly over a minute, and at most a minute's worth is held, so a
// caller idle for a while may spend a minute's budget in a burst, never more. A pure policy: the
// caller passes the time (seconds on a monotonic clock) it measured.
//
// Requests are charged as they start; tokens when the answer ends, as its usage counts them (not
// known before: a prompt's tokens are the router's, an answer's length the model's). A budget can
// therefore go below zero; calls then wait until it has refilled above zero -- a caller that
// spent twice its minute waits two.

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace baton::policies {

struct minute_budget {
  double per_minute = 0;  ///< 0: no limit
  double level = 0;       ///< what may still be spent, as of `at_s` (below zero: overspent)
  double at_s = 0;

  /// A budget of `per_minute`, full at `now_s`.
  static minute_budget full(double per_minute, double now_s) { return {per_minute, per_minute, now_s}; }

  /// The level at `now_s`: refilled at per_minute / 60 a second, up to per_minute.
  double level_at(double now_s) const {
    if (per_minute <= 0) return 0;
    return std::min(per_minute, level + std::max(0.0, now_s - at_s) * per_minute / 60.0);
  }

  /// Whether a call may start at `now_s`, spending `cost` (1 for a request; 0 to ask only
  /// whether the budget is above zero). If not, nothing is spent and *wait_s says how long until
  /// it may. No limit: always.
  bool admit(double now_s, double cost, double* wait_s) {
    if (per_minute <= 0) return true;
    const double now = level_at(now_s);
    const double need = cost > 0 ? std::min(cost, per_minute) : std::nextafter(0.0, 1.0);
    if (now >= need) {
      level = now - cost;
      at_s = std::max(at_s, now_s);
      return true;
    }
    *wait_s = (need - now) * 60.0 / per_minute;
    return false;
  }

  /// Spends `amount` at `now_s`, below zero if need be (tokens counted once an answer ends).
  void charge(double now_s, double amount) {
    if (per_minute <= 0) return;
    level = level_at(now_s) - amount;
    at_s = std::max(at_s, now_s);
  }

  /// A new budget (the keys file read again): the level is kept (capped at the new budget); a
  /// budget newly set starts full, one removed is no limit.
  void set_rate(double new_per_minute, double now_s) {
    if (new_per_minute == per_minute) return;
    const double was = per_minute > 0 ? level_at(now_s) : new_per_minute;
    per_minute = new_per_minute;
    level = std::min(was, new_per_minute);
    at_s = now_s;
  }
};

}  // namespace baton::policies
