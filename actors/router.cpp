#include "actors/router.hpp"

#include <algorithm>
#include <atomic>
#include <optional>
#include <cmath>
#include <cstdio>
#include <thread>
#include <unordered_map>

#include <caf/actor_system.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/request.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/json_schema_grammar.hpp"

namespace baton {

namespace {

/// logit_bias: as many values as tokens, each token in the vocabulary and named once, each value
/// in [-100, 100] (OpenAI's range), at most 1024 of them.
std::string check_logit_bias(const generate_request& req, uint32_t vocab_size) {
  const auto& tokens = req.logit_bias_tokens;
  if (tokens.size() != req.logit_bias_values.size())
    return "logit_bias has " + std::to_string(tokens.size()) + " tokens but " + std::to_string(req.logit_bias_values.size()) +
           " values";
  if (tokens.size() > max_logit_bias)
    return "logit_bias names " + std::to_string(tokens.size()) + " tokens; at most " + std::to_string(max_logit_bias);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab_size)
      return "logit_bias token " + std::to_string(tokens[i]) + " is outside the vocabulary [0, " + std::to_string(vocab_size) +
             ")";
    const float v = req.logit_bias_values[i];
    if (!std::isfinite(v) || std::abs(v) > 100.0f) {
      char got[32];
      std::snprintf(got, sizeof got, "%g", static_cast<double>(v));
      return "logit_bias of token " + std::to_string(tokens[i]) + " must be a number in [-100, 100], got " + got;
    }
  }
  auto sorted = tokens;
  std::sort(sorted.begin(), sorted.end());
  if (auto d = std::adjacent_find(sorted.begin(), sorted.end()); d != sorted.end())
    return "logit_bias names token " + std::to_string(*d) + " twice";
  return {};
}

/// Constrained decoding's fields agree with each other: a known kind, a spec exactly for the
/// kinds that read one, compact JSON only for JSON. Cheap; the grammar itself is compiled once
/// the prompt is known (compile_output_format).
std::string check_output_format(const generate_request& req) {
  using gpu::output_format;
  if (req.output_format > gpu::max_output_format)
    return "output_format must be 0 (free text), 1 (a JSON object), 2 (JSON matching a schema), 3 (text matching a "
           "regular expression) or 4 (text a GBNF grammar derives), got " + std::to_string(req.output_format);
  const auto kind = static_cast<output_format>(req.output_format);
  const bool reads_spec = kind == output_format::schema || kind == output_format::regex || kind == output_format::gbnf;
  if (reads_spec && req.output_spec.empty())
    return "output_format " + std::to_string(req.output_format) + " needs output_spec: the " +
           (kind == output_format::schema ? "JSON schema's" : kind == output_format::regex ? "regular expression's"
                                                                                           : "GBNF grammar's") +
           " text";
  if (!reads_spec && !req.output_spec.empty())
    return "output_spec is given, but output_format is " + std::to_string(req.output_format) + " (" +
           (kind == output_format::free ? "free text" : "any JSON object") + "), which reads none";
  if (req.json_compact && kind != output_format::object && kind != output_format::schema)
    return std::string("json_compact asks for JSON without whitespace, but the answer is ") +
           (kind == output_format::free    ? "free text"
            : kind == output_format::regex ? "text matching a regular expression (write the spaces it allows into it)"
                                           : "text a GBNF grammar derives (write the spaces it allows into it)");
  return {};
}

/// The answer's grammar compiles (its sentence names the keyword and where it is, the
/// expression's offset, or the grammar's line). Compiled as the ranks will follow it, after the
/// thinking block when the prompt opens one, so the ranks of this process find it in the cache.
std::string compile_output_format(const generate_request& req, uint8_t thinking) {
  if (req.output_format == 0) return {};
  std::string why;
  if (!gpu::cached_output_grammar(static_cast<gpu::output_format>(req.output_format), req.output_spec,
                                  {.after_thinking = thinking == 1, .compact = req.json_compact}, &why))
    return why;
  return {};
}

}  // namespace

