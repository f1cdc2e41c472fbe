#pragma once

#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// Places each sequence on the decode rank with the fewest running sequences that has room for
/// its KV pages (policies::least_loaded_decode), from the loads ranks report, plus its own
/// placements since each rank's last report.
decode_balancer_actor spawn_decode_balancer(caf::actor_system& sys, uint32_t page_size_tokens);

}  // namespace baton
