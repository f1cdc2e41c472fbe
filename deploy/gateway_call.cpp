#include "deploy/gateway_call.hpp"

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "deploy/openai.hpp"

namespace baton::deploy {

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

namespace {

/// A request actor found already ended when its sink's monitor reached it waited on for its
/// answer (gateway_config::unanswered_grace_ms, run_choice).
using grace_atom = caf::atom_constant<caf::atom("grace")>;

/// What a call's go-between keeps: the parsed request, and its choices' answers. With n > 1
/// the choices run on actors of their own, so the answers are kept under a lock.
struct call_state {
  openai::call call;
  std::string id;
  int64_t created = 0;
  std::mutex mutex;
  std::vector<completion> done;  ///< by choice
  uint32_t left = 0;             ///< choices not yet answered
  bool failed = false;           ///< an error went to the connection: nothing more does
  std::chrono::milliseconds unanswered_grace{0};  ///< call_settings'
  api_key_ptr key;          ///< the API key that asked (null: none), whose usage the answer adds to
  in_flight_hold in_flight;  ///< its generations, held against the key's max_in_flight until its answer or failure goes out (or its go-between ends)
  /// Tokens its chunks carried so far (each prompt once, as usage counts it; every generated one):
  /// what a call that fails or is cut short spends of its key's tokens_per_minute.
  std::atomic<uint64_t> tokens_seen{0};
  std::atomic<uint64_t> generated_seen{0};  ///< of those, generated ones: a failed call's count in /metrics
  std::atomic<bool> tokens_charged{false};  ///< the key's budget has been charged (once)

