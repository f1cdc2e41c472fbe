#include "actors/router.hpp"

#include <cmath>

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/request.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton {

std::string tokenize_and_validate(const generate_request& req, const gpu::model_config& model,
                                  uint32_t max_new_tokens_limit, std::vector<int32_t>* tokens) {
  if (!req.prompt.empty() && !req.prompt_tokens.empty()) return "give either prompt or prompt_tokens, not both";
  if (req.prompt.empty() && req.prompt_tokens.empty()) return "prompt is empty";
  const uint32_t ctx = model.max_position_embeddings;
  const uint32_t limit = max_new_tokens_limit ? std::min(max_new_tokens_limit, ctx) : ctx;
  if (req.max_tokens <= 0) return "max_tokens must be >= 1, got " + std::to_string(req.max_tokens);
  if (static_cast<uint32_t>(req.max_tokens) > limit)
    return "max_tokens " + std::to_string(req.max_tokens) + " exceeds the limit of " + std::to_string(limit);
  if (!std::isfinite(req.temperature) || req.temperature < 0.0f)
    return "temperature must be a finite number >= 0, got " + std::to_string(req.temperature);
  if (req.traffic_class != "chat" && req.traffic_class != "agent" && req.traffic_class != "batch")
    return "traffic_class must be chat, agent or batch, got '" + req.traffic_class + "'";
  if (req.priority != "interactive" && req.priority != "batch")
    return "priority must be interactive or batch, got '" + req.priority + "'";
  if (!req.prompt_tokens.empty()) {
    for (size_t i = 0; i < req.prompt_tokens.size(); ++i) {
      const auto t = req.prompt_tokens[i];
      if (t < 0 || static_cast<uint32_t>(t) >= model.vocab_size)
        return "prompt token " + std::to_string(t) + " at position " + std::to_string(i) +
               " is outside the vocabulary [0, " + std::to_string(model.vocab_size) + ")";
    }
    *tokens = req.prompt_tokens;
  } else {
    *tokens = gpu::byte_tokenizer{model.bos_token_id, model.eos_token_id}.encode(req.prompt);
  }
  if (tokens->size() + static_cast<size_t>(req.max_tokens) > ctx)
    return "prompt of " + std::to_string(tokens->size()) + " tokens plus max_tokens " +
           std::to_string(req.max_tokens) + " exceeds the model's context of " + std::to_string(ctx) + " tokens";
  return {};
}

namespace {

struct router_state {
  router_config cfg;
  gpu::model_config model;
  prefill_balancer_actor prefill;
  decode_balancer_actor decode;
  store_access store;
  uint64_t last_request = 0;
  static inline const char* name = "baton.router";
};

using router_pointer = router_actor::stateful_pointer<router_state>;

router_actor::behavior_type router_impl(router_pointer self, router_config cfg, gpu::model_config model,
                                        prefill_balancer_actor prefill, decode_balancer_actor decode,
                                        store_access store) {
  auto& st = self->state;
  st.store = std::move(store);
  st.cfg = std::move(cfg);
  st.model = std::move(model);
  st.prefill = std::move(prefill);
  st.decode = std::move(decode);
  return {
      [=](generate_atom, generate_request& req) -> caf::result<completion> {
        auto& s = self->state;
        const uint64_t id = ++s.last_request;
        std::vector<int32_t> tokens;
        if (auto why = tokenize_and_validate(req, s.model, s.cfg.max_new_tokens_limit, &tokens); !why.empty())
          return make_error(errc::bad_request, where(id, "", "admission") + ": " + why);
        auto r = spawn_request(self->system(), request_plan{id, std::move(tokens), std::move(req), s.prefill,
                                                            s.decode, s.model.eos_token_id, s.cfg.request, s.store});
        return self->delegate(r, run_atom::value);
      },
  };
}

}  // namespace

router_actor spawn_router(caf::actor_system& sys, router_config cfg, gpu::model_config model,
                          prefill_balancer_actor prefill, decode_balancer_actor decode, store_access store) {
  return sys.spawn(router_impl, std::move(cfg), std::move(model), std::move(prefill), std::move(decode),
                   std::move(store));
}

}  // namespace baton