namespace {

/// A number as a person writes it (0.5, 1e+06), not std::to_string's %f (1000000.000000).
std::string shown(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.7g", static_cast<double>(x));
  return buf;
}

/// One form of prompt, and one only.
std::string prompt_form_problem(const generate_request& req) {
  const int given = !req.prompt.empty() + !req.prompt_tokens.empty() + !req.messages.empty();
  if (given > 1) return "give one of prompt, prompt_tokens or messages, not several";
  if (given == 0) return "prompt is empty";
  return {};
}

}  // namespace

std::string encode_prompt(const generate_request& req, const gpu::model_config& model, const gpu::tokenizer* tokenizer,
                          std::vector<int32_t>* tokens, uint8_t* thinking, bool allow_empty) {
  // (/tokenize counts an empty prompt: its begin-of-text token alone, or nothing, as vLLM does.)
  const bool empty = req.prompt.empty() && req.prompt_tokens.empty() && req.messages.empty();
  if (auto why = prompt_form_problem(req); !why.empty() && !(allow_empty && empty)) return why;
  if (req.add_special_tokens < -1 || req.add_special_tokens > 1)
    return "add_special_tokens must be true or false, got " + std::to_string(req.add_special_tokens);
  if (!req.prompt_tokens.empty()) {
    for (size_t i = 0; i < req.prompt_tokens.size(); ++i) {
      const auto t = req.prompt_tokens[i];
      if (t < 0 || static_cast<uint32_t>(t) >= model.vocab_size)
        return "prompt token " + std::to_string(t) + " at position " + std::to_string(i) +
               " is outside the vocabulary [0, " + std::to_string(model.vocab_size) + ")";
    }
    *tokens = req.prompt_tokens;
  } else if (!req.messages.empty()) {
    if (!tokenizer) return "messages need the model's chat template; this router has none";
    std::vector<gpu::chat_message> chat;
    for (const auto& m : req.messages) chat.push_back({m.role, m.content, m.fields_json});
    std::string text, why;
    // Rendered first: a model with no chat template at all is told as such, not as one whose
    // template writes no tool calls.
    if (!tokenizer->render_chat(chat, gpu::chat_extras{req.chat_template_kwargs, req.tools_json}, &text, &why)) return why;
    // A constrained answer (a forced call: tool_choice "required" or a named function) is JSON
    // the gateway reads back, in no template's form: any model serves it, as vLLM's guided
    // decoding does. A free answer's calls must come in a form the reader knows.
    if (!req.tools_json.empty() && req.output_format == 0 && tokenizer->tool_calls() == gpu::tool_call_format::none)
      return "tools need a model whose chat template asks for tool calls in a form Baton reads (Qwen's and Hermes' "
             "<tool_call> JSON, Qwen3-Coder's <function=...> XML, Llama 3.1's JSON answer, Mistral's [TOOL_CALLS], "
             "DeepSeek's or Kimi-K2's tool-call tokens), unless the answer is constrained (a forced call: "
             "tool_choice \"required\" or a named function; or a response_format); this model's does not";
    // Whether this chat's answer starts thinking: the request's own template variables decide
    // (DeepSeek-V3.1's `thinking`), not only the model's default.
    if (thinking && tokenizer->reasoning() != gpu::chat_reasoning::none) *thinking = gpu::opens_thinking(text) ? 1 : 2;
    *tokens = tokenizer->encode_chat(text);
  } else if (tokenizer) {
    *tokens = tokenizer->encode_prompt(req.prompt);
  } else {
    *tokens = gpu::byte_tokenizer{model.bos_token_id, model.eos_token_id}.encode(req.prompt);
  }
  // add_special_tokens against the default: a text prompt's begin-of-text token left out, a
  // chat's added before its template's text (as transformers' encode does; ids given are as given).
  const int32_t bos = tokenizer ? tokenizer->bos_id() : model.bos_token_id;  // the one encoding puts first
  const bool has_bos = bos >= 0 && !tokens->empty() && tokens->front() == bos;
  if (req.prompt_tokens.empty() && bos >= 0) {
    const bool chat = !req.messages.empty();
    if (req.add_special_tokens == 0 && !chat && has_bos) tokens->erase(tokens->begin());
    if (req.add_special_tokens == 1 && chat) tokens->insert(tokens->begin(), bos);
  }
  // A tokenizer without BOS can turn text (whitespace under a stripping normalizer) into nothing;
  // a prompt needs one token whose logits give the first output.
  if (tokens->empty() && !allow_empty) return "prompt encodes to no tokens; send at least one";
  return {};
}

