#pragma once

#include "actors/config.hpp"
#include "actors/messages.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// Places each sequence on a decode rank with room for its KV under the configured policy: by
/// default the seed's 2D rule (short contexts to few running sequences, long ones to a small KV
/// total; policies/decode_placement.hpp), or least_loaded, round_robin. Loads come from the
/// ranks' reports plus the balancer's own placements since each rank's last report. Every
/// decision is explained in the placement and kept in a bounded log (`events`). The config must
/// validate.
decode_balancer_actor spawn_decode_balancer(caf::actor_system& sys, decode_balancer_config cfg = {},
                                            store_info store = {});

}  // namespace baton
