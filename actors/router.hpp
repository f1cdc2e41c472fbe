#pragma once

#include <string>
#include <vector>

#include "actors/config.hpp"
#include "actors/messages.hpp"
#include "gpu/model_config.hpp"

namespace caf {
class actor_system;
}

namespace baton {

template <class Handle>
struct named_rank {
  std::string name;
  Handle handle;
};

/// The cluster's front door: tokenizes and validates requests, places them, and spawns one
/// request actor per request. Bad input is answered with errc::bad_request naming the field;
/// the router itself never stops for it.
router_actor spawn_router(caf::actor_system& sys, router_config cfg, gpu::model_config model,
                          std::vector<named_rank<prefill_rank_actor>> prefill,
                          std::vector<named_rank<decode_rank_actor>> decode);

/// The router's input checks, exposed for tests: fills `tokens` or returns why not.
std::string tokenize_and_validate(const generate_request& req, const gpu::model_config& model,
                                  uint32_t max_new_tokens_limit, std::vector<int32_t>* tokens);

}  // namespace baton
