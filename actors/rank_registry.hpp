#pragma once

#include <deque>
#include <string>
#include <vector>

#include <caf/typed_response_promise.hpp>

#include "actors/messages.hpp"

namespace baton {

/// The balancers' view of their ranks: handles and the last load each reported, in the order
/// the ranks first reported (index i of both vectors is the same rank).
template <class Handle>
struct rank_registry {
  std::vector<Handle> ranks;
  std::vector<rank_load> loads;

  /// A report replaces the rank's previous one (including the balancer's own placements since).
  void report(rank_load load, Handle rank) {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == rank) {
        loads[i] = std::move(load);
        return;
      }
    ranks.push_back(std::move(rank));
    loads.push_back(std::move(load));
  }
};

/// A placement request waiting for a rank that can take it.
template <class Placement>
struct parked_placement {
  place_query query;
  caf::typed_response_promise<Placement> promise;
};

/// Serves parked placements, oldest first, while `try_place(query)` finds a rank.
template <class Placement, class TryPlace>
void serve_parked(std::deque<parked_placement<Placement>>& parked, TryPlace try_place) {
  while (!parked.empty()) {
    auto placed = try_place(parked.front().query);
    if (!placed) return;
    parked.front().promise.deliver(std::move(*placed));
    parked.pop_front();
  }
}

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

}  // namespace baton
