#pragma once

#include <vector>

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

}  // namespace baton
