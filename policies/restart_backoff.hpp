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
};

}  // namespace baton::policies
