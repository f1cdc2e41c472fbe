// Baton's answers in the OpenAI API's JSON: completions, stream chunks, log-probabilities,
// usage, errors and the model list. (Request bodies are read in openai_request.cpp.)

#include "deploy/openai.hpp"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

namespace baton::deploy::openai {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

/// Each prompt once (its n choices share it; choice i answers prompt i / n), and every choice's
/// tokens.
json usage_of(const std::vector<completion>& choices, uint32_t n, bool prompt_only = false) {
  const auto u = usage_counts(choices, n, prompt_only);
  return {{"prompt_tokens", u.prompt},
          {"completion_tokens", u.generated},
          {"total_tokens", u.prompt + u.generated},
          {"prompt_tokens_details", {{"cached_tokens", u.cached}}}};
}

}  // namespace

usage usage_counts(const std::vector<completion>& choices, uint32_t n, bool prompt_only) {
  usage u;
  for (size_t i = 0; i < choices.size(); ++i) {
    u.generated += prompt_only ? 0 : choices[i].tokens.size();
    if (i % std::max<uint32_t>(n, 1) == 0) u.prompt += choices[i].num_prompt_tokens, u.cached += choices[i].cached_tokens;
  }
  return u;
}

std::string finish_reason(const std::string& baton_reason) {
  return baton_reason == "length" ? "length" : "stop";
}

/// Characters of UTF-8 text: its bytes that start one (a token that ends inside a character
/// counts it; the next token's continuation bytes do not count it again).
uint64_t utf8_chars(const std::string& s) {
  uint64_t n = 0;
  for (unsigned char ch : s) n += (ch & 0xC0) != 0x80;
  return n;
}

namespace {

/// JSON has no -Infinity: a token that could not have been picked gets OpenAI's -9999. NaN (an
/// echoed prompt's first token, which nothing precedes) is null.
json logprob_value(float x) {
  if (std::isnan(x)) return nullptr;
  return std::isfinite(x) ? static_cast<double>(x) : -9999.0;
}

json bytes_of(const std::string& s) {
  json out = json::array();
  for (unsigned char ch : s) out.push_back(static_cast<int>(ch));
  return out;
}

/// The logprobs object of a choice (or of a streamed chunk's tokens). Completions: parallel
/// arrays, `text_offset` counting characters of the tokens' texts from `offset` (the tokens
/// before these), `top_logprobs` a {text: logprob} object per token (null when none were asked
/// for; as in OpenAI's format, two tokens of the same text share one key).
/// Chat: `content`, an entry per token with its UTF-8 bytes (a token may hold part of a character).
json logprobs_json(const call& c, const std::vector<token_logprob>& lps, uint64_t offset) {
  if (!c.req.logprobs) return nullptr;
  if (c.chat) {
    json content = json::array();
    for (const auto& t : lps) {
      json top = json::array();
      for (size_t k = 0; k < t.top_tokens.size() && k < t.top_texts.size() && k < c.req.top_logprobs; ++k)
        top.push_back({{"token", t.top_texts[k]}, {"logprob", logprob_value(t.top_logprobs[k])}, {"bytes", bytes_of(t.top_texts[k])}});
      content.push_back({{"token", t.text}, {"logprob", logprob_value(t.logprob)}, {"bytes", bytes_of(t.text)}, {"top_logprobs", top}});
    }
    return {{"content", content}, {"refusal", nullptr}};
  }
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& t : lps) {
    tokens.push_back(t.text);
    values.push_back(logprob_value(t.logprob));
    offsets.push_back(offset);
    offset += utf8_chars(t.text);
    json top = json::object();
    // (A prompt scored for vLLM's prompt_logprobs may carry more alternatives than asked here.)
    for (size_t k = 0; k < t.top_tokens.size() && k < t.top_texts.size() && k < c.req.top_logprobs; ++k)
      top[t.top_texts[k]] = logprob_value(t.top_logprobs[k]);
    // The token drawn, as OpenAI's completions and vLLM give it, when it is not among the top N
    // (a grammar or a penalty chose it): up to N + 1 entries.
    if (c.req.top_logprobs > 0 && !std::isnan(t.logprob) && !top.contains(t.text)) top[t.text] = logprob_value(t.logprob);
    tops.push_back(std::isnan(t.logprob) ? json(nullptr) : std::move(top));
  }
  return {{"tokens", tokens},
          {"token_logprobs", values},
          {"top_logprobs", c.req.top_logprobs > 0 ? tops : json(nullptr)},
          {"text_offset", offsets}};
}

