// Request bodies of /v1/completions and /v1/chat/completions read into a call (openai.hpp):
// every field checked for its type and range, refused by name when wrong.

#include "deploy/openai.hpp"
#include "gpu/text_file.hpp"
#include "deploy/openai_fields.hpp"
#include "deploy/openai_tool_calls_xml.hpp"
#include "gpu/json_schema_grammar.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <span>

#include <nlohmann/json.hpp>

namespace baton::deploy::openai {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

/// A bound for a message: integers without a decimal point.
std::string bound(double x) {
  if (x == std::floor(x) && std::abs(x) < 1e15) return std::to_string(static_cast<int64_t>(x));
  return json(x).dump();
}

/// The upper bound of a count whose real limit the router holds (max_tokens: its
/// max_new_tokens_limit and the model's context; min_tokens: max_tokens). The parser does not
/// know that limit, so a refusal must not quote this bound as if it were the limit.
constexpr double router_limited = std::numeric_limits<int32_t>::max();

/// Reads an optional number field into `dst` within [lo, hi]; false and `err` when wrong.
template <class T>
bool number_field(const json& j, const char* key, double lo, double hi, T* dst, api_error* err) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_number()) {
    *err = bad(key, std::string(key) + " must be a number, got " + describe(*it));
    return false;
  }
  const double v = it->get<double>();
  if (hi == router_limited && v > hi) {  // worded as the router words its own limit
    *err = bad(key, std::string(key) + " " + describe(*it) + " exceeds the server's limit");
    return false;
  }
  if (!std::isfinite(v) || v < lo || v > hi) {
    const std::string range = hi == router_limited ? ">= " + bound(lo) : "in [" + bound(lo) + ", " + bound(hi) + "]";
    *err = bad(key, std::string(key) + " must be " + range + ", got " + describe(*it));
    return false;
  }
  if constexpr (std::is_integral_v<T>) {
    if (v != std::floor(v)) {
      *err = bad(key, std::string(key) + " must be an integer, got " + describe(*it));
      return false;
    }
  }
  *dst = static_cast<T>(v);
  return true;
}

bool string_field(const json& j, const char* key, std::string* dst, api_error* err) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_string()) {
    *err = bad(key, std::string(key) + " must be a string");
    return false;
  }
  *dst = it->get<std::string>();
  return true;
}

bool bool_field(const json& j, const char* key, bool* dst, api_error* err) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_boolean()) {
    *err = bad(key, std::string(key) + " must be true or false");
    return false;
  }
  *dst = it->get<bool>();
  return true;
}

/// A message's content: a string, or an array of {"type":"text","text":...} parts.
bool message_content(const json& m, size_t i, std::string* out, api_error* err) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return true;  // e.g. an assistant turn with tool calls only
  if (it->is_string()) {
    *out = it->get<std::string>();
    return true;
  }
  if (!it->is_array()) {
    *err = bad(param, param + " must be a string or an array of text parts");
    return false;
  }
  // The parts joined by newlines, as vLLM joins them for a text-only template.
  for (size_t k = 0; k < it->size(); ++k) {
    const auto& part = (*it)[k];
    if (!part.is_object() || !type_is(part, "text") || !part.contains("text") || !part["text"].is_string()) {
      *err = bad(param, param + ": only text parts ({\"type\":\"text\",\"text\":...}) are supported");
      return false;
    }
    if (k > 0) *out += "\n";
    *out += part["text"].get<std::string>();
  }
  return true;
}

/// Token ids: non-negative 32-bit integers.
bool token_ids(const json& list, const std::string& param, std::vector<int32_t>* out, api_error* err) {
  for (const auto& t : list) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      *err = bad("prompt", param + " token ids must be non-negative integers");
      return false;
    }
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return true;
}

/// prompt: a string, token ids, or a batch (an array of strings, or of token-id arrays), each
/// prompt of a batch answered by choices of its own (call::batch_texts, batch_tokens).
bool parse_prompt(const json& j, call* c, api_error* err) {
  auto* req = &c->req;
  auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) {
    *err = bad("prompt", "prompt is required");
    return false;
  }
  if (it->is_string()) {
    req->prompt = it->get<std::string>();
    return true;
  }
  if (!it->is_array() || it->empty()) {
    *err = bad("prompt", "prompt must be a string, token ids, or a non-empty array of strings or of token-id arrays");
    return false;
  }
  if (!(*it)[0].is_string() && !(*it)[0].is_array()) return token_ids(*it, "prompt", &req->prompt_tokens, err);
  if (it->size() > max_batch_prompts) {
    *err = bad("prompt", "a batch of " + std::to_string(it->size()) + " prompts; at most " +
                             std::to_string(max_batch_prompts) + " in one call");
    return false;
  }
  const bool texts = (*it)[0].is_string();
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& p = (*it)[i];
    const std::string param = "prompt[" + std::to_string(i) + "]";
    if (texts != p.is_string() || (!texts && (!p.is_array() || p.empty()))) {
      *err = bad("prompt", param + ": a batch holds strings only, or non-empty token-id arrays only");
      return false;
    }
    if (texts) {
      c->batch_texts.push_back(p.get<std::string>());
    } else {
      c->batch_tokens.emplace_back();
      if (!token_ids(p, param, &c->batch_tokens.back(), err)) return false;
    }
  }
  // A batch of one is the plain prompt (OpenAI's ["text"] form).
  if (texts) req->prompt = c->batch_texts[0];
  else req->prompt_tokens = c->batch_tokens[0];
  if (it->size() == 1) c->batch_texts.clear(), c->batch_tokens.clear();
  return true;
}