  /// Charges the key's tokens_per_minute with what this call computed, once: its usage at its
  /// answer, or what its chunks carried when it fails or its client goes.
  void charge_key(uint64_t tokens) {
    if (key && !tokens_charged.exchange(true)) key->charge_tokens(tokens);
  }
};

/// Choice `index` of a call: asks the router for it with `self` as the sink, renders its chunks,
/// and records its answer; the last choice to be answered sends the call's answer. Each choice
/// sends its last chunk before its answer is recorded, so the call's answer (sent after) reaches
/// the connection after every chunk of every choice (local sends keep causal order).
client_sink_actor::behavior_type run_choice(client_sink_actor::pointer self, caf::actor broker, uint64_t seq,
                                            router_actor router, std::shared_ptr<call_state> cs, uint32_t index) {
  auto req = cs->call.choice_request(index);
  // Ends the call with `e`, once for all its choices: the connection ends the call, and the
  // other choices stop.
  auto fail = [=](caf::error e) {
    {
      std::lock_guard<std::mutex> lock{cs->mutex};
      if (std::exchange(cs->failed, true)) return;
    }
    cs->charge_key(cs->tokens_seen.load());  // (before its hold ends: the key's next call sees it)
    cs->in_flight.release();  // before the failure goes out: the key's next call may come at once
    // Refused by the cluster before any work (full, or stopping): not the key's call to count.
    if (cs->key && e.category() == caf::atom("baton") &&
        (static_cast<errc>(e.code()) == errc::overloaded || static_cast<errc>(e.code()) == errc::shutting_down))
      cs->key->refund_request();
    caf::anon_send(broker, seq, std::move(e), cs->generated_seen.load());
  };
  // Read by the grace timer below, on another actor's thread.
  auto answered = std::make_shared<std::atomic<bool>>(false);
  // No real deadline on the whole call: the connection bounds the wait for the first token, the
  // request actor each next one. A request actor that ended without an answer is seen by its
  // down message (monitored from its first chunk on). The day is a backstop, not caf::infinite:
  // with CAF 0.17.6, n > 1 choices each requesting with an infinite timeout stalled all but one
  // of them (measured here; the finite one does not).
  self->set_down_handler([=](caf::down_msg& m) {
    if (*answered) return;
    // The link to its process went: the head crashed, or was cut off.
    const bool head_gone = m.reason == caf::exit_reason::remote_link_unreachable;
    const std::string what = head_gone ? "the cluster's head went away before answering" : "the request ended without an answer";
    auto why = make_error(head_gone ? errc::router_unavailable : errc::rank_unavailable,
                          what + (m.reason ? ": " + self->system().render(m.reason) : std::string{}));
    if (m.reason != caf::exit_reason::unknown) return fail(std::move(why));
    // exit_reason::unknown: the request actor had already ended when this node's proxy of it was
    // announced to its node (on its first chunk) -- a short request can send its last chunk and
    // its answer first. CAF 0.17's BASP answers that announcement (kill_proxy) from its I/O
    // handler, ahead of the answer still queued in its broker for the wire, so this down can
    // overtake the answer (seen in CI: an echo of 16 tokens failed with 503). The answer, if the
    // actor sent one, is right behind: fail only if it has not come within the grace.
    self->system().spawn([=](caf::event_based_actor* timer) -> caf::behavior {
      timer->delayed_send(timer, cs->unanswered_grace, grace_atom::value);
      return {[=](grace_atom) {
        if (!*answered) fail(why);
        timer->quit();
      }};
    });
  });
  self->request(router, std::chrono::seconds{24 * 3600}, generate_atom::value, std::move(req), caf::actor_cast<client_sink_actor>(self))
      .then(
          [=](completion& done) {
            *answered = true;
            std::unique_lock<std::mutex> lock{cs->mutex};
            if (cs->failed) return;
            cs->done[index] = std::move(done);
            if (--cs->left > 0) return;
            const auto& c = cs->call;
            std::string json = !c.stream         ? openai::completion_json(c, cs->done, cs->id, cs->created)
                               : c.include_usage ? openai::usage_chunk_json(c, cs->done, cs->id, cs->created)
                                                 : std::string{};
            if (cs->key) {  // the key's usage, as the answer's says; its generations end before the answer goes
              const auto u = openai::usage_counts(cs->done, c.n, c.req.prompt_only);
              cs->key->prompt_tokens += u.prompt, cs->key->completion_tokens += u.generated, cs->key->cached_tokens += u.cached;
              cs->charge_key(u.prompt + u.generated);  // (no tokens_per_minute: nothing)
              cs->in_flight.release();
            }
            // The gateway's metrics count each choice: a generation of its own.
            std::vector<completion> all = std::move(cs->done);
            lock.unlock();
            caf::anon_send(broker, seq, std::move(all), std::move(json), c.stream);
          },
          [=](caf::error& e) {
            *answered = true;
            // A batch's refused prompt: the router's sentence names the token and its position,
            // not which of the call's prompts it is in.
            if (cs->call.num_prompts() > 1 && e.category() == caf::atom("baton") &&
                static_cast<errc>(e.code()) == errc::bad_request && e.context().match_elements<std::string>() &&
                e.context().get_as<std::string>(0).find("stage admission: prompt") != std::string::npos)
              e = make_error(errc::bad_request, e.context().get_as<std::string>(0) + " (in prompt " +
                                                    std::to_string(index / cs->call.n) + " of the batch, counted from 0)");
            fail(std::move(e));
          });
  auto first_chunk = std::make_shared<bool>(true);
  auto text_offset = std::make_shared<uint64_t>(0);  // bytes of the streamed tokens' texts (logprobs.text_offset)
  auto monitored = std::make_shared<bool>(false);
  auto token_told = std::make_shared<bool>(false);
  // Reasoning and tool calls, as asked: made at the first chunk, which says whether the prompt
  // opened <think>.
  auto reader = std::make_shared<std::optional<openai::answer_reader>>();
  auto prompt_counted = std::make_shared<bool>(false);
  return {[=](stream_chunk& c) {
    // What a call cut short spends of its key's tokens_per_minute: each prompt once (its first
    // choice's), every generated token.
    uint64_t seen = c.tokens.size();
    if (!*prompt_counted && index % std::max<uint32_t>(1, cs->call.n) == 0) seen += c.num_prompt_tokens;
    *prompt_counted = true;
    cs->tokens_seen += seen;
    cs->generated_seen += c.tokens.size();
    if (!*monitored) {
      *monitored = true;
      if (auto from = self->current_sender()) self->monitor(from);
      caf::anon_send(broker, seq, token_seen_atom::value);
    }
    // TTFT at the first generated token, not the first chunk: a scoring call's one chunk (echo,
    // max_tokens 0) holds none, and its prefill is no TTFT (lm-eval runs would skew the histogram).
    if (!*token_told && !c.tokens.empty() && !cs->call.req.prompt_only) {  // (prompt_only: the token is dropped)
      *token_told = true;
      caf::anon_send(broker, seq, first_token_atom::value, c.request_id);
    }
    if (!cs->call.stream) return;
    // Nothing new to say (e.g. half a UTF-8 character held back, and no log-probabilities asked
    // for): no event.
    const bool echo = !c.prompt_text.empty() || !c.prompt_logprobs.empty();
    std::optional<openai::answer_parts> split;
    if (!*reader) reader->emplace(cs->call, c.prompt_thinking);
    if ((*reader)->active()) split = (*reader)->feed(c.text, !c.finish_reason.empty());
    const bool has_text =
        split ? !split->reasoning.empty() || !split->content.empty() || !split->tool_calls.empty() : !c.text.empty();
    const bool shown = !cs->call.req.prompt_only && (has_text || !c.logprobs.empty());  // echo alone: none is
    if (*first_chunk && cs->call.chat) {
      // A chat stream's first event carries the role alone (and empty content), as OpenAI's and
      // vLLM's do: clients that take that event for the role do not lose text with it.
      caf::anon_send(broker, seq,
                     openai::chunk_json(cs->call, stream_chunk{}, cs->id, cs->created, true, *text_offset, index, nullptr));
      *first_chunk = false;
    }
    if (!shown && c.finish_reason.empty() && !echo) return;
    caf::anon_send(broker, seq, openai::chunk_json(cs->call, c, cs->id, cs->created, *first_chunk, *text_offset, index,
                                                   split ? &*split : nullptr));
    for (const auto& t : c.prompt_logprobs) *text_offset += openai::utf8_chars(t.text);
    if (!cs->call.req.prompt_only)
      for (const auto& t : c.logprobs) *text_offset += openai::utf8_chars(t.text);
    *first_chunk = false;
  }};
}

/// Holds the call to its API key's limits: its generations against max_in_flight, the call
/// against its per-minute budgets (false and the error otherwise; *retry_after_ms for a 429 that
/// knows its wait), its priority batch when the key's calls all are.
bool hold_for_key(const api_key_ptr& key, uint32_t choices, call_state* cs, openai::api_error* err,
                  uint32_t* retry_after_ms) {
  cs->key = key;
  if (key->batch) cs->call.req.priority = "batch";
  const uint32_t limit = key->max_in_flight.load();
  const std::string whose = "the API key '" + key->cfg.name + "'";
  if (const uint32_t cap = key->max_tokens.load()) {
    auto& req = cs->call.req;
    if (cs->call.max_tokens_given && req.max_tokens > 0 && static_cast<uint32_t>(req.max_tokens) > cap) {
      *err = {400, "max_tokens " + std::to_string(req.max_tokens) + " exceeds " + whose + "'s limit of " + std::to_string(cap),
              "invalid_request_error", "max_tokens"};
      return false;
    }
    if (!cs->call.max_tokens_given && req.max_tokens == 0) req.max_tokens_cap = cap;  // chat: the rest of the context, within it
    else if (!cs->call.max_tokens_given) req.max_tokens = std::min<int32_t>(req.max_tokens, static_cast<int32_t>(cap));
  }
  if (limit && choices > limit) {  // never admitted: a 429 would have the client retry for ever
    const bool batch = cs->call.num_prompts() > 1;
    *err = {400,
            std::string{batch ? "prompt" : "n"} + ": this call asks for " + std::to_string(choices) + " generations (" +
                (batch ? "prompts x n" : "n, or best_of") + "), more than " + whose + " may run at once (" +
                std::to_string(limit) + ", its max_in_flight)",
            "invalid_request_error", batch ? "prompt" : "n"};
    return false;
  }
  uint32_t had = 0;
  if (cs->in_flight.take(key, choices, &had)) {
    std::string why, budget;
    if (key->admit_call(&why, &budget, retry_after_ms)) return true;
    cs->in_flight.release();
    *err = {429, why, budget, {}, "rate_limit_exceeded"};  // (OpenAI's type: the budget spent)
    return false;
  }
  // Its own limit, not the cluster's: the other keys' calls go on (OpenAI's code for a caller's
  // rate limit).
  *err = {429,
          whose + " has " + std::to_string(had) + " generations in flight at this gateway, its limit is " +
              std::to_string(limit) + " (max_in_flight); this call asks for " + std::to_string(choices) +
              " more: retry when some have ended",
          "requests", {}, "rate_limit_exceeded"};
  return false;
}

/// The go-between (spawn_call).
client_sink_actor::behavior_type call_impl(client_sink_actor::pointer self, caf::actor broker, uint64_t seq,
                                           router_actor router, std::string body, bool chat, std::string model,
                                           std::string id, call_settings settings, api_key_ptr key) {
  auto cs = std::make_shared<call_state>();
  cs->unanswered_grace = settings.unanswered_grace;
  openai::api_error err;
  if (!openai::parse_body(body, chat, model, &cs->call, &err, settings.model_aliases)) {
    caf::anon_send(broker, seq, static_cast<int32_t>(err.status), openai::error_json(err), err.message, uint32_t{0});
    return {[](stream_chunk&) {}};  // the connection answers and ends this actor
  }
  // Sampling fields the body left out: the model's defaults (its generation_config.json).
  auto& req = cs->call.req;
  if (!cs->call.temperature_given) req.temperature = settings.default_temperature;
  if (!cs->call.top_p_given) req.top_p = settings.default_top_p;
  if (!cs->call.top_k_given) req.top_k = settings.default_top_k;
  // (Not on a scoring call: its one picked token is dropped, and a penalty costs the fast pick.)
  if (!cs->call.repetition_penalty_given && !req.prompt_only) req.repetition_penalty = settings.default_repetition_penalty;
  if (!cs->call.seeded) {
    // No seed in the body: one of this call's own, or every call of a prompt at a temperature
    // would draw the same text (choices i of n still draw with seed + i).
    thread_local std::mt19937_64 draw{std::random_device{}()};
    cs->call.req.seed = draw();
  }
  cs->call.separate_reasoning = chat && settings.chat_reasoning != 0 && cs->call.reasoning_wanted;
  // tool_choice "none" shows the tools to a template that knows them, and to one that does not
  // asks nothing (the router refuses tools only to a model whose answers could not call them).
  if (cs->call.tool_choice_none && settings.chat_tool_calls == static_cast<uint8_t>(gpu::tool_call_format::none))
    cs->call.req.tools_json.clear();
  if (chat && !cs->call.req.tools_json.empty() && !cs->call.tool_choice_none &&
      settings.chat_tool_calls <= gpu::max_tool_call_format)
    cs->call.tool_calls = static_cast<gpu::tool_call_format>(settings.chat_tool_calls);
  cs->id = std::move(id);
  cs->created = unix_seconds();
  const uint32_t choices = cs->call.num_choices();
  if (settings.max_active_requests && choices > settings.max_active_requests) {
    // Each generation is a request of its own at the router: more than it admits at once could
    // never all be admitted, and a 429 would have a client retry for ever.
    const bool batch = cs->call.num_prompts() > 1;
    err = {400,
           std::string{batch ? "prompt" : "n"} + ": this call asks for " + std::to_string(choices) +
               " generations (" + (batch ? "prompts x n" : "n, or best_of") + "), more than the cluster runs at once (" +
               std::to_string(settings.max_active_requests) + ", --max-active-requests): ask for at most that many",
           "invalid_request_error", batch ? "prompt" : "n"};
    caf::anon_send(broker, seq, static_cast<int32_t>(err.status), openai::error_json(err), err.message, uint32_t{0});
    return {[](stream_chunk&) {}};
  }
  if (uint32_t retry_after_ms = 0; key && !hold_for_key(key, choices, cs.get(), &err, &retry_after_ms)) {
    caf::anon_send(broker, seq, static_cast<int32_t>(err.status), openai::error_json(err), err.message, retry_after_ms);
    return {[](stream_chunk&) {}};
  }
  // A call cut short (the client gone, a timeout) ends here: its generations end with it, not
  // when the last reference to its state goes (a grace timer may hold one for seconds).
  if (key)
    self->attach_functor([cs] {
      cs->charge_key(cs->tokens_seen.load());  // a call cut short (its client gone): what it computed
      cs->in_flight.release();
    });
  cs->left = choices;
  cs->done.resize(choices);
  if (cs->call.stream) caf::anon_send(broker, seq, streaming_atom::value);
  if (choices == 1) return run_choice(self, broker, seq, router, cs, 0);
  for (uint32_t i = 0; i < choices; ++i) self->spawn<caf::linked>(run_choice, broker, seq, router, cs, i);
  return {[](stream_chunk&) {}};  // the choices' sinks are their own actors
}

}  // namespace

caf::actor spawn_call(caf::actor_system& sys, caf::actor broker, uint64_t seq, router_actor router, std::string body,
                      bool chat, std::string model, std::string id, call_settings settings, api_key_ptr key) {
  return caf::actor_cast<caf::actor>(sys.spawn(call_impl, std::move(broker), seq, std::move(router), std::move(body), chat,
                                               std::move(model), std::move(id), std::move(settings), std::move(key)));
}

}  // namespace baton::deploy
