#include "actors/decode_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/rank_registry.hpp"
#include "policies/placement.hpp"

namespace baton {

namespace {

struct decode_balancer_state {
  uint32_t page_size_tokens = 16;
  rank_registry<decode_rank_actor> registry;
  static inline const char* name = "baton.decode_balancer";
};

using pointer = decode_balancer_actor::stateful_pointer<decode_balancer_state>;

decode_balancer_actor::behavior_type decode_balancer_impl(pointer self, uint32_t page_size_tokens) {
  self->state.page_size_tokens = page_size_tokens;
  return {
      [=](place_atom, uint64_t request_id, uint32_t num_tokens) -> caf::result<decode_placement> {
        auto& st = self->state;
        const uint32_t pages = (num_tokens + st.page_size_tokens - 1) / st.page_size_tokens;
        std::vector<policies::decode_rank_load> loads;
        for (const auto& r : st.registry.loads) loads.push_back({r.num_running, r.num_free_pages, r.num_total_pages, true});
        auto pick = policies::least_loaded_decode(loads, pages);
        if (!pick) {
          uint32_t most_free = 0;
          for (const auto& r : st.registry.loads) most_free = std::max(most_free, r.num_free_pages);
          return make_error(errc::kv_capacity, where(request_id, "", "place_decode") + ": needs " +
                                                   std::to_string(pages) + " KV pages, the freest of " +
                                                   std::to_string(st.registry.loads.size()) + " decode ranks has " +
                                                   std::to_string(most_free));
        }
        auto& r = st.registry.loads[*pick];
        r.num_running += 1;  // until the rank's next report
        r.num_free_pages -= pages;
        return decode_placement{r.name, st.registry.ranks[*pick]};
      },
      [=](load_atom, rank_load& load, decode_rank_actor& rank) { self->state.registry.report(std::move(load), std::move(rank)); },
      [=](stats_atom) { return self->state.registry.loads; },
  };
}

}  // namespace

decode_balancer_actor spawn_decode_balancer(caf::actor_system& sys, uint32_t page_size_tokens) {
  return sys.spawn(decode_balancer_impl, page_size_tokens);
}

}  // namespace baton