/// The body's members whose key order matters: a template prints a message's or a tool call's
/// objects in it, and a schema's properties come in it.
constexpr std::string_view ordered_members[] = {"messages", "tools", "response_format", "structured_outputs",
                                                 "guided_json", "json_schema"};
constexpr size_t max_ordered_object_keys = 1024;

/// JSON text parsed in its key order, no object of it holding more than max_ordered_object_keys
/// keys: an ordered object finds each new key by a linear search, so one of n keys costs n^2 / 2
/// comparisons, and an 80,000-key object held the scheduler's threads for seconds, stalling every
/// other call (a red-team trial). With `members`, only those members of the top object are kept
/// (the rest are read past, never built). `too_wide`: some object held more (the value is then
/// not to be used), in the top member `member` (empty: the top object itself).
struct ordered_parse {
  ordered_json value;
  bool too_wide = false;
  std::string member;
};
ordered_parse parse_ordered(std::string_view text, std::span<const std::string_view> members = {}) {
  ordered_parse out;
  // Keys of the object open at each depth. (By depth, not a stack: nlohmann reports the end of
  // a kept object only, and the start of every one.)
  std::vector<size_t> keys;
  bool kept = true;  // the top member being read is kept
  out.value = ordered_json::parse(
      text,
      [&](int depth, ordered_json::parse_event_t event, ordered_json& parsed) {
        using ev = ordered_json::parse_event_t;
        if (event == ev::object_start) {  // reported at the depth outside it
          if (keys.size() <= static_cast<size_t>(depth)) keys.resize(static_cast<size_t>(depth) + 1);
          keys[static_cast<size_t>(depth)] = 0;
        }
        if (event != ev::key) return true;
        if (depth == 1) {
          const auto& key = parsed.get_ref<const std::string&>();
          kept = members.empty() || std::find(members.begin(), members.end(), key) != members.end();
          if (!kept) return false;
          if (!out.too_wide) out.member = key;
        }
        // Counted in what is kept alone (what is not is never built); a duplicate member is kept
        // as built first, so it is counted too.
        if (kept && depth >= 1 && static_cast<size_t>(depth) <= keys.size() &&
            ++keys[static_cast<size_t>(depth) - 1] > max_ordered_object_keys) {
          out.too_wide = true;
          return false;
        }
        return true;
      },
      false);
  if (!out.too_wide) out.member.clear();
  return out;
}

/// An assistant turn's tool_calls for the template: OpenAI's shape, each call's arguments (JSON
/// text on the wire) read into an object, as transformers' templates expect them.
bool turn_tool_calls(const ordered_json& calls, const std::string& param, ordered_json* out, api_error* err) {
  if (!calls.is_array()) {
    *err = bad(param, param + " must be an array of tool calls");
    return false;
  }
  *out = ordered_json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const auto& c = calls[k];
    const std::string at = param + "[" + std::to_string(k) + "]";
    if (!c.is_object() || !c.contains("function") || !c["function"].is_object() || !c["function"].contains("name") ||
        !c["function"]["name"].is_string()) {
      *err = bad(at, at + " must be {id, type: \"function\", function: {name, arguments}}");
      return false;
    }
    ordered_json args = ordered_json::object();
    if (auto a = c["function"].find("arguments"); a != c["function"].end() && !a->is_null()) {
      if (a->is_string()) {
        auto parsed = parse_ordered(a->get_ref<const std::string&>());
        if (parsed.too_wide) {
          *err = bad(at, at + ".function.arguments holds an object of more than " +
                             std::to_string(max_ordered_object_keys) + " keys");
          return false;
        }
        args = std::move(parsed.value);
      } else {
        args = *a;
      }
      // Text that is not JSON -- a call cut by max_tokens, which this gateway answers itself,
      // and an agent sends back -- reaches the template as the string it is, as OpenAI takes it.
      if (args.is_discarded()) args = *a;
    }
    ordered_json call = ordered_json::object();
    if (c.contains("id") && c["id"].is_string()) call["id"] = c["id"];
    call["type"] = "function";
    call["function"] = {{"name", c["function"]["name"]}, {"arguments", std::move(args)}};
    out->push_back(std::move(call));
  }
  return true;
}

