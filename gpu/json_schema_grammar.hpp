#pragma once

// Grammars for constrained answers (grammar.hpp): OpenAI's response_format "json_object" (any
// JSON object) and "json_schema" (a value matching a JSON schema), which forced tool calls use
// too; and text matching a regular expression whole (vLLM's guided_regex and guided_choice) or
// a grammar given as text (guided_grammar, gbnf_grammar.hpp).
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
// model cannot loop on blank lines; or, asked for compact JSON, nothing. An object with `properties` holds only those, in the
// schema's order (the order OpenAI's strict mode writes); required ones always, the others may
// be left out.

#include <memory>
#include <string>

#include "gpu/grammar.hpp"

namespace baton::gpu {

/// What a constrained answer must be.
enum class output_format : uint8_t {
  free = 0,    ///< no constraint
  object = 1,  ///< any JSON object (response_format json_object)
  schema = 2,  ///< a JSON value matching a schema (response_format json_schema, forced tool calls)
  regex = 3,   ///< text a regular expression matches whole (guided_regex, guided_choice)
  gbnf = 4,    ///< text a GBNF grammar's root matches (guided_grammar; gbnf_grammar.hpp)
};
inline constexpr uint8_t max_output_format = 4;

/// The largest schema compiled, in bytes of its JSON without annotations (titles, descriptions).
inline constexpr size_t max_json_schema_bytes = 64 * 1024;
/// The schema's text as sent, annotations and all (parsed to find what compiles).
inline constexpr size_t max_json_schema_text_bytes = 1024 * 1024;
/// The largest grammar compiled, in grammar elements (about 8 bytes each).
inline constexpr size_t max_grammar_elements = 1'000'000;

/// How a constrained answer is laid out around what it must be.
struct output_options {
  /// The answer starts inside a thinking block (the prompt opened it), written freely up to its
  /// `</think>`; the constrained answer follows.
  bool after_thinking = false;
  /// JSON without whitespace between its tokens (vLLM's disable_any_whitespace): what a model
  /// that pads with blanks would spend tokens on. Otherwise bounded whitespace, as above.
  bool compact = false;
  bool operator==(const output_options&) const = default;
};

/// The grammar of an answer of kind `kind`, not free. `text` is the schema's JSON text for
/// schema, the expression (regex_grammar.hpp's syntax) for regex, the grammar's text for gbnf,
/// and empty for object. nullptr and a sentence naming what is wrong (with the schema's JSON
/// pointer, the expression's offset, or the grammar's line) when the text is malformed, asks for
/// what is not supported, matches nothing, or is more than the matcher follows exactly (left
/// recursion, expansions deeper than grammar::max_expand_depth, over max_grammar_elements).
std::shared_ptr<const grammar> compile_output_grammar(output_format kind, const std::string& text,
                                                      const output_options& options, std::string* why);

/// compile_output_grammar through a process-wide cache of the last 64 grammars that compiled: the requests
/// of one service tend to share a schema, and the router (which checks it) and every rank in the
/// process (which follow it) then compile it once. Thread-safe; a compiled grammar is immutable.
std::shared_ptr<const grammar> cached_output_grammar(output_format kind, const std::string& text,
                                                     const output_options& options, std::string* why);

}  // namespace baton::gpu
