#pragma once

// How long `baton launch --restart-failed` waits before it starts a failed node again. A pure
// policy: the caller passes the times it measured.

#include <algorithm>
#include <cstdint>

namespace baton::policies {

struct restart_backoff {
  uint32_t base_ms = 500;     ///< the first wait, and the wait after a run that had settled (0: never wait)
  uint32_t max_ms = 30000;    ///< waits double up to this
  uint64_t settled_ms = 60000;  ///< a run at least this long was not part of a crash loop
  /// A run at least this long gives the node its restarts back (0: never): a cluster that
  /// serves for months loses a node now and then, and `--restart-failed 3` means three failures
  /// in a row, not three in its life (Kubernetes forgets a crash loop after ten minutes too).
  uint64_t forgive_ms = 600000;

  /// The wait before the next start of a node whose run of `ran_ms` just failed, when the wait
  /// before that run was `previous_ms` (0: it had not been restarted). A node that crashes
  /// at once, again and again, waits 0.5, 1, 2, ... s, so its restarts are not spent in a
  /// second and a passing cause (a port not yet free, a head restarting, a full disk being
  /// cleaned) has time to clear; one that served a while is restarted as quickly as at first.
  uint32_t next_delay_ms(uint32_t previous_ms, uint64_t ran_ms) const {
    if (base_ms == 0) return 0;
    if (previous_ms == 0 || ran_ms >= settled_ms) return std::min(base_ms, max_ms);
    return static_cast<uint32_t>(std::min<uint64_t>(uint64_t{previous_ms} * 2, max_ms));
  }

  /// The restarts a node whose run of `ran_ms` just failed has used, `used` before that run.
  uint32_t restarts_used(uint32_t used, uint64_t ran_ms) const { return forgive_ms && ran_ms >= forgive_ms ? 0 : used; }
};

/// How long a request waits before it is placed again after a retryable failure. Without a
/// pause, a retry placed at once may land on the rank that just failed -- its balancer has not
/// yet heard that it went down or stepped aside -- and spend the request's attempts in
/// milliseconds. Waits double per attempt; each is stretched by up to half again by a hash of
/// the request, so requests that failed together do not all come back together.
struct retry_backoff {
  uint32_t base_ms = 50;   ///< before the second attempt (0: never wait)
  uint32_t max_ms = 1000;  ///< the doubling stops here (the stretch still spreads the waits)

  /// The wait before attempt `attempt` (1 = the first retry) of request `request_id`.
  uint32_t delay_ms(uint32_t attempt, uint64_t request_id) const {
    if (base_ms == 0 || attempt == 0) return 0;
    const uint64_t doubled = std::min<uint64_t>(uint64_t{base_ms} << std::min<uint32_t>(attempt - 1, 20), max_ms);
    uint64_t z = request_id * 0x9E3779B97F4A7C15ull + attempt;  // splitmix64's finaliser: a spread, not a secret
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<uint32_t>(doubled + doubled * (z % 512) / 1024);  // [1, 1.5) x, past the cap too
  }
};

}  // namespace baton::policies