/// Messages in their given key order (`body`, ordered): a tool call's arguments reach the
/// template as the client wrote them. `num_tool_calls`: the assistant turns' calls, counted.
bool parse_messages(const json& j, const ordered_json& body, generate_request* req, uint32_t* num_tool_calls,
                    api_error* err) {
  auto it = j.find("messages");
  if (it == j.end() || !it->is_array() || it->empty()) {
    *err = bad("messages", "messages must be a non-empty array of {role, content}");
    return false;
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& m = (*it)[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      *err = bad(param + ".role", param + " must be an object with a string role");
      return false;
    }
    chat_turn turn{m["role"].get<std::string>(), {}, {}};
    if (turn.role == "developer") turn.role = "system";  // OpenAI's newer name for it
    if (turn.role != "system" && turn.role != "user" && turn.role != "assistant" && turn.role != "tool") {
      *err = bad(param + ".role", param + ".role must be system, developer, user, assistant or tool, got '" +
                                      turn.role.substr(0, 32) + "'");
      return false;
    }
    // Content is required, as OpenAI requires it, except in an assistant turn that made tool
    // calls or carries a refusal (null there, as SDKs echo them back):
    // a user turn without it reached the template as nothing said, and passed.
    const auto& role = m["role"].get_ref<const std::string&>();  // as given ("developer" too)
    const auto present = [&](const char* key) {
      return m.contains(key) && !m[key].is_null() && !(m[key].is_array() && m[key].empty());
    };
    // The legacy form of a call, whose answer came in a "function" turn (refused above): taken
    // and dropped, the call vanished from the chat (a trial). Refused by name instead.
    if (present("function_call")) {
      *err = bad(param + ".function_call", param + ".function_call is the legacy form of a call: send it as tool_calls "
                                                   "[{id, type: \"function\", function: {name, arguments}}], answered "
                                                   "by a tool message");
      return false;
    }
    const bool made_calls = present("tool_calls") || present("refusal");
    if ((!m.contains("content") || m["content"].is_null()) && !(role == "assistant" && made_calls)) {
      *err = bad(param + ".content", param + ".content is required for " +
                                         (role == "assistant" ? "an assistant message without tool_calls"
                                                              : "a " + role + " message"));
      return false;
    }
    if (!message_content(m, i, &turn.content, err)) return false;
    ordered_json fields = ordered_json::object();
    if (!m.contains("content") || m["content"].is_null()) fields["content"] = nullptr;  // "is none" in templates
    if (turn.role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      ordered_json calls;
      if (!turn_tool_calls(body["messages"][i]["tool_calls"], param + ".tool_calls", &calls, err)) return false;
      *num_tool_calls += static_cast<uint32_t>(calls.size());
      if (!calls.empty()) fields["tool_calls"] = std::move(calls);
    }
    if (turn.role == "tool") {
      // Which call it answers, as OpenAI requires: templates put it beside the result, and a
      // model given several results cannot tell them apart without it.
      if (!m.contains("tool_call_id") || !m["tool_call_id"].is_string() ||
          m["tool_call_id"].get_ref<const std::string&>().empty()) {
        *err = bad(param + ".tool_call_id", param + ".tool_call_id is required for a tool message: the id of the "
                                                    "assistant's tool call it answers, as a non-empty string");
        return false;
      }
      for (const char* key : {"tool_call_id", "name"})
        if (m.contains(key) && m[key].is_string()) fields[key] = m[key];
    }
    if (!fields.empty()) turn.fields_json = fields.dump();
    req->messages.push_back(std::move(turn));
  }
  return true;
}

/// stop: a string or an array of at most 16 strings.
bool parse_stop(const json& j, generate_request* req, api_error* err) {
  auto it = j.find("stop");
  if (it == j.end() || it->is_null()) return true;
  if (it->is_string()) {
    req->stop.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const auto& s : *it) {
      if (!s.is_string()) {
        *err = bad("stop", "stop must be a string or an array of strings");
        return false;
      }
      req->stop.push_back(s.get<std::string>());
    }
  } else {
    *err = bad("stop", "stop must be a string or an array of strings");
    return false;
  }
  for (const auto& s : req->stop)
    if (s.empty()) {
      *err = bad("stop", "stop strings must not be empty");
      return false;
    }
  return true;
}