/// vLLM's prompt_logprobs list: null for the first token (nothing precedes it), then per token
/// an object keyed by token id: the prompt token's log-probability, rank and text, and the `top`
/// most likely tokens' (rank 1, 2, ...; the prompt token once if it is among them).
json vllm_prompt_logprobs_json(const std::vector<token_logprob>& lps, uint32_t top) {
  json out = json::array();
  for (size_t i = 0; i < lps.size(); ++i) {
    const auto& t = lps[i];
    if (i == 0 || std::isnan(t.logprob)) {
      out.push_back(nullptr);
      continue;
    }
    json entry = json::object();
    entry[std::to_string(t.token)] = {{"logprob", logprob_value(t.logprob)}, {"rank", t.rank}, {"decoded_token", t.text}};
    for (size_t k = 0; k < t.top_tokens.size() && k < t.top_texts.size() && k < top; ++k) {
      const auto key = std::to_string(t.top_tokens[k]);
      if (!entry.contains(key))
        entry[key] = {{"logprob", logprob_value(t.top_logprobs[k])}, {"rank", k + 1}, {"decoded_token", t.top_texts[k]}};
    }
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace

namespace {

/// Echo's text and log-probabilities for choice `index`: the prompt as the client gave it (token
/// ids: as they decode, `decoded`) and its tokens' scores, then what was generated -- nothing
/// generated when the call asked for the prompt alone (generate_request::prompt_only).
void echo_parts(const call& c, uint32_t index, const std::string& decoded, bool with_prompt,
                const std::vector<token_logprob>& prompt_lps, const std::string& text,
                const std::vector<token_logprob>& lps, std::string* out_text, std::vector<token_logprob>* out_lps) {
  *out_lps = prompt_lps;
  *out_text = c.req.prompt_only ? "" : text;
  if (!c.req.prompt_only) out_lps->insert(out_lps->end(), lps.begin(), lps.end());
  if (!with_prompt) return;
  const uint32_t prompt = index / c.n;
  const bool ids = !c.req.prompt_tokens.empty();  // a batch's first prompt is req's too
  out_text->insert(0, ids ? decoded : prompt < c.batch_texts.size() ? c.batch_texts[prompt] : c.req.prompt);
}

}  // namespace

namespace {

/// Mistral's call ids are 9 characters of [0-9A-Za-z]: its templates and mistral-common refuse
/// any other id in the next turn (vLLM's Mistral parser draws them at random).
constexpr uint64_t mistral_id_space = [] {
  uint64_t n = 1;
  for (int k = 0; k < 9; ++k) n *= 62;
  return n;
}();
/// Odd and no multiple of 31, so prime to 62^9: multiplying by it modulo 62^9 permutes the ids,
/// spreading neighbouring places over all nine characters. (About 62^9 times 0.618.)
constexpr uint64_t mistral_id_scramble = 8366379594239805;
static_assert(mistral_id_scramble % 2 == 1 && mistral_id_scramble % 31 != 0 && mistral_id_scramble < mistral_id_space);
// A call's place below, choice * 2^32 + index, stays under 62^9 for every choice a call may have,
// so distinct places stay distinct ids.
static_assert((uint64_t{max_call_requests} << 32) < mistral_id_space);

/// Drawn from the answer's id, the choice and the call's place rather than at random, so that
/// the whole answer and its stream give a call the same id with no state kept between chunks
/// (and a test can know it). Within an answer the ids differ by construction: the places differ
/// and are offset and permuted alike. Across answers, whose ids differ (the gateway's start
/// second and a counter), two calls' ids agree by chance about once in 62^9 (1.4e16).
std::string mistral_call_id(const std::string& answer_id, size_t choice, uint32_t index) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the answer's id, then MurmurHash3's finaliser
  for (unsigned char ch : answer_id) h = (h ^ ch) * 0x100000001b3ull;
  h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull, h ^= h >> 33;
  const uint64_t place = (static_cast<uint64_t>(choice) << 32) | index;  // below 2^42 (max_call_requests)
  const uint64_t x = (h % mistral_id_space + place) % mistral_id_space;
  auto v = static_cast<uint64_t>(static_cast<unsigned __int128>(x) * mistral_id_scramble % mistral_id_space);
  static constexpr char digits[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  std::string out(9, '0');
  for (auto& ch : out) ch = digits[v % 62], v /= 62;
  return out;
}

/// A call's id. The client sends it back in the next turn (the assistant's tool_calls[].id, the
/// tool message's tool_call_id) and the model's template renders it, so it takes the form the
/// model was trained on: Mistral's 9 characters (mistral_call_id); Kimi-K2's functions.NAME:N as
/// the model wrote it (vLLM's id too), or where it wrote none, N counting the conversation's
/// calls from its first (call::num_history_tool_calls; each choice counts from the same history);
/// otherwise the answer's id, the choice and the call's place.
std::string tool_call_id(const call& c, const tool_call& t, const std::string& answer_id, size_t choice) {
  switch (c.tool_calls) {
    case gpu::tool_call_format::mistral: return mistral_call_id(answer_id, choice, t.index);
    case gpu::tool_call_format::kimi:
      if (!t.id.empty()) return t.id;
      return "functions." + t.name + ":" + std::to_string(uint64_t{c.num_history_tool_calls} + t.index);
    default:
      return "call_" + answer_id.substr(answer_id.find('-') + 1) + "-" + std::to_string(choice) + "-" +
             std::to_string(t.index);
  }
}

/// OpenAI's tool_calls list (ids: tool_call_id). In a stream each entry carries its index, and a
/// call's later pieces carry only that and more arguments.
json tool_calls_json(const call& c, const std::vector<tool_call>& calls, const std::string& id, size_t choice,
                     bool indexed) {
  json out = json::array();
  for (const auto& call : calls) {
    json entry = json::object();
    if (indexed) entry["index"] = call.index;
    if (!call.first) {
      entry["function"] = {{"arguments", call.arguments}};
    } else {
      entry["id"] = tool_call_id(c, call, id, choice);
      entry["type"] = "function";
      entry["function"] = {{"name", call.name}, {"arguments", call.arguments}};
    }
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace

namespace {
/// A generation's log-probability per token (best_of's ranking); none generated: the lowest.
double per_token_logprob(const completion& x) {
  if (x.logprobs.empty()) return -std::numeric_limits<double>::infinity();
  double sum = 0;
  for (const auto& t : x.logprobs) sum += t.logprob;
  return sum / static_cast<double>(x.logprobs.size());
}
}  // namespace

std::vector<completion> best_of_choices(const call& c, const std::vector<completion>& generations) {
  if (c.best_of_keep == 0) return generations;
  std::vector<double> score(generations.size());
  for (size_t i = 0; i < generations.size(); ++i) score[i] = per_token_logprob(generations[i]);
  std::vector<completion> out;
  for (size_t first = 0; first < generations.size(); first += c.n) {
    std::vector<size_t> order;
    for (size_t i = first; i < std::min<size_t>(first + c.n, generations.size()); ++i) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return score[a] > score[b]; });
    for (size_t k = 0; k < c.best_of_keep && k < order.size(); ++k) out.push_back(generations[order[k]]);
  }
  return out;
}

namespace {
/// vLLM's `stop_reason`: the stop string that ended the answer, or the stop token's id; null
/// when the model's own end token or the length did.
json stop_reason_json(const std::string& stop_string, int32_t stop_token) {
  if (!stop_string.empty()) return stop_string;
  return stop_token >= 0 ? json(stop_token) : json(nullptr);
}

json completion_object(const call& c, const std::vector<completion>& choices, const std::string& id, int64_t created) {
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto& done = choices[i];
    json choice = {{"index", i}, {"finish_reason", finish_reason(done.finish_reason)},
                   {"stop_reason", stop_reason_json(done.stop_string, done.stop_token)}};
    if (c.chat) {
      choice["logprobs"] = logprobs_json(c, done.logprobs, 0);
      // Read as its stream is (answer_reader), so whole and streamed answers agree.
      const auto parts = answer_reader{c, done.prompt_thinking}.feed(done.text, true);
      json message = {{"role", "assistant"}, {"content", parts.content}, {"refusal", nullptr}};
      // No text besides calls, a forced call (even one cut before its name) or reasoning: null,
      // as OpenAI and vLLM answer, so `content is None` tells a client there is nothing to show.
      const bool forced = !c.forced_tool.empty() || c.forced_calls;
      if (parts.content.empty() && (!parts.tool_calls.empty() || forced || !parts.reasoning.empty()))
        message["content"] = nullptr;
      if (c.separate_reasoning) message["reasoning_content"] = parts.reasoning.empty() ? json(nullptr) : json(parts.reasoning);
      if (!parts.tool_calls.empty()) {
        message["tool_calls"] = tool_calls_json(c, parts.tool_calls, id, i, false);
        // A cut answer says so: by max_tokens, or a stop string inside a forced call's JSON.
        if (done.finish_reason != "length" && !parts.cut) choice["finish_reason"] = "tool_calls";
      }
      choice["message"] = std::move(message);
    } else if (c.req.echo) {
      // The prompt's scores come with its first choice (call::choice_request).
      std::string text;
      std::vector<token_logprob> lps;
      echo_parts(c, static_cast<uint32_t>(i), done.prompt_text, true, choices[i - i % c.n].prompt_logprobs, done.text,
                 done.logprobs, &text, &lps);
      choice["logprobs"] = logprobs_json(c, lps, 0);
      choice["text"] = std::move(text);
      if (c.req.prompt_only) choice["finish_reason"] = "length";
    } else {
      choice["logprobs"] = logprobs_json(c, done.logprobs, 0);
      choice["text"] = done.text;
    }
    // The prompt's scores come with its first choice (call::choice_request).
    if (c.vllm_prompt_logprobs && !c.chat)
      choice["prompt_logprobs"] = vllm_prompt_logprobs_json(choices[i - i % c.n].prompt_logprobs, c.req.prompt_top_logprobs);
    list.push_back(std::move(choice));
  }
  json out = {{"id", id},
              {"object", c.chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", c.model},
              {"choices", std::move(list)},
              {"usage", usage_of(choices, c.n, c.req.prompt_only)}};
  if (c.vllm_prompt_logprobs && c.chat && !choices.empty())  // one prompt: at the top, as vLLM puts it
    out["prompt_logprobs"] = vllm_prompt_logprobs_json(choices[0].prompt_logprobs, c.req.prompt_top_logprobs);
  return out;
}
}  // namespace

std::string completion_json(const call& c, const std::vector<completion>& choices, const std::string& id, int64_t created) {
  json out;
  if (c.best_of_keep > 0) {
    // The answer shows the kept generations as n choices; usage counts every generation.
    call shown = c;
    shown.n = c.best_of_keep;
    shown.best_of_keep = 0;
    if (c.logprobs_for_ranking) shown.req.logprobs = false;
    out = completion_object(shown, best_of_choices(c, choices), id, created);
    out["usage"] = usage_of(choices, c.n, c.req.prompt_only);
  } else {
    out = completion_object(c, choices, id, created);
  }
  // Invalid UTF-8 (a model may emit any bytes) becomes U+FFFD instead of failing the answer.
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string completion_json(const call& c, const completion& done, const std::string& id, int64_t created) {
  return completion_json(c, std::vector<completion>{done}, id, created);
}

std::string chunk_json(const call& c, const stream_chunk& chunk, const std::string& id, int64_t created, bool first,
                       uint64_t text_offset, uint32_t index, const answer_parts* split) {
  json choice = {{"index", index}, {"logprobs", logprobs_json(c, chunk.logprobs, text_offset)}};
  choice["finish_reason"] = chunk.finish_reason.empty() ? json(nullptr) : json(finish_reason(chunk.finish_reason));
  choice["stop_reason"] = stop_reason_json(chunk.stop_string, chunk.stop_token);  // null until the last, as vLLM's
  if (c.req.echo && !c.chat) {
    // The prompt goes first, in the chunk that brings it (the first).
    std::string text;
    std::vector<token_logprob> lps;
    echo_parts(c, index, chunk.prompt_text, !chunk.prompt_text.empty() || !chunk.prompt_logprobs.empty(),
               chunk.prompt_logprobs, chunk.text, chunk.logprobs, &text, &lps);
    choice["logprobs"] = logprobs_json(c, lps, text_offset);
    choice["text"] = std::move(text);
    if (c.req.prompt_only && !chunk.finish_reason.empty()) choice["finish_reason"] = "length";
  } else if (c.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (split) {
      if (!split->reasoning.empty()) delta["reasoning_content"] = split->reasoning;
      if (!split->content.empty() || (first && split->reasoning.empty())) delta["content"] = split->content;
      if (!split->tool_calls.empty()) delta["tool_calls"] = tool_calls_json(c, split->tool_calls, id, index, true);
      if (split->called && !chunk.finish_reason.empty() && chunk.finish_reason != "length")
        choice["finish_reason"] = "tool_calls";  // a cut answer says so
    } else if (!chunk.text.empty() || first) {
      delta["content"] = chunk.text;
    }
    choice["delta"] = delta;
  } else {
    choice["text"] = chunk.text;
  }
  json out = {{"id", id},
              {"object", c.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", c.model},
              {"choices", json::array({choice})}};
  if (c.include_usage) out["usage"] = nullptr;
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string usage_chunk_json(const call& c, const std::vector<completion>& choices, const std::string& id, int64_t created) {
  json out = {{"id", id},
              {"object", c.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", c.model},
              {"choices", json::array()},
              {"usage", usage_of(choices, c.n, c.req.prompt_only)}};
  return out.dump();
}

std::string error_json(const api_error& e) {
  // The codes OpenAI gives these answers; others have none (null), as many of OpenAI's do.
  std::string code = e.code;
  if (code.empty() && e.status == 401) code = "invalid_api_key";
  if (code.empty() && e.status == 429) code = "rate_limit_exceeded";
  if (code.empty() && e.status == 404 && e.param == "model") code = "model_not_found";
  json err = {{"message", e.message}, {"type", e.type}, {"code", code.empty() ? json(nullptr) : json(code)}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  return json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {
json model_object(const std::string& model, int64_t created, uint32_t context_tokens) {
  json m = {{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "baton"}};
  if (context_tokens) m["max_model_len"] = context_tokens;  // vLLM's: clients size prompts by it
  return m;
}
}  // namespace

std::string models_json(const std::vector<std::string>& names, int64_t created, uint32_t context_tokens) {
  json data = json::array();
  for (const auto& name : names) data.push_back(model_object(name, created, context_tokens));
  return json{{"object", "list"}, {"data", std::move(data)}}.dump();
}

std::string model_json(const std::string& model, int64_t created, uint32_t context_tokens) {
  return model_object(model, created, context_tokens).dump();
}

}  // namespace baton::deploy::openai
