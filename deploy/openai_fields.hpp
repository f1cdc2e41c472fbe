#pragma once

// What the gateway's request readers share (openai_request.cpp, openai_constraint.cpp): error
// values that name the field, and the readers of the answer's constraint. Not part of openai.hpp:
// only the readers include it.

#include <string>

#include <nlohmann/json.hpp>

#include "deploy/openai.hpp"

namespace baton::deploy::openai {

inline api_error bad(std::string param, std::string message) {
  return {400, std::move(message), "invalid_request_error", std::move(param)};
}

/// A value for an error message: a scalar as JSON (cut short), an array or object by its type
/// only (printing one nested 100,000 deep would recurse that deep).
inline std::string describe(const nlohmann::json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size());
  if (v.is_object()) return "an object";
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 40);
}

/// Whether object `o` has a string field "type" equal to `t` (any other type of it: no).
inline bool type_is(const nlohmann::json& o, const char* t) {
  auto it = o.find("type");
  return it != o.end() && it->is_string() && it->get_ref<const std::string&>() == t;
}

/// A request body read as every route reads one: nested at most max_json_depth, each escaped
/// half of a surrogate pair that has no other half ("\ud83d" alone, from a client that cut a
/// string inside an emoji) read as U+FFFD, as Python's and JS's parsers read it (`body` then
/// views `storage`, the patched text), and a JSON object; else false, and `err` says where the
/// text went wrong, without quoting it (it may hold bytes that are no UTF-8).
bool read_json_body(std::string_view* body, std::string* storage, nlohmann::json* out, api_error* err);

/// OpenAI's tools and tool_choice (openai_constraint.cpp): the tools for the template, and a
/// forced call's constraint.
bool parse_tools(const nlohmann::json& j, const nlohmann::ordered_json& body, call* out, api_error* err);

/// The answer's constraint, in any of the forms clients send: OpenAI's response_format, vLLM's
/// guided_* and structured_outputs, SGLang's json_schema / regex / ebnf (one form, one
/// constraint; a forced tool_choice, read before, is one too). Into call::req's output_format,
/// output_spec and json_compact.
bool parse_constraint(const nlohmann::json& j, const nlohmann::ordered_json& body, call* out, api_error* err);

}  // namespace baton::deploy::openai