/// Log-probabilities: completions take `logprobs` N (the N most likely tokens at each step, 0-20;
/// OpenAI stops at 5, vLLM at 20); chat takes `logprobs` true and `top_logprobs` N (0-20).
bool parse_logprobs(const json& j, bool chat, generate_request* r, api_error* err) {
  const double top_max = gpu::max_top_logprobs;
  if (!chat) {
    int32_t n = -1;
    if (auto it = j.find("logprobs"); it != j.end() && it->is_boolean() && !it->get<bool>()) return true;  // false: none
    if (!number_field(j, "logprobs", 0, top_max, &n, err)) return false;
    r->logprobs = n >= 0;
    r->top_logprobs = n > 0 ? static_cast<uint32_t>(n) : 0;
    return true;
  }
  if (!bool_field(j, "logprobs", &r->logprobs, err)) return false;
  if (!number_field(j, "top_logprobs", 0, top_max, &r->top_logprobs, err)) return false;
  if (r->top_logprobs > 0 && !r->logprobs) {
    *err = bad("top_logprobs", "top_logprobs needs logprobs: true");
    return false;
  }
  return true;
}

/// Completions' best_of: best_of generations per prompt (call::n), of which the n with the
/// highest log-probability per token are answered (call::best_of_keep), as OpenAI's and vLLM's.
bool parse_best_of(const json& j, bool chat, call* out, api_error* err) {
  uint32_t best_of = 0;
  if (!number_field(j, "best_of", 1, max_choices, &best_of, err)) return false;
  if (best_of == 0) return true;
  auto refuse = [&](const std::string& why) {
    *err = bad("best_of", why);
    return false;
  };
  if (chat) return refuse("best_of is for /v1/completions");
  if (best_of < out->n)
    return refuse("best_of (" + std::to_string(best_of) + ") must be at least n (" + std::to_string(out->n) + ")");
  if (best_of == out->n) return true;
  if (out->stream)
    return refuse("best_of > n is answered whole (the best is known at the end), not streamed: ask without stream");
  if (out->req.echo || out->vllm_prompt_logprobs)
    return refuse("best_of > n with echo or prompt_logprobs is not supported");
  out->best_of_keep = out->n;
  out->n = best_of;
  if (out->num_choices() > max_call_requests)
    return refuse(std::to_string(out->num_prompts()) + " prompts times best_of " + std::to_string(best_of) + " is " +
                  std::to_string(out->num_choices()) + " generations; at most " + std::to_string(max_call_requests) +
                  " in one call");
  out->logprobs_for_ranking = !out->req.logprobs;
  out->req.logprobs = true;
  return true;
}

/// logit_bias: {"token id": bias, ...}, each id a decimal integer, each bias in [-100, 100]
/// (OpenAI's range); the router checks the ids against the model's vocabulary.
bool parse_logit_bias(const json& j, generate_request* r, api_error* err) {
  auto it = j.find("logit_bias");
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_object()) {
    *err = bad("logit_bias", "logit_bias must be an object of token ids to biases, got " + describe(*it));
    return false;
  }
  if (it->size() > max_logit_bias) {
    *err = bad("logit_bias", "logit_bias names " + std::to_string(it->size()) + " tokens; at most " +
                                 std::to_string(max_logit_bias));
    return false;
  }
  for (const auto& [key, value] : it->items()) {
    int32_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc{} || end != key.data() + key.size() || id < 0) {
      *err = bad("logit_bias", "logit_bias keys must be token ids (decimal integers >= 0), got '" + key.substr(0, 32) + "'");
      return false;
    }
    if (!value.is_number() || !std::isfinite(value.get<double>()) || std::abs(value.get<double>()) > 100.0) {
      *err = bad("logit_bias", "logit_bias of token " + key + " must be a number in [-100, 100], got " + describe(value));
      return false;
    }
    r->logit_bias_tokens.push_back(id);
    r->logit_bias_values.push_back(value.get<float>());
  }
  return true;
}

