#pragma once

#include <chrono>
#include <functional>
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

/// The prompt of `req` as the model's token ids (its text by `tokenizer`, null: the built-in
/// byte tokenizer; its messages by the chat template), add_special_tokens applied; why not, else
/// empty. `thinking`, when given, gets completion::prompt_thinking. `allow_empty`: no prompt, or
/// one of no tokens, is encoded as such (/tokenize), not refused.
std::string encode_prompt(const generate_request& req, const gpu::model_config& model, const gpu::tokenizer* tokenizer,
                          std::vector<int32_t>* tokens, uint8_t* thinking = nullptr, bool allow_empty = false);

/// The router's input checks, exposed for tests: fills `tokens` or returns why not.
/// A max_tokens of 0 becomes what the context leaves after the prompt (at most the limit, and at
/// most default_max_tokens unless that is 0). `thinking`, when given, gets
/// completion::prompt_thinking.
std::string tokenize_and_validate(generate_request& req, const gpu::model_config& model,
                                  uint32_t max_new_tokens_limit, std::vector<int32_t>* tokens,
                                  const gpu::tokenizer* tokenizer = nullptr, uint32_t default_max_tokens = 0,
                                  uint8_t* thinking = nullptr);

/// Waits, asking the router every 20 ms for at most `budget`, until every rank in `names` has
/// reported its load to its balancer: a rank registers asynchronously once it has started, and a
/// cluster that says it is up before then sends its first requests to whichever registered first.
/// `give_up` (optional) ends the wait early (a child process died, a signal came). Returns the
/// names still unregistered: empty when all are.
std::vector<std::string> await_ranks_registered(caf::actor_system& sys, const router_actor& router,
                                                std::vector<std::string> names, std::chrono::milliseconds budget,
                                                const std::function<bool()>& give_up = {});

}  // namespace baton
