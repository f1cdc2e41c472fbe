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

/// A prefill rank: loads a prompt's cached prefix from the block store (verified end to end; a
/// failed block and everything after it is recomputed), runs the rest in chunks on its
/// executor, and ships each layer's KV into the decode rank's leased pages as soon as that layer
/// is computed. Reports its load to `balancer` (if any) after every change.
prefill_rank_actor spawn_prefill_rank(caf::actor_system& sys, prefill_rank_config cfg,
                                      std::shared_ptr<gpu::executor> exec,
                                      std::shared_ptr<transport::transport> xport,
                                      prefill_balancer_actor balancer = {}, store_access store = {});

}  // namespace baton
