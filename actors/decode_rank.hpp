#pragma once

#include <memory>

#include "actors/config.hpp"
#include "actors/messages.hpp"

namespace caf {
class actor_system;
}
namespace baton::gpu {
class executor;
}
namespace baton::transport {
class transport;
}

namespace baton {

/// A decode rank: leases KV pages to incoming requests, waits for their layers to land, and
/// runs them in a continuous batch, one token per request per step: sequences join and leave
/// between steps. Reports its load to `balancer` (if any) after every change.
decode_rank_actor spawn_decode_rank(caf::actor_system& sys, decode_rank_config cfg,
                                    std::shared_ptr<gpu::executor> exec,
                                    std::shared_ptr<transport::transport> xport,
                                    decode_balancer_actor balancer = {});

}  // namespace baton
