#include "actors/prefill_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <deque>

#include "actors/rank_registry.hpp"
#include "policies/placement.hpp"

#include <optional>

namespace baton {

namespace {

struct prefill_balancer_state {
  rank_registry<prefill_rank_actor> registry;
  /// Placements that found no rank (none registered yet, or none with room): retried, oldest
  /// first, after every load report. The requester's place deadline bounds the wait.
  std::deque<parked_placement<prefill_placement>> parked;
  static inline const char* name = "baton.prefill_balancer";
};

using pointer = prefill_balancer_actor::stateful_pointer<prefill_balancer_state>;

/// The least-loaded rank for `num_tokens` new tokens, counted as its load until its next report.
std::optional<prefill_placement> try_place(pointer self, uint32_t num_tokens) {
  auto& st = self->state;
  std::vector<policies::prefill_rank_load> loads;
  for (const auto& r : st.registry.loads) loads.push_back({r.queued_tokens, r.num_running, true});
  auto pick = policies::least_loaded_prefill(loads);
  if (!pick) return std::nullopt;
  auto& r = st.registry.loads[*pick];
  r.queued_tokens += num_tokens;
  r.num_running += 1;
  return prefill_placement{r.name, st.registry.ranks[*pick]};
}

prefill_balancer_actor::behavior_type prefill_balancer_impl(pointer self) {
  return {
      [=](place_atom, uint64_t request_id, uint32_t num_tokens) -> caf::result<prefill_placement> {
        if (auto p = try_place(self, num_tokens)) return std::move(*p);
        auto promise = self->make_response_promise<prefill_placement>();
        self->state.parked.push_back({request_id, num_tokens, promise});
        return promise;
      },
      [=](load_atom, rank_load& load, prefill_rank_actor& rank) {
        auto& st = self->state;
        st.registry.report(std::move(load), std::move(rank));
        serve_parked(st.parked, [=](uint32_t num_tokens) { return try_place(self, num_tokens); });
      },
      [=](stats_atom) { return self->state.registry.loads; },
  };
}

}  // namespace

prefill_balancer_actor spawn_prefill_balancer(caf::actor_system& sys) { return sys.spawn(prefill_balancer_impl); }

}  // namespace baton
