#pragma once

#include <memory>

#include "actors/config.hpp"
#include "actors/messages.hpp"
#include "actors/store_access.hpp"

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
/// between steps. Reports its load to `balancer` (if any) after every change. With a store, a
/// finished sequence's full blocks (prompt and output) are written back asynchronously with the
/// request's retention class; steps never wait for it, and a full write queue drops (counted).
decode_rank_actor spawn_decode_rank(caf::actor_system& sys, decode_rank_config cfg,
                                    std::shared_ptr<gpu::executor> exec,
                                    std::shared_ptr<transport::transport> xport,
                                    decode_balancer_actor balancer = {}, store_access store = {});

}  // namespace baton
