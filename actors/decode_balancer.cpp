#include "actors/decode_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <deque>

#include "actors/rank_registry.hpp"
#include "policies/placement.hpp"

#include <algorithm>
#include <optional>

namespace baton {

namespace {

struct decode_balancer_state {
  uint32_t page_size_tokens = 16;
  rank_registry<decode_rank_actor> registry;
  /// Placements that found no rank (none registered yet, or none with room): retried, oldest
  /// first, after every load report. The requester's place deadline bounds the wait.
  std::deque<parked_placement<decode_placement>> parked;
  static inline const char* name = "baton.decode_balancer";
};

using pointer = decode_balancer_actor::stateful_pointer<decode_balancer_state>;

/// The least-loaded rank with room for `num_tokens`, counted as its load until its next report.
std::optional<decode_placement> try_place(pointer self, uint32_t num_tokens) {
  auto& st = self->state;
  const uint32_t pages = (num_tokens + st.page_size_tokens - 1) / st.page_size_tokens;
  std::vector<policies::decode_rank_load> loads;
  for (const auto& r : st.registry.loads) loads.push_back({r.num_running, r.num_free_pages, r.num_total_pages, true});
  auto pick = policies::least_loaded_decode(loads, pages);
  if (!pick) return std::nullopt;
  auto& r = st.registry.loads[*pick];
  r.num_running += 1;
  r.num_free_pages -= pages;
  return decode_placement{r.name, st.registry.ranks[*pick]};
}

decode_balancer_actor::behavior_type decode_balancer_impl(pointer self, uint32_t page_size_tokens) {
  self->state.page_size_tokens = page_size_tokens;
  return {
      [=](place_atom, uint64_t request_id, uint32_t num_tokens) -> caf::result<decode_placement> {
        auto& st = self->state;
        const uint32_t pages = (num_tokens + st.page_size_tokens - 1) / st.page_size_tokens;
        uint32_t largest = 0;
        for (const auto& r : st.registry.loads) largest = std::max(largest, r.num_total_pages);
        if (!st.registry.loads.empty() && pages > largest)
          return make_error(errc::kv_capacity, where(request_id, "", "place_decode") + ": needs " +
                                                   std::to_string(pages) + " KV pages, the largest decode rank has " +
                                                   std::to_string(largest) + " in all");
        if (auto p = try_place(self, num_tokens)) return std::move(*p);
        auto promise = self->make_response_promise<decode_placement>();
        st.parked.push_back({request_id, num_tokens, promise});
        return promise;
      },
      [=](load_atom, rank_load& load, decode_rank_actor& rank) {
        auto& st = self->state;
        st.registry.report(std::move(load), std::move(rank));
        serve_parked(st.parked, [=](uint32_t num_tokens) { return try_place(self, num_tokens); });
      },
      [=](stats_atom) { return self->state.registry.loads; },
  };
}

}  // namespace

decode_balancer_actor spawn_decode_balancer(caf::actor_system& sys, uint32_t page_size_tokens) {
  return sys.spawn(decode_balancer_impl, page_size_tokens);
}

}  // namespace baton
