#include "actors/prefill_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/rank_registry.hpp"
#include "policies/placement.hpp"

namespace baton {

namespace {

struct prefill_balancer_state {
  rank_registry<prefill_rank_actor> registry;
  static inline const char* name = "baton.prefill_balancer";
};

using pointer = prefill_balancer_actor::stateful_pointer<prefill_balancer_state>;

prefill_balancer_actor::behavior_type prefill_balancer_impl(pointer self) {
  return {
      [=](place_atom, uint64_t request_id, uint32_t num_tokens) -> caf::result<prefill_placement> {
        auto& st = self->state;
        std::vector<policies::prefill_rank_load> loads;
        for (const auto& r : st.registry.loads) loads.push_back({r.queued_tokens, r.num_running, true});
        auto pick = policies::least_loaded_prefill(loads);
        if (!pick)
          return make_error(errc::rank_unavailable,
                            where(request_id, "", "place_prefill") + ": no prefill rank has registered");
        auto& r = st.registry.loads[*pick];
        r.queued_tokens += num_tokens;  // until the rank's next report
        r.num_running += 1;
        return prefill_placement{r.name, st.registry.ranks[*pick]};
      },
      [=](load_atom, rank_load& load, prefill_rank_actor& rank) { self->state.registry.report(std::move(load), std::move(rank)); },
      [=](stats_atom) { return self->state.registry.loads; },
  };
}

}  // namespace

prefill_balancer_actor spawn_prefill_balancer(caf::actor_system& sys) { return sys.spawn(prefill_balancer_impl); }

}  // namespace baton