/// Fields OpenAI defines that Baton does not implement: refused by name, never silently ignored.
bool refuse_unsupported(const json& j, api_error* err) {
  // Completions' suffix (text after the insertion point, for fill-in-the-middle models): an
  // answer without it would look right and be wrong.
  if (auto it = j.find("suffix"); it != j.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty())) {
    *err = bad("suffix", "suffix is not supported");
    return false;
  }
  if (auto it = j.find("functions"); it != j.end() && !it->is_null() && !(it->is_array() && it->empty())) {
    *err = bad("functions", "functions (the API's old form) is not supported: give tools");
    return false;
  }
  // vLLM's beam search, which Baton does not compute: refused by name when asked for (vLLM
  // clients would otherwise take the answer as a beam's); false, which they often send, passes.
  if (auto it = j.find("use_beam_search"); it != j.end() && !it->is_null() && *it != false) {
    *err = bad("use_beam_search", "use_beam_search is not supported (only false)");
    return false;
  }
  // vLLM's (and OpenAI's audio) fields that would change the answer and that Baton does not
  // implement: refused by name when they ask for something, so that a client migrating from vLLM
  // never takes an unrestricted answer for a restricted one. Their no-op values pass (clients
  // often send every field at its default).
  struct unsupported {
    const char* field;
    const char* what;                      ///< the sentence's tail: what to do instead
    bool (*asks)(const json&);             ///< whether this value asks for something
  };
  static const unsupported fields[] = {
      {"allowed_token_ids", "is not supported: use logit_bias, or a structured output (guided_choice, guided_regex)",
       [](const json& v) { return !(v.is_array() && v.empty()); }},
      {"bad_words", "is not supported: use logit_bias against their tokens",
       [](const json& v) { return !(v.is_array() && v.empty()); }},
      {"truncate_prompt_tokens", "is not supported: shorten the prompt (a prompt longer than the context is refused)",
       [](const json&) { return true; }},
      {"skip_special_tokens", "is supported only as true (special tokens are never in the text)",
       [](const json& v) { return v != true; }},
      {"spaces_between_special_tokens", "is supported only as true", [](const json& v) { return v != true; }},
      {"return_tokens_as_token_ids", "is not supported (only false)", [](const json& v) { return v != false; }},
      {"detokenize", "is supported only as true", [](const json& v) { return v != true; }},
      {"logits_processors", "is not supported", [](const json& v) { return !(v.is_array() && v.empty()); }},
      {"chat_template", "is not supported per request: the served template (the server's --chat-template, else the "
                        "model directory's) serves every call (docs/chat-templates.md)",
       [](const json& v) { return !(v.is_string() && v.get<std::string>().empty()); }},
      {"documents", "is not supported: put the documents in the messages",
       [](const json& v) { return !(v.is_array() && v.empty()); }},
      {"modalities", "other than [\"text\"] is not supported: the model answers in text",
       [](const json& v) { return v != json::array({"text"}); }},
      {"audio", "is not supported: the model answers in text", [](const json&) { return true; }},
  };
  for (const auto& f : fields)
    if (auto it = j.find(f.field); it != j.end() && !it->is_null() && f.asks(*it)) {
      *err = bad(f.field, std::string{f.field} + " " + f.what);
      return false;
    }
  if (auto so = j.find("stream_options"); so != j.end() && so->is_object())
    if (auto it = so->find("continuous_usage_stats"); it != so->end() && !it->is_null() && *it != false) {
      *err = bad("stream_options", "stream_options.continuous_usage_stats is not supported: include_usage gives the "
                                   "usage in the last event");
      return false;
    }
  return true;
}

bool parse_checked_body(std::string_view body, bool chat, const std::string& served_model, call* out, api_error* err,
                        const std::vector<std::string>& aliases);

}  // namespace

bool nested_too_deep(std::string_view text) { return gpu::json_nested_deeper_than(text, max_json_depth); }

bool parse_body(std::string_view body, bool chat, const std::string& served_model, call* out, api_error* err,
                const std::vector<std::string>& aliases) {
  // Every field is checked for its type before it is read; this catch is the net under that, so
  // that no body can throw through the gateway's connection.
  try {
    return parse_checked_body(body, chat, served_model, out, err, aliases);
  } catch (const json::exception& e) {
    *err = bad("", std::string("the body has a field of an unexpected type (") + e.what() + ")");
    return false;
  }
}

namespace {

/// The body with each escaped half of a surrogate pair that has no other half ("\ud83d" alone:
/// a JS or Python client that cut a string inside an emoji sends it, and both languages' own
/// parsers take it) written as U+FFFD, the replacement character, as Python's and JS's decoders
/// do; false when there is none (nlohmann refuses them).
bool patch_lone_surrogates(std::string_view body, std::string* out) {
  const auto escape_at = [&](size_t i, uint32_t* unit) {  // "\uXXXX" at i
    if (i + 6 > body.size() || body[i] != '\\' || body[i + 1] != 'u') return false;
    uint32_t v = 0;
    const auto r = std::from_chars(body.data() + i + 2, body.data() + i + 6, v, 16);
    if (r.ec != std::errc{} || r.ptr != body.data() + i + 6) return false;
    *unit = v;
    return true;
  };
  bool in_string = false, patched = false;
  std::string text;
  size_t copied = 0;  // body[copied, i) not yet in text
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '"') in_string = !in_string;
    if (!in_string || body[i] != '\\') continue;
    uint32_t unit = 0, next = 0;
    if (!escape_at(i, &unit)) {
      ++i;  // an escape of one character: \" or \\ does not end or start anything
      continue;
    }
    const bool high = unit >= 0xD800 && unit <= 0xDBFF, low = unit >= 0xDC00 && unit <= 0xDFFF;
    if (high && escape_at(i + 6, &next) && next >= 0xDC00 && next <= 0xDFFF) {
      i += 11;  // a whole pair
      continue;
    }
    if (high || low) {
      text.append(body.substr(copied, i - copied)).append("\\ufffd");
      copied = i + 6;
      patched = true;
    }
    i += 5;
  }
  if (!patched) return false;
  *out = std::move(text.append(body.substr(copied)));
  return true;
}

