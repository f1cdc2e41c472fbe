#pragma once

#include <string>
#include <vector>

#include "actors/config.hpp"
#include "actors/messages.hpp"
#include "actors/store_access.hpp"
#include "gpu/model_config.hpp"

namespace caf {
class actor_system;
}

namespace baton {

/// The cluster's front door: tokenizes and validates requests and spawns one request actor per
/// request, which asks the balancers for placement. Bad input is answered with
/// errc::bad_request naming the field; the router itself never stops for it.
router_actor spawn_router(caf::actor_system& sys, router_config cfg, gpu::model_config model,
                          prefill_balancer_actor prefill, decode_balancer_actor decode, store_access store = {});

/// The router's input checks, exposed for tests: fills `tokens` or returns why not.
/// A max_tokens of 0 becomes what the context leaves after the prompt (at most the limit, and at
/// most default_max_tokens unless that is 0). `thinking`, when given, gets
/// completion::prompt_thinking.
std::string tokenize_and_validate(generate_request& req, const gpu::model_config& model,
                                  uint32_t max_new_tokens_limit, std::vector<int32_t>* tokens,
                                  const gpu::tokenizer* tokenizer = nullptr, uint32_t default_max_tokens = 0,
                                  uint8_t* thinking = nullptr);

}  // namespace baton
