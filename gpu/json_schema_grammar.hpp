#pragma once

// Grammars for JSON answers (grammar.hpp): OpenAI's response_format "json_object" (any JSON
// object) and "json_schema" (a value matching a JSON schema), which forced tool calls use too.
//
// The schema subset, as OpenAI's structured outputs and llama.cpp's converter take it:
// type (one or a list), properties / required / additionalProperties, items / minItems /
// maxItems, enum, const, anyOf / oneOf, allOf of one schema, $ref into the schema's own $defs
// or definitions (recursion allowed), a string's pattern, format (date, time, date-time, uuid,
// ipv4, email) or minLength / maxLength (regex_grammar.hpp), and an integer's minimum / maximum
// (exclusive ones too). Annotations (title, description, default, examples, $schema, $id,
// $comment) are ignored. Anything that restricts values in a way the grammar does not enforce
// (multipleOf, uniqueItems, not, a number's bounds, ...) is refused by name rather than
// silently not honoured.
//
// The text: compact separators are not required; between tokens the model may write a space, or
// a newline with up to 24 spaces or tabs of indentation (pretty-printed JSON), but no more, so a
// model cannot loop on blank lines. An object with `properties` holds only those, in the
// schema's order (the order OpenAI's strict mode writes); required ones always, the others may
// be left out.

#include <memory>
#include <string>

#include "gpu/grammar.hpp"

namespace baton::gpu {

/// What a constrained answer must be.
enum class json_output : uint8_t {
  free = 0,    ///< no constraint
  object = 1,  ///< any JSON object (response_format json_object)
  schema = 2,  ///< a JSON value matching a schema (response_format json_schema, forced tool calls)
};
inline constexpr uint8_t max_json_output = 2;

/// The largest schema text accepted, in bytes.
inline constexpr size_t max_json_schema_bytes = 64 * 1024;

/// The grammar of an answer of kind `kind` (object or schema; `schema` is the schema's JSON text
/// for schema). `after_thinking`: the answer starts inside a thinking block (the prompt opened
/// it), written freely up to its `</think>`; the JSON follows. nullptr and a sentence naming
/// what is wrong (with the schema's JSON pointer) when the schema is malformed or asks for
/// what is not supported.
std::shared_ptr<const grammar> json_grammar(json_output kind, const std::string& schema, bool after_thinking,
                                            std::string* why);

}  // namespace baton::gpu