/// nlohmann's parse error in words a client can act on: where, and what (its quote of the text
/// is left out: it may hold bytes that are no UTF-8, which the error's JSON could not carry).
std::string parse_error_words(const std::string& what) {
  const std::string_view lead = "parse error at ";
  const auto at = what.find(lead);
  if (at == std::string::npos) return {};
  std::string words = what.substr(at + lead.size(), what.find("; last read") - at - lead.size());
  if (const auto expected = what.rfind("; expected "); expected != std::string::npos && expected > at)
    words += what.substr(expected);
  if (words.size() > 160) words.resize(160);
  std::replace_if(words.begin(), words.end(), [](char c) { return c < 0x20 || c > 0x7e; }, '?');
  return words;
}

}  // namespace

bool read_json_body(std::string_view* body, std::string* storage, json* out, api_error* err) {
  if (patch_lone_surrogates(*body, storage)) *body = *storage;
  if (nested_too_deep(*body)) {
    *err = bad("", "the body nests arrays and objects deeper than " + std::to_string(max_json_depth) + " levels");
    return false;
  }
  try {
    *out = json::parse(*body);
  } catch (const json::out_of_range& e) {
    // nlohmann's 406, "number overflow parsing '1e400'": valid JSON, but past a double's range.
    // Told apart so that the client looks at the number, not at the syntax.
    const std::string what = e.what();
    const size_t from = what.find('\''), to = what.rfind('\'');
    const std::string number = from < to ? what.substr(from + 1, std::min<size_t>(to - from - 1, 40)) : "";
    *err = bad("", "a number in the body is out of range" + (number.empty() ? "" : ", got " + number));
    return false;
  } catch (const json::exception& e) {  // parse_error: syntax, ill-formed UTF-8
    const auto words = parse_error_words(e.what());
    *err = bad("", "the body is not valid JSON" + (words.empty() ? "" : " (" + words + ")"));
    return false;
  }
  if (!out->is_object()) {
    *err = bad("", "the body must be a JSON object");
    return false;
  }
  return true;
}

