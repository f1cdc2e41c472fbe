#pragma once

// Elastic P/D (issue 15): the actor that moves elastic ranks between prefill and decode as the
// load shifts. Every interval it asks every active rank for its stats, hands the signals to the
// role planner (policies/role_planner.hpp), and carries out a move: the rank's balancer stops
// placing on it (drain), the rank finishes its work, goes on standby (its prefix tier's pages
// back to the executor's pool), its balancer forgets it, and the same instance's actor of the
// other role -- on the same executor and weights -- becomes active and reports its load. One
// move at a time; every move is logged with the planner's reason.

#include <string>
#include <vector>

#include "actors/config.hpp"
#include "actors/messages.hpp"
#include "policies/role_planner.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// One instance that can serve either role: its two actors share one executor.
struct elastic_instance {
  std::string name;
  prefill_rank_actor prefill;
  decode_rank_actor decode;
  bool serves_prefill = false;  ///< its role at start
};

elastic_controller_actor spawn_elastic_controller(caf::actor_system& sys, elastic_controller_config cfg,
                                                  std::vector<elastic_instance> elastic,
                                                  std::vector<prefill_rank_actor> fixed_prefill,
                                                  std::vector<decode_rank_actor> fixed_decode,
                                                  prefill_balancer_actor prefill_balancer,
                                                  decode_balancer_actor decode_balancer);

}  // namespace baton
