#pragma once

#include <algorithm>
#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace baton {

/// A balancer's own placements on each rank (by name) that no load report has counted yet. A
/// placement counts as its rank's load at once, so a burst spreads instead of piling onto the
/// rank that looked idle; a report names the placements it counts (reported()), and only their
/// charges go. One
/// whose sequence never reached the rank (its request failed or gave up between placement and
/// order) would otherwise stay charged to an idle rank -- ranks report only on change -- for
/// ever, so charges older than a limit are taken back. `Charge` has a `time_point at`.
template <class Charge, class TimePoint>
class charge_ledger {
public:
  void add(const std::string& rank, Charge c) { by_rank_[rank].push_back(std::move(c)); }

  /// The rank reported, naming the placements it settled since its last report (`settled`:
  /// request ids, one per placement). Their charges go, the oldest charge of an id per mention:
  /// two attempts of one request placed on the same rank are two charges, and the first one's
  /// settling used to drop both. The others' placements are still on their way, which the
  /// report does not count, so each is applied again on top of it -- reapply(charge&), oldest
  /// first -- rather than wiped (a burst would pile onto a rank whose reports kept saying it
  /// was empty). `Charge` has a `uint64_t request_id`.
  template <class Reapply>
  void reported(const std::string& rank, const std::vector<uint64_t>& settled, Reapply reapply) {
    auto it = by_rank_.find(rank);
    if (it == by_rank_.end()) return;
    auto& q = it->second;
    for (const uint64_t id : settled)
      if (auto c = std::find_if(q.begin(), q.end(), [&](const Charge& x) { return x.request_id == id; }); c != q.end())
        q.erase(c);
    for (auto& c : q) reapply(c);
    if (q.empty()) by_rank_.erase(it);
  }

  /// The placements of request `id`'s attempt `attempt` will never reach their ranks: it gave
  /// up between placement and order (its client left, another hop failed). Their charges go now
  /// (every part of a split), through take_back(rank, charge), not a whole TTL later; the count
  /// is returned (0: a report settled them, or they expired). Another attempt's charges stay: a
  /// rank's report settles those by request id. `Charge` has a `uint32_t attempt`.
  template <class TakeBack>
  size_t cancel(uint64_t id, uint32_t attempt, TakeBack take_back) {
    size_t n = 0;
    for (auto it = by_rank_.begin(); it != by_rank_.end();) {
      auto& q = it->second;
      for (auto c = q.begin(); c != q.end();) {
        if (c->request_id != id || c->attempt != attempt) {
          ++c;
          continue;
        }
        take_back(it->first, *c);
        c = q.erase(c);
        ++n;
      }
      it = q.empty() ? by_rank_.erase(it) : std::next(it);
    }
    return n;
  }

  /// Rank `rank` is gone: its charges go with it (a new process under its name reports its own
  /// load; the old one's placements, whose reservations met a dead rank, never settle).
  void forget(const std::string& rank) { by_rank_.erase(rank); }

  /// Calls take_back(rank, charge) for every charge placed at or before `oldest`, oldest first,
  /// and then done(rank, count) once per rank that lost any; forgets them.
  template <class TakeBack, class Done>
  void expire(TimePoint oldest, TakeBack take_back, Done done) {
    for (auto it = by_rank_.begin(); it != by_rank_.end();) {
      auto& q = it->second;
      size_t n = 0;
      for (; !q.empty() && q.front().at <= oldest; ++n, q.pop_front()) take_back(it->first, q.front());
      if (n > 0) done(it->first, n);
      it = q.empty() ? by_rank_.erase(it) : std::next(it);
    }
  }

  bool empty() const { return by_rank_.empty(); }

  /// When the oldest charge was placed (empty(): none).
  TimePoint oldest() const {
    TimePoint out = TimePoint::max();
    for (const auto& [rank, q] : by_rank_)
      if (!q.empty()) out = std::min(out, q.front().at);
    return out;
  }

  /// The owner's timer that expires charges (one at a time): the wait until the oldest charge
  /// expires, when the timer should be set now -- it is `wanted` (placements are parked), not
  /// yet set, and there are charges -- else nothing. timer_fired() when it goes off.
  template <class Duration>
  std::optional<Duration> arm_timer(TimePoint now, Duration ttl, bool wanted) {
    if (timer_armed_ || !wanted || empty()) return std::nullopt;
    timer_armed_ = true;
    return std::max<Duration>(Duration{1}, std::chrono::ceil<Duration>(oldest() + ttl - now));
  }
  void timer_fired() { timer_armed_ = false; }

private:
  bool timer_armed_ = false;
  std::unordered_map<std::string, std::deque<Charge>> by_rank_;
};

}  // namespace baton
