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

/// A prefill rank: runs prompts in chunks on its executor and ships each layer's KV into the
/// decode rank's leased pages as soon as that layer is computed. Reports its load to `balancer`
/// (if any) after every change.
prefill_rank_actor spawn_prefill_rank(caf::actor_system& sys, prefill_rank_config cfg,
                                      std::shared_ptr<gpu::executor> exec,
                                      std::shared_ptr<transport::transport> xport,
                                      prefill_balancer_actor balancer = {});

}  // namespace baton