std::string tokenize_and_validate(generate_request& req, const gpu::model_config& model,
                                  uint32_t max_new_tokens_limit, std::vector<int32_t>* tokens,
                                  const gpu::tokenizer* tokenizer, uint32_t default_max_tokens, uint8_t* thinking) {
  if (auto why = prompt_form_problem(req); !why.empty()) return why;
  if (req.top_p <= 0.0f || req.top_p > 1.0f || !std::isfinite(req.top_p))
    return "top_p must be in (0, 1], got " + shown(req.top_p);
  if (req.repetition_penalty <= 0.0f || !std::isfinite(req.repetition_penalty))
    return "repetition_penalty must be > 0, got " + shown(req.repetition_penalty);
  if (!std::isfinite(req.presence_penalty) || std::abs(req.presence_penalty) > 100.0f)
    return "presence_penalty must be a finite number in [-100, 100], got " + shown(req.presence_penalty);
  if (!std::isfinite(req.frequency_penalty) || std::abs(req.frequency_penalty) > 100.0f)
    return "frequency_penalty must be a finite number in [-100, 100], got " + shown(req.frequency_penalty);
  if (!(req.min_p >= 0.0f && req.min_p <= 1.0f)) return "min_p must be in [0, 1], got " + shown(req.min_p);
  if (req.top_logprobs > gpu::max_top_logprobs)
    return "top_logprobs must be at most " + std::to_string(gpu::max_top_logprobs) + ", got " + std::to_string(req.top_logprobs);
  if (req.top_logprobs > 0 && !req.logprobs && !req.prompt_logprobs) return "top_logprobs needs logprobs or prompt_logprobs";
  if (req.prompt_top_logprobs > gpu::max_top_logprobs)
    return "prompt_top_logprobs must be at most " + std::to_string(gpu::max_top_logprobs) + ", got " +
           std::to_string(req.prompt_top_logprobs);
  if (req.prompt_top_logprobs > 0 && !req.prompt_logprobs) return "prompt_top_logprobs needs prompt_logprobs";
  if (req.stop.size() > 16) return "stop holds " + std::to_string(req.stop.size()) + " strings; at most 16";
  // Each token's check searches the text's tail as long as the longest stop string: bounded.
  for (size_t i = 0; i < req.stop.size(); ++i)
    if (req.stop[i].size() > 1024)
      return "stop string " + std::to_string(i) + " is " + std::to_string(req.stop[i].size()) + " bytes; at most 1024";
  // An empty string would match before every token: the answer would end before it began.
  for (size_t i = 0; i < req.stop.size(); ++i)
    if (req.stop[i].empty()) return "stop string " + std::to_string(i) + " is empty";
  if (req.stop_token_ids.size() > 1024) return "stop_token_ids holds " + std::to_string(req.stop_token_ids.size()) + " ids; at most 1024";
  for (size_t i = 0; i < req.stop_token_ids.size(); ++i)
    if (const auto t = req.stop_token_ids[i]; t < 0 || static_cast<uint32_t>(t) >= model.vocab_size)
      return "stop_token_ids[" + std::to_string(i) + "] is " + std::to_string(t) + ", outside the vocabulary [0, " +
             std::to_string(model.vocab_size) + ")";
  if (auto e = check_logit_bias(req, model.vocab_size); !e.empty()) return e;
  if (auto e = check_output_format(req); !e.empty()) return e;
  // A constrained answer ends where its grammar says: holding its end tokens back could leave
  // no token the grammar allows.
  if (req.min_tokens > 0 && req.output_format != 0)
    return "min_tokens cannot hold back the end of a constrained answer (output_format " +
           std::to_string(req.output_format) + "): its grammar says where it ends";
  const uint32_t ctx = model.max_position_embeddings;
  const uint32_t limit = max_new_tokens_limit ? std::min(max_new_tokens_limit, ctx) : ctx;
  if (req.max_tokens < 0)
    return "max_tokens must be >= 1 (or 0: as many as the context leaves), got " + std::to_string(req.max_tokens);
  if (static_cast<uint32_t>(req.max_tokens) > limit)
    return "max_tokens " + std::to_string(req.max_tokens) + " exceeds the limit of " + std::to_string(limit);
  if (!std::isfinite(req.temperature) || req.temperature < 0.0f)
    return "temperature must be a finite number >= 0, got " + shown(req.temperature);
  if (req.traffic_class != "chat" && req.traffic_class != "agent" && req.traffic_class != "batch")
    return "traffic_class must be chat, agent or batch, got '" + quoted_input(req.traffic_class) + "'";
  if (req.priority != "interactive" && req.priority != "batch")
    return "priority must be interactive or batch, got '" + quoted_input(req.priority) + "'";
  if (auto why = encode_prompt(req, model, tokenizer, tokens, thinking); !why.empty()) return why;
  const bool given_max = req.max_tokens != 0;
  if (req.max_tokens == 0) {  // not given (OpenAI's chat default): the rest of the context, within the limit
    if (tokens->size() >= ctx)
      return "prompt of " + std::to_string(tokens->size()) + " tokens leaves no room in the model's context of " +
             std::to_string(ctx) + " tokens";
    size_t room = std::min<size_t>(ctx - tokens->size(), limit);
    if (default_max_tokens > 0) room = std::min<size_t>(room, default_max_tokens);
    if (req.max_tokens_cap > 0) room = std::min<size_t>(room, req.max_tokens_cap);
    req.max_tokens = static_cast<int32_t>(room);
  }
  if (req.min_tokens > static_cast<uint32_t>(req.max_tokens))
    return "min_tokens " + std::to_string(req.min_tokens) + " exceeds max_tokens " + std::to_string(req.max_tokens) +
           (given_max ? "" : " (the default: what the context leaves after this prompt, within the router's limits)");
  // A prompt-only call's one token is never fed back: it takes no place in the context.
  const bool one_token_only = req.prompt_only && req.max_tokens == 1;
  // A prompt that alone fills the context is the prompt's fault (OpenAI names it the param), one
  // that leaves some room max_tokens' (asking for fewer would do).
  if (tokens->size() + (one_token_only ? 0 : 1) > ctx)
    return "prompt of " + std::to_string(tokens->size()) + " tokens leaves no room in the model's context of " +
           std::to_string(ctx) + " tokens";
  if (tokens->size() + static_cast<size_t>(req.max_tokens) - (one_token_only ? 1 : 0) > ctx)
    return "prompt of " + std::to_string(tokens->size()) + " tokens plus max_tokens " +
           std::to_string(req.max_tokens) + " exceeds the model's context of " + std::to_string(ctx) + " tokens";
  return compile_output_format(req, thinking ? *thinking : 0);
}

