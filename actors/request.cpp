#include "actors/request.hpp"

#include <caf/actor_system.hpp>
#include <caf/sec.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "gpu/byte_tokenizer.hpp"

namespace baton {

namespace {

struct request_state {
  request_plan plan;
  caf::typed_response_promise<completion> promise;
  completion out;
  caf::actor_clock::time_point started, last_token_at;
  uint64_t lease_id = 0;  ///< 0 = none held
  bool answered = false;
  static inline const char* name = "baton.request";
};

using request_pointer = request_actor::stateful_pointer<request_state>;

int64_t micros(caf::actor_clock::duration_type d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

void answer(request_pointer self, caf::error err) {
  auto& st = self->state;
  if (st.answered) return;
  st.answered = true;
  if (st.lease_id != 0) self->send(st.plan.decode, release_atom::value, st.lease_id);
  st.lease_id = 0;
  if (err)
    st.promise.deliver(std::move(err));
  else {
    st.out.text = gpu::byte_tokenizer{-1, -1}.decode(st.out.tokens);
    st.promise.deliver(std::move(st.out));
  }
  self->quit();
}

/// Turns a failed hop into an error that names request, rank and stage. Errors that ranks
/// produced already carry that context and pass through.
caf::error hop_error(request_pointer self, const caf::error& err, const std::string& rank, const std::string& stage,
                     uint32_t timeout_ms) {
  const auto id = self->state.plan.request_id;
  if (err.category() == caf::atom("baton")) return err;
  if (err == caf::sec::request_timeout)
    return make_error(errc::deadline_exceeded,
                      where(id, rank, stage) + ": no answer within " + std::to_string(timeout_ms) + " ms");
  if (err == caf::sec::request_receiver_down)
    return make_error(errc::rank_unavailable, where(id, rank, stage) + ": rank is down");
  return make_error(errc::rank_unavailable, where(id, rank, stage) + ": " + self->system().render(err));
}

void record_token(request_pointer self, int32_t token, std::vector<float> logits) {
  auto& st = self->state;
  const auto now = self->clock().now();
  if (st.out.tokens.empty())
    st.out.ttft_us = micros(now - st.started);
  else
    st.out.tbt_us.push_back(micros(now - st.last_token_at));
  st.last_token_at = now;
  st.out.tokens.push_back(token);
  if (st.plan.params.return_logits) st.out.step_logits.push_back(std::move(logits));
}

void start_decode(request_pointer self) {
  auto& st = self->state;
  const auto& p = st.plan;
  decode_order order{p.request_id,
                     st.lease_id,
                     st.out.tokens.front(),
                     static_cast<uint32_t>(p.prompt_tokens.size()),
                     static_cast<uint32_t>(p.params.max_tokens - 1),
                     p.params.temperature,
                     p.params.seed,
                     p.params.return_logits,
                     self};
  self->request(p.decode, std::chrono::milliseconds{p.cfg.decode_timeout_ms}, std::move(order))
      .then(
          [=](const decode_summary& s) {
            auto& st = self->state;
            st.lease_id = 0;  // the decode rank freed it
            st.out.finish_reason = s.finish_reason;
            answer(self, caf::error{});
          },
          [=](caf::error& err) {
            auto& p = self->state.plan;
            answer(self, hop_error(self, err, p.decode_name, "decode", p.cfg.decode_timeout_ms));
          });
}

void start_prefill(request_pointer self, kv_lease_grant grant) {
  auto& p = self->state.plan;
  prefill_order order{p.request_id, p.prompt_tokens, p.params.temperature, p.params.seed, p.params.return_logits,
                      std::move(grant), p.decode};
  self->request(p.prefill, std::chrono::milliseconds{p.cfg.prefill_timeout_ms}, std::move(order))
      .then(
          [=](prefill_result& r) {
            auto& st = self->state;
            st.out.prefill_rank = r.rank;
            record_token(self, r.first_token, std::move(r.logits));
            if (r.first_token == st.plan.eos_token_id || st.plan.params.max_tokens == 1) {
              st.out.finish_reason = r.first_token == st.plan.eos_token_id ? "eos" : "length";
              answer(self, caf::error{});  // releases the unused lease
              return;
            }
            start_decode(self);
          },
          [=](caf::error& err) {
            auto& p = self->state.plan;
            answer(self, hop_error(self, err, p.prefill_name, "prefill", p.cfg.prefill_timeout_ms));
          });
}

request_actor::behavior_type request_impl(request_pointer self, request_plan plan) {
  self->state.plan = std::move(plan);
  return {
      [=](run_atom) {
        auto& st = self->state;
        st.promise = self->make_response_promise<completion>();
        st.started = self->clock().now();
        const auto& p = st.plan;
        st.out.request_id = p.request_id;
        st.out.num_prompt_tokens = static_cast<uint32_t>(p.prompt_tokens.size());
        st.out.decode_rank = p.decode_name;
        kv_lease_reserve req{p.request_id, static_cast<uint32_t>(p.prompt_tokens.size() + p.params.max_tokens),
                             p.cfg.lease_ms};
        self->request(p.decode, std::chrono::milliseconds{p.cfg.reserve_timeout_ms}, reserve_atom::value, req)
            .then(
                [=](kv_lease_grant& grant) {
                  self->state.lease_id = grant.lease_id;
                  if (self->state.answered) return answer(self, caf::error{});
                  start_prefill(self, std::move(grant));
                },
                [=](caf::error& err) {
                  auto& p = self->state.plan;
                  answer(self, hop_error(self, err, p.decode_name, "kv_reserve", p.cfg.reserve_timeout_ms));
                });
        return st.promise;
      },
      [=](token_event& ev) { record_token(self, ev.token, std::move(ev.logits)); },
  };
}

}  // namespace

request_actor spawn_request(caf::actor_system& sys, request_plan plan) {
  return sys.spawn(request_impl, std::move(plan));
}

}  // namespace baton
