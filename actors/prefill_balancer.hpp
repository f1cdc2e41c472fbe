#pragma once

#include "actors/config.hpp"
#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// Places each prompt on a prefill rank under the configured policy (policies/): by default the
/// seed's four levels (length bucket -> engine with the most remaining compute quota -> rank
/// with the least predicted load; the rank sizes chunks by time budget itself), or
/// least_loaded, round_robin, cache_affinity. Between two reports of a rank it adds the
/// prompts it sent there itself, so a burst spreads instead of piling onto the rank that looked
/// idle. Every decision is explained in the placement and kept in a bounded log (`events`).
/// The config must validate.
prefill_balancer_actor spawn_prefill_balancer(caf::actor_system& sys, prefill_balancer_config cfg = {});

}  // namespace baton