namespace {

bool parse_checked_body(std::string_view body, bool chat, const std::string& served_model, call* out, api_error* err,
                        const std::vector<std::string>& aliases) {
  *out = call{};
  out->chat = chat;
  std::string patched;  // the body as read (read_json_body), which `body` may view from here on
  json j;
  if (!read_json_body(&body, &patched, &j, err)) return false;
  if (!string_field(j, "model", &out->model, err)) return false;
  if (!out->model.empty() && out->model != served_model &&
      std::find(aliases.begin(), aliases.end(), out->model) == aliases.end()) {
    *err = {404, "the model '" + out->model.substr(0, 128) + "' does not exist; this cluster serves '" + served_model + "'",
            "invalid_request_error", "model"};
    return false;
  }
  if (out->model.empty()) out->model = served_model;
  if (!refuse_unsupported(j, err)) return false;
  auto& r = out->req;
  // The parts of the body whose key order matters, again in that order.
  auto parts = parse_ordered(body, ordered_members);
  if (parts.too_wide) {
    *err = bad(parts.member, parts.member + " holds an object of more than " + std::to_string(max_ordered_object_keys) +
                                 " keys");
    return false;
  }
  const ordered_json& ordered = parts.value;
  if (chat) {
    if (!parse_messages(j, ordered, &r, &out->num_history_tool_calls, err) || !parse_tools(j, ordered, out, err))
      return false;
  } else if (!parse_prompt(j, out, err)) {
    return false;
  } else if (auto t = j.find("tools"); t != j.end() && !t->is_null() && !(t->is_array() && t->empty())) {
    *err = bad("tools", "tools are for /v1/chat/completions");
    return false;
  }
  r.max_tokens = chat ? default_chat_tokens : default_completion_tokens;
  // Echo: the prompt comes back first (with its tokens' log-probabilities when logprobs is set),
  // and max_tokens 0 then asks for the prompt alone: scoring, as evaluation harnesses do.
  if (!bool_field(j, "echo", &r.echo, err)) return false;
  if (r.echo && chat) {
    *err = bad("echo", "echo is supported on /v1/completions only");
    return false;
  }
  if (!number_field(j, "max_tokens", r.echo ? 0 : 1, router_limited, &r.max_tokens, err)) {
    if (!r.echo && !chat && j.contains("max_tokens") && j.at("max_tokens").is_number() && j.at("max_tokens") == 0)  // echo allows it
      err->message = "max_tokens must be at least 1 (0 asks for the prompt's scores alone, with echo: true)";
    return false;
  }
  if (r.echo && j.contains("max_tokens") && r.max_tokens == 0) {
    r.prompt_only = true;
    r.max_tokens = 1;  // the prefill picks one token in any case; it is not returned
  }
  if (chat && !number_field(j, "max_completion_tokens", 1, router_limited, &r.max_tokens, err)) return false;
  if (!number_field(j, "temperature", 0, 2, &r.temperature, err)) return false;
  const auto given = [&](const char* field) { return j.contains(field) && !j[field].is_null(); };
  out->max_tokens_given = given("max_tokens") || (chat && given("max_completion_tokens"));
  out->temperature_given = given("temperature");
  out->top_p_given = given("top_p");
  out->top_k_given = given("top_k");
  out->repetition_penalty_given = given("repetition_penalty");
  if (!number_field(j, "top_p", 0, 1, &r.top_p, err)) return false;
  int64_t top_k = r.top_k;
  if (!number_field(j, "top_k", -1, 1 << 20, &top_k, err)) return false;
  r.top_k = top_k < 0 ? 0 : static_cast<uint32_t>(top_k);  // vLLM's -1: off
  // OpenAI takes top_p 0 (with temperature 0, for answers that repeat): the smallest nucleus,
  // the most likely token alone -- top_k 1, since the sampler's top_p is in (0, 1].
  if (out->top_p_given && r.top_p == 0.0f) {
    r.top_p = 1.0f;
    r.top_k = 1;
    out->top_k_given = true;  // not the model's default top_k in its place
  }
  // Any 64-bit integer, as OpenAI takes (a negative one keeps its bits), read as an integer: a
  // double would round seeds above 2^53.
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
    if (it->is_number_unsigned()) r.seed = it->get<uint64_t>();
    else if (it->is_number_integer()) r.seed = static_cast<uint64_t>(it->get<int64_t>());
    else {
      *err = bad("seed", "seed must be an integer, got " + describe(*it));
      return false;
    }
    out->seeded = true;
  }
  // Taken and otherwise unused (as `metadata`, `store`, `service_tier`), but of OpenAI's type.
  if (auto u = j.find("user"); u != j.end() && !u->is_null() && !u->is_string()) {
    *err = bad("user", "user must be a string, got " + describe(*u));
    return false;
  }
  if (!number_field(j, "presence_penalty", -2, 2, &r.presence_penalty, err)) return false;
  if (!number_field(j, "frequency_penalty", -2, 2, &r.frequency_penalty, err)) return false;
  if (!parse_logit_bias(j, &r, err)) return false;
  if (!parse_constraint(j, ordered, out, err)) return false;
  if (!number_field(j, "repetition_penalty", 0.01, 100, &r.repetition_penalty, err)) return false;
  // vLLM's min_p and min_tokens (the router checks min_tokens against max_tokens).
  if (!number_field(j, "min_p", 0, 1, &r.min_p, err)) return false;
  int64_t min_tokens = 0;
  if (!number_field(j, "min_tokens", 0, router_limited, &min_tokens, err)) return false;
  r.min_tokens = static_cast<uint32_t>(min_tokens);
  if (!bool_field(j, "ignore_eos", &r.ignore_eos, err)) return false;
  if (!bool_field(j, "include_stop_str_in_output", &r.include_stop_str_in_output, err)) return false;
  // vLLM's: a text prompt's begin-of-text token (default true for completions, false for chats,
  // whose template writes it).
  bool special = !chat;
  if (!bool_field(j, "add_special_tokens", &special, err)) return false;
  if (special == chat) r.add_special_tokens = special ? 1 : 0;  // not the default
  bool parallel_tool_calls = true;
  if (!bool_field(j, "parallel_tool_calls", &parallel_tool_calls, err)) return false;
  out->one_tool_call = !parallel_tool_calls;
  if (!bool_field(j, "separate_reasoning", &out->reasoning_wanted, err)) return false;
  if (auto it = j.find("chat_template_kwargs"); it != j.end() && !it->is_null()) {
    if (!chat) {
      *err = bad("chat_template_kwargs", "chat_template_kwargs is for /v1/chat/completions");
      return false;
    }
    if (!it->is_object()) {
      *err = bad("chat_template_kwargs", "chat_template_kwargs must be an object of template variables");
      return false;
    }
    r.chat_template_kwargs = it->dump();
  }
  // vLLM's chat options, passed to the template's renderer among its variables (gpu/tokenizer.cpp):
  // add_generation_prompt false ends the text after the last message; continue_final_message
  // has the answer continue the last message, an assistant's (a prefilled answer).
  for (const char* option : {"add_generation_prompt", "continue_final_message"}) {
    auto it = j.find(option);
    if (it == j.end() || it->is_null()) continue;
    if (!chat) {
      *err = bad(option, std::string{option} + " is for /v1/chat/completions");
      return false;
    }
    if (!it->is_boolean()) {
      *err = bad(option, std::string{option} + " must be true or false, got " + describe(*it));
      return false;
    }
    auto kwargs = r.chat_template_kwargs.empty() ? json::object() : json::parse(r.chat_template_kwargs);
    kwargs[option] = *it;  // the field wins over the same name in chat_template_kwargs
    r.chat_template_kwargs = kwargs.dump();
  }
  if (!bool_field(j, "stream", &out->stream, err)) return false;
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!out->stream) {  // as OpenAI answers it
      *err = bad("stream_options", "stream_options is only allowed when stream is true");
      return false;
    }
    if (!it->is_object()) {
      *err = bad("stream_options", "stream_options must be an object");
      return false;
    }
    if (!bool_field(*it, "include_usage", &out->include_usage, err)) return false;
  }
  if (!parse_stop(j, &r, err)) return false;
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      *err = bad("stop_token_ids", "stop_token_ids must be an array of token ids");
      return false;
    }
    for (const auto& t : *it) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        *err = bad("stop_token_ids", "stop_token_ids must be non-negative integers");
        return false;
      }
      r.stop_token_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  }
  if (!string_field(j, "traffic_class", &r.traffic_class, err)) return false;
  // Baton's priority is a class (interactive or batch, the router checks it); vLLM's an integer,
  // whose 0 (its default, which its clients send) asks for nothing.
  if (auto it = j.find("priority"); it != j.end() && it->is_number()) {
    if (!it->is_number_integer() || it->get<int64_t>() != 0) {
      *err = bad("priority", "priority must be \"interactive\" or \"batch\" (vLLM's integer priorities are not "
                             "supported; 0 is taken as no priority), got " + describe(*it));
      return false;
    }
  } else if (!string_field(j, "priority", &r.priority, err)) {
    return false;
  }
  if (!number_field(j, "n", 1, max_choices, &out->n, err)) return false;
  if (out->num_choices() > max_call_requests) {
    *err = bad("n", std::to_string(out->num_prompts()) + " prompts times n " + std::to_string(out->n) + " is " +
                        std::to_string(out->num_choices()) + " generations; at most " + std::to_string(max_call_requests) +
                        " in one call");
    return false;
  }
  if (!parse_logprobs(j, chat, &r, err)) return false;
  r.prompt_logprobs = r.echo && r.logprobs;
  // vLLM's prompt_logprobs: k alternatives per prompt token (0: the token's own only).
  int32_t prompt_top = -1;
  if (!number_field(j, "prompt_logprobs", 0, gpu::max_top_logprobs, &prompt_top, err)) return false;
  if (prompt_top >= 0) {
    if (out->stream) {  // as vLLM refuses it
      *err = bad("prompt_logprobs", "prompt_logprobs is answered whole, not streamed: ask without stream");
      return false;
    }
    out->vllm_prompt_logprobs = true;
    r.prompt_logprobs = true;
    r.prompt_top_logprobs = static_cast<uint32_t>(prompt_top);
  }
  // n choices of a prompt share its scores: the first scores it (choice_request), the others
  // copy them into the answer. A stream cannot wait for another choice's scores.
  if (r.prompt_logprobs && out->n > 1 && out->stream) {
    *err = bad("n", "n > 1 with echo and logprobs is answered whole, not streamed: ask without stream or with n 1");
    return false;
  }
  return parse_best_of(j, chat, out, err);
}
}  // namespace

generate_request call::choice_request(uint32_t index) const {
  generate_request r = req;
  const uint32_t prompt = index / n;
  if (prompt < batch_texts.size()) r.prompt = batch_texts[prompt];
  if (prompt < batch_tokens.size()) r.prompt_tokens = batch_tokens[prompt];
  // n samples of a prompt, not one sample n times. Without a seed every prompt of a batch draws
  // its own (identical prompts gave identical "samples"); with one, each prompt reuses it, as
  // vLLM does.
  r.seed += seeded ? index % n : index;
  r.prompt_logprobs = r.prompt_logprobs && index % n == 0;  // scored once, by the prompt's first choice
  if (!r.prompt_logprobs) r.prompt_top_logprobs = 0;
  return r;
}

}  // namespace baton::deploy::openai