namespace {

struct router_state {
  router_config cfg;
  gpu::model_config model;
  std::shared_ptr<const gpu::model_config> shared_model;  ///< the same, for request actors (request_plan::admit)
  std::shared_ptr<request_counters> counters = std::make_shared<request_counters>();  ///< request_plan::counters
  prefill_balancer_actor prefill;
  node_stats_actor directory;  ///< the head's node directory, once told (directory_atom)
  decode_balancer_actor decode;
  store_access store;
  uint64_t last_request = 0;
  /// When this router started (Unix ms): its counters count from then, so a scrape that sees them
  /// fall can tell a restart (cluster_stats::started_unix_ms).
  int64_t started_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  uint64_t num_rejected = 0;
  uint64_t num_overloaded = 0;  ///< of the rejected: refused by admission control
  bool draining = false;        ///< drain_atom: new requests are refused
  uint64_t num_active = 0;  ///< request actors alive (monitored: their down message counts them out)
  std::unordered_map<caf::actor_addr, request_actor> live;  ///< the same, to tell them of lost ranks
  /// Each block server's last answer to stats_atom: a server that stops answering (its store node
  /// died) still counts what it did, or the cluster's counters (bytes written, ...) would go
  /// backwards, which Prometheus reads as a reset.
  std::vector<store_stats> server_stats_seen;
  /// By server id: the counters of its earlier actors (a store node adopted again starts from 0),
  /// so the sums /metrics shows as counters never go back.
  std::vector<store_stats> server_stats_before;
  /// /tokenize and /detokenize workers running (text_worker_for); each lowers it as it ends.
  std::shared_ptr<std::atomic<uint32_t>> text_workers = std::make_shared<std::atomic<uint32_t>>(0);
  static inline const char* name = "baton.router";
};

using router_pointer = router_actor::stateful_pointer<router_state>;

/// Tokenizes or detokenizes one call's text and ends: a long prompt or chat template is worked
/// on its own actor, not on the router's (one thread for the whole cluster's admissions).
using text_worker_actor = caf::typed_actor<caf::replies_to<tokenize_atom, generate_request>::with<std::vector<int32_t>>,
                                           caf::replies_to<detokenize_atom, std::vector<int32_t>>::with<std::string>>;

text_worker_actor::behavior_type text_worker(text_worker_actor::pointer self, std::shared_ptr<const gpu::model_config> model,
                                             std::shared_ptr<const gpu::tokenizer> tokenizer) {
  return {
      [=](tokenize_atom, const generate_request& req) -> caf::result<std::vector<int32_t>> {
        self->quit();
        std::vector<int32_t> tokens;
        if (auto why = encode_prompt(req, *model, tokenizer.get(), &tokens, nullptr, true); !why.empty())
          return make_error(errc::bad_request, "stage tokenize: " + why);
        return tokens;
      },
      [=](detokenize_atom, const std::vector<int32_t>& ids) -> caf::result<std::string> {
        self->quit();
        for (size_t i = 0; i < ids.size(); ++i)
          if (ids[i] < 0 || static_cast<uint32_t>(ids[i]) >= model->vocab_size)
            return make_error(errc::bad_request, "stage detokenize: token " + std::to_string(ids[i]) + " at position " +
                                                     std::to_string(i) + " is outside the vocabulary [0, " +
                                                     std::to_string(model->vocab_size) + ")");
        if (!tokenizer) return gpu::byte_tokenizer{model->bos_token_id, model->eos_token_id}.decode(ids);
        // Special tokens written out, as transformers' decode does by default (vLLM's
        // /detokenize): the ids between them decoded together, so characters split across
        // tokens come out whole.
        std::string text;
        std::vector<int32_t> run;
        for (const auto id : ids) {
          auto special = tokenizer->special_text(id);
          if (special.empty()) {
            run.push_back(id);
            continue;
          }
          text += tokenizer->decode(run) + special;
          run.clear();
        }
        return text + tokenizer->decode(run);
      },
  };
}

template <class Out, class Add, class Done>
void ask_store_servers(router_pointer self, Out out, Add add, Done done, std::chrono::seconds timeout);

/// Adds the store actors' counters (and disk use) of `x` into `t`.
void sum_store_stats(store_stats& t, const store_stats& x) {
  t.blocks += x.blocks, t.checks += x.checks, t.hit_blocks += x.hit_blocks, t.evicted += x.evicted;
  t.expired += x.expired, t.blocks_written += x.blocks_written, t.blocks_read += x.blocks_read;
  t.read_failures += x.read_failures, t.bytes_read += x.bytes_read, t.bytes_written += x.bytes_written;
  t.write_failures += x.write_failures, t.write_no_space += x.write_no_space;
  t.disk_bytes += x.disk_bytes, t.disk_evicted += x.disk_evicted, t.damaged_dropped += x.damaged_dropped;
}

/// Asks both balancers, the node directory and every store actor for their numbers, in parallel; whoever does not
/// answer within a second is left out (the answer is a snapshot, never an error).
/// At most this many /tokenize and /detokenize calls work at once per head: each may encode a
/// long prompt or render a chat on the scheduler's threads, which the head's actors share.
constexpr uint32_t max_text_workers = 64;

/// A worker for one /tokenize or /detokenize call; none while max_text_workers run.
std::optional<text_worker_actor> text_worker_for(router_pointer self) {
  auto count = self->state.text_workers;
  if (count->load() >= max_text_workers) return std::nullopt;
  ++*count;
  auto worker = self->spawn(text_worker, self->state.shared_model, self->state.cfg.tokenizer);
  worker->attach_functor([count] { --*count; });
  return worker;
}

caf::error too_many_text_workers(const char* stage) {
  return make_error(errc::overloaded, std::string{"stage "} + stage + ": " + std::to_string(max_text_workers) +
                                          " calls to /tokenize and /detokenize are in progress at this head; retry "
                                          "after a moment");
}

caf::result<cluster_stats> collect_stats(router_pointer self) {
  auto& s = self->state;
  auto out = std::make_shared<cluster_stats>();
  out->model = s.model.name;
  out->context_tokens = s.model.max_position_embeddings;
  out->chat_reasoning = s.cfg.tokenizer ? static_cast<uint8_t>(s.cfg.tokenizer->reasoning()) : 0;
  out->chat_tool_calls = s.cfg.tokenizer ? static_cast<uint8_t>(s.cfg.tokenizer->tool_calls()) : 0;
  out->default_temperature = s.cfg.default_temperature;
  out->max_active_requests = s.cfg.max_active_requests;
  out->default_top_p = s.cfg.default_top_p;
  out->default_top_k = s.cfg.default_top_k;
  out->default_repetition_penalty = s.cfg.default_repetition_penalty;
  out->started_unix_ms = s.started_unix_ms;
  out->num_admitted = s.counters->admitted.load();
  out->num_failovers = s.counters->failovers.load();
  for (size_t code = 0; code < s.counters->failed.size(); ++code)
    if (const uint64_t n = s.counters->failed[code].load()) {
      out->failed_codes.push_back(to_string(static_cast<errc>(code)));
      out->failed_counts.push_back(n);
    }
  out->num_rejected = s.num_rejected;
  out->num_active = s.num_active;
  out->num_overloaded = s.num_overloaded;
  out->draining = s.draining;
  out->decode_answered = false;  // until it does
  auto rp = self->make_response_promise<cluster_stats>();
  auto left = std::make_shared<size_t>(4 + (s.directory ? 1 : 0) + s.store.index.size() + s.store.servers.size());
  auto done = [rp, out, left]() mutable {
    if (--*left == 0) rp.deliver(*out);
  };
  const auto timeout = std::chrono::seconds{1};
  auto add = [out](const store_stats& x) { sum_store_stats(out->store, x); };
  self->request(s.prefill, timeout, stats_atom::value)
      .then([=](std::vector<rank_load>& l) mutable { out->prefill = std::move(l), done(); },
            [=](caf::error&) mutable { done(); });
  self->request(s.decode, timeout, stats_atom::value)
      .then([=](std::vector<rank_load>& l) mutable { out->decode = std::move(l), out->decode_answered = true, done(); },
            [=](caf::error&) mutable { done(); });
  self->request(s.prefill, timeout, parked_atom::value)
      .then([=](uint32_t n) mutable { out->prefill_parked = n, done(); }, [=](caf::error&) mutable { done(); });
  self->request(s.decode, timeout, parked_atom::value)
      .then([=](uint32_t n) mutable { out->decode_parked = n, done(); }, [=](caf::error&) mutable { done(); });
  if (s.directory)
    self->request(s.directory, timeout, stats_atom::value)
        .then([=](std::vector<node_status>& n) mutable { out->nodes = std::move(n), out->nodes_known = true, done(); },
              [=](caf::error&) mutable { done(); });
  for (const auto& shard : s.store.index)
    self->request(shard, timeout, stats_atom::value)
        .then([=](store_stats& x) mutable { add(x), done(); }, [=](caf::error&) mutable { done(); });
  s.server_stats_seen.resize(s.store.servers.size());
  s.server_stats_before.resize(s.store.servers.size());
  out->store_servers = static_cast<uint32_t>(s.store.servers.size());
  if (s.store.servers.empty()) return rp;
  // The servers as the index knows them now: a store node that came back was adopted again, as
  // a new actor (store_keeper). The ids stay, so the count above holds. Briefly: the servers
  // are asked after this, within the gateway's wait.
  self->request(s.store.index.front(), std::chrono::milliseconds{250}, servers_atom::value)
      .then(
          [=](std::vector<block_server_actor>& now) mutable {
            auto& s = self->state;
            if (now.size() == s.store.servers.size())
              for (size_t i = 0; i < now.size(); ++i) {
                if (now[i] == s.store.servers[i]) continue;
                auto gone = std::exchange(s.server_stats_seen[i], {});
                gone.disk_bytes = 0;  // a gauge: the new actor reports the disk as it finds it
                sum_store_stats(s.server_stats_before[i], gone);
                s.store.servers[i] = std::move(now[i]);
              }
            ask_store_servers(self, out, add, done, timeout);
          },
          [=](caf::error&) mutable { ask_store_servers(self, out, add, done, timeout); });
  return rp;
}

template <class Out, class Add, class Done>
void ask_store_servers(router_pointer self, Out out, Add add, Done done, std::chrono::seconds timeout) {
  auto& s = self->state;
  for (size_t i = 0; i < s.store.servers.size(); ++i)
    self->request(s.store.servers[i], timeout, stats_atom::value)
        .then(
            [=, asked = s.store.servers[i]](store_stats& x) mutable {
              // An answer of an actor replaced meanwhile (an overlapping scrape): its counters
              // are in server_stats_before already -- counted from there, so the sums never dip.
              if (asked != self->state.store.servers[i]) return add(self->state.server_stats_before[i]), done();
              self->state.server_stats_seen[i] = x;
              if (x.refusing_reads == 0) ++out->store_servers_up;  // answering, but serving no read: not up
              add(self->state.server_stats_before[i]), add(x), done();
            },
            [=, asked = s.store.servers[i]](caf::error& e) mutable {
              if (asked != self->state.store.servers[i]) return add(self->state.server_stats_before[i]), done();
              // Its counters as last seen; its disk use too while it may be only slow, none once
              // it is gone (its files serve nobody).
              auto last = self->state.server_stats_seen[i];
              if (e == caf::sec::request_receiver_down) last.disk_bytes = 0;
              add(self->state.server_stats_before[i]), add(last), done();
            });
}

router_actor::behavior_type router_impl(router_pointer self, router_config cfg, gpu::model_config model,
                                        prefill_balancer_actor prefill, decode_balancer_actor decode,
                                        store_access store) {
  auto& st = self->state;
  st.store = std::move(store);
  st.cfg = std::move(cfg);
  st.model = std::move(model);
  st.prefill = std::move(prefill);
  st.decode = std::move(decode);
  st.shared_model = std::make_shared<const gpu::model_config>(st.model);
  self->set_down_handler([=](caf::down_msg& dm) {
    --self->state.num_active;
    self->state.live.erase(dm.source);
    // A request its own actor found malformed (request_plan::admit) ends with that error.
    if (dm.reason && dm.reason.category() == caf::atom("baton") && dm.reason.code() == static_cast<uint8_t>(errc::bad_request))
      ++self->state.num_rejected;
  });
  // Stopped (its process ends, after a drain or at once): the requests still in flight end with
  // it -- they are not linked to it, and one waiting on a remote rank would hold the process's
  // actor system open.
  self->set_exit_handler([=](caf::exit_msg& m) {
    if (!m.reason) return;  // a linked actor's normal end: CAF's default handler ignores it too
    for (const auto& [addr, r] : self->state.live) self->send_exit(r, m.reason);
    self->quit(m.reason);
  });
  auto admit = [=](generate_request& req, client_sink_actor sink) -> caf::result<completion> {
    auto& s = self->state;
    const uint64_t id = ++s.last_request;
    if (s.draining) {
      ++s.num_rejected;
      return make_error(errc::shutting_down, where(id, "", "admission") +
                                                 ": the cluster's head is shutting down; it finishes the requests it "
                                                 "has and takes no new ones");
    }
    if (s.cfg.max_active_requests && s.num_active >= s.cfg.max_active_requests) {
      ++s.num_rejected;
      ++s.num_overloaded;
      return make_error(errc::overloaded, where(id, "", "admission") + ": the cluster has " +
                                              std::to_string(s.num_active) + " requests in flight (every caller's), its limit is " +
                                              std::to_string(s.cfg.max_active_requests) + "; retry after a moment");
    }
    // Tokenized and checked by the request actor itself, in parallel with every other request's:
    // this actor is one thread for the whole cluster (request_plan::admit).
    request_plan plan{id,
                      {},
                      std::move(req),
                      s.prefill,
                      s.decode,
                      s.model.eos_token_id,
                      s.cfg.request,
                      s.store,
                      s.cfg.tokenizer,
                      s.cfg.extra_eos_token_ids,
                      std::move(sink),
                      0,
                      request_plan::admission{s.shared_model, s.cfg.max_new_tokens_limit, s.cfg.default_max_tokens},
                      s.counters};
    auto r = spawn_request(self->system(), std::move(plan));
    self->monitor(r);
    ++s.num_active;
    s.live.emplace(caf::actor_cast<caf::actor_addr>(r), r);
    return self->delegate(r, run_atom::value);
  };
  return {
      [=](generate_atom, generate_request& req) { return admit(req, {}); },
      [=](generate_atom, generate_request& req, client_sink_actor& sink) { return admit(req, std::move(sink)); },
      [=](stats_atom) -> caf::result<cluster_stats> { return collect_stats(self); },
      [](ping_atom) { return true; },
      [=](tokenize_atom, generate_request& req) -> caf::result<std::vector<int32_t>> {
        auto worker = text_worker_for(self);
        if (!worker) return too_many_text_workers("tokenize");
        return self->delegate(*worker, tokenize_atom::value, std::move(req));
      },
      [=](detokenize_atom, std::vector<int32_t>& ids) -> caf::result<std::string> {
        auto worker = text_worker_for(self);
        if (!worker) return too_many_text_workers("detokenize");
        return self->delegate(*worker, detokenize_atom::value, std::move(ids));
      },
      [=](drain_atom) { self->state.draining = true; },
      [=](rank_gone_atom, const std::vector<std::string>& ranks, const std::string& why) {
        for (const auto& [addr, r] : self->state.live) self->send(r, rank_gone_atom::value, ranks, why);
      },
      [=](directory_atom, const node_stats_actor& directory) {
        // Once: the router is published (remote clients may send this too) after its own
        // process told it; none may swap the nodes /metrics and baton status show.
        if (!self->state.directory && self->current_sender() && self->current_sender()->node() == self->node())
          self->state.directory = directory;
      },
  };
}

}  // namespace

router_actor spawn_router(caf::actor_system& sys, router_config cfg, gpu::model_config model,
                          prefill_balancer_actor prefill, decode_balancer_actor decode, store_access store) {
  return sys.spawn(router_impl, std::move(cfg), std::move(model), std::move(prefill), std::move(decode),
                   std::move(store));
}

std::vector<std::string> await_ranks_registered(caf::actor_system& sys, const router_actor& router,
                                                std::vector<std::string> names, std::chrono::milliseconds budget,
                                                const std::function<bool()>& give_up) {
  caf::scoped_actor self{sys};
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (;;) {
    self->request(router, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](const cluster_stats& s) {
              const auto listed = [&](const std::string& n) {
                const auto named = [&](const rank_load& l) { return l.name == n; };
                return std::any_of(s.prefill.begin(), s.prefill.end(), named) ||
                       std::any_of(s.decode.begin(), s.decode.end(), named);
              };
              names.erase(std::remove_if(names.begin(), names.end(), listed), names.end());
            },
            [](caf::error&) {});
    if (names.empty() || std::chrono::steady_clock::now() >= deadline || (give_up && give_up())) return names;
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
}

}  // namespace baton
