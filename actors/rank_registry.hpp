#pragma once

#include <deque>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_addr.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_clock.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/messages.hpp"

namespace baton {

/// The balancers' bounded record of recent decisions (`events` answers with it).
struct decision_log {
  std::deque<placement_record> records;
  size_t capacity = 256;
  void add(placement_record r) {
    records.push_back(std::move(r));
    while (records.size() > capacity) records.pop_front();
  }
  std::vector<placement_record> snapshot() const { return {records.begin(), records.end()}; }
};

/// The balancers' view of their ranks: handles and the last load each reported, in the order
/// the ranks first reported (index i of both vectors is the same rank).
template <class Handle>
struct rank_registry {
  std::vector<Handle> ranks;
  std::vector<rank_load> loads;
  std::vector<bool> draining;  ///< takes no new work; finishes what it has

  /// Whether rank i takes new work: not draining, and its last report named no standing failure.
  bool open(size_t i) const { return !draining[i] && loads[i].unavailable.empty(); }

  /// A report replaces the rank's previous one (including the balancer's own placements since).
  /// True when the rank is new (the caller monitors it). A rank stepping aside (its report names
  /// why it takes no work) or back is written to `log`.
  bool report(rank_load load, Handle rank, decision_log& log) {
    auto i = index_of(rank);
    const std::string before = i ? loads[*i].unavailable : std::string{};
    if (load.unavailable != before)
      log.add({0, load.name, load.unavailable.empty() ? "takes work again" : "steps aside: " + load.unavailable});
    if (i) {
      loads[*i] = std::move(load);
      return false;
    }
    ranks.push_back(std::move(rank));
    loads.push_back(std::move(load));
    draining.push_back(false);
    return true;
  }
  /// A rank that went down (its process ended, it drained) is forgotten.
  void forget(const caf::actor_addr& addr) {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (caf::actor_cast<caf::actor_addr>(ranks[i]) == addr) {
        ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(i));
        loads.erase(loads.begin() + static_cast<std::ptrdiff_t>(i));
        draining.erase(draining.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }
  std::optional<size_t> index_of(const Handle& rank) const {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == rank) return i;
    return std::nullopt;
  }
};

inline constexpr uint32_t parked_wait_default_ms = 5000;

/// A placement request waiting for a rank that can take it, until `deadline`.
template <class Placement>
struct parked_placement {
  place_query query;
  caf::typed_response_promise<Placement> promise;
  caf::actor_clock::time_point deadline;
};

/// Parks `q` (no rank has room now) until its asker's wait runs out.
template <class Placement>
void park(std::deque<parked_placement<Placement>>& parked, place_query q,
          caf::typed_response_promise<Placement> promise, caf::actor_clock::time_point now) {
  const auto wait = std::chrono::milliseconds{q.wait_ms ? q.wait_ms : parked_wait_default_ms};
  parked.push_back({std::move(q), std::move(promise), now + wait});
}

/// Answers the placements whose asker has stopped waiting (deadline_exceeded, which it no
/// longer hears) and drops them: served later they would charge a rank with load nobody brings,
/// and during an outage the queue would grow with every retry. Returns how many.
template <class Placement>
size_t drop_expired(std::deque<parked_placement<Placement>>& parked, caf::actor_clock::time_point now,
                    const char* stage) {
  size_t n = 0;
  for (auto i = parked.begin(); i != parked.end();) {
    if (i->deadline > now) {
      ++i;
      continue;
    }
    i->promise.deliver(make_error(errc::deadline_exceeded, where(i->query.request_id, "", stage) +
                                                               ": no rank had room while the request waited"));
    i = parked.erase(i);
    ++n;
  }
  return n;
}

/// Serves parked placements, oldest first, while `try_place(query)` finds a rank; those whose
/// asker has stopped waiting are dropped first.
template <class Placement, class TryPlace>
void serve_parked(std::deque<parked_placement<Placement>>& parked, caf::actor_clock::time_point now,
                  const char* stage, TryPlace try_place) {
  drop_expired(parked, now, stage);
  while (!parked.empty()) {
    auto placed = try_place(parked.front().query);
    if (!placed) return;
    parked.front().promise.deliver(std::move(*placed));
    parked.pop_front();
  }
}

}  // namespace baton
