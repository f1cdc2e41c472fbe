#pragma once

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// Places each prompt on the least-loaded prefill rank (policies::least_loaded_prefill) from the
/// loads ranks report. Between two reports of a rank it adds the prompts it sent there itself, so
/// a burst spreads instead of piling onto the rank that looked idle.
prefill_balancer_actor spawn_prefill_balancer(caf::actor_system& sys);

}  // namespace baton
