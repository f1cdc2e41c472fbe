// vLLM's /tokenize and /detokenize bodies and answers: a client counting a prompt's tokens before
// it sends it (context budgets, chunking a document) asks the model's own tokenizer, as a
// generation would see the prompt.

#include <algorithm>

#include <nlohmann/json.hpp>

#include "deploy/openai.hpp"
#include "deploy/openai_fields.hpp"

namespace baton::deploy::openai {

using nlohmann::json;

namespace {

/// The body as a JSON object, and its model one this gateway serves; false and `err` otherwise.
bool read_object(std::string_view body, const std::string& served_model, const std::vector<std::string>& aliases,
                 json* out, api_error* err) {
  std::string storage;  // as a call's body is read, so that the count is the call's
  if (!read_json_body(&body, &storage, out, err)) return false;
  if (auto m = out->find("model"); m != out->end() && !m->is_null()) {
    const bool known = m->is_string() && (*m == served_model || std::find(aliases.begin(), aliases.end(), *m) != aliases.end());
    if (!known) {
      *err = {404, "the model " + describe(*m) + " does not exist; this cluster serves '" + served_model + "'",
              "invalid_request_error", "model"};
      return false;
    }
  }
  return true;
}

}  // namespace

bool parse_tokenize_body(std::string_view body, const std::string& served_model, const std::vector<std::string>& aliases,
                         generate_request* out, api_error* err) {
  json j;
  if (!read_object(body, served_model, aliases, &j, err)) return false;
  if (auto it = j.find("return_token_strs"); it != j.end() && !it->is_null() && *it != false) {
    *err = bad("return_token_strs", "return_token_strs is not supported (only false): /detokenize gives ids' text");
    return false;
  }
  const bool chat = j.contains("messages");
  if (chat && j.contains("prompt")) {
    *err = bad("prompt", "give prompt or messages, not both");
    return false;
  }
  // Read as the call's own body would be: the same fields, checks and refusals.
  call c;
  if (!parse_body(body, chat, served_model, &c, err, aliases)) return false;
  if (c.num_prompts() > 1) {
    *err = bad("prompt", "/tokenize takes one prompt, not a batch of " + std::to_string(c.num_prompts()));
    return false;
  }
  *out = std::move(c.req);
  return true;
}

bool parse_detokenize_body(std::string_view body, const std::string& served_model,
                           const std::vector<std::string>& aliases, std::vector<int32_t>* out, api_error* err) {
  json j;
  if (!read_object(body, served_model, aliases, &j, err)) return false;
  auto it = j.find("tokens");
  if (it == j.end() || !it->is_array() || it->empty()) {
    *err = bad("tokens", "tokens must be a non-empty array of token ids");
    return false;
  }
  out->clear();
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& t = (*it)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
      *err = bad("tokens", "tokens[" + std::to_string(i) + "] must be a token id (an integer >= 0), got " + describe(t));
      return false;
    }
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return true;
}

std::string tokenize_json(const std::vector<int32_t>& tokens, uint32_t max_model_len) {
  json out = {{"count", tokens.size()}, {"max_model_len", max_model_len}, {"tokens", tokens}, {"token_strs", nullptr}};
  return out.dump();
}

std::string detokenize_json(const std::string& text) {
  // Invalid UTF-8 (ids that end inside a character) becomes U+FFFD instead of failing the answer.
  return json{{"prompt", text}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace baton::deploy::openai
