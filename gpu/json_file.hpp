#pragma once

// A model file's JSON (config.json, tokenizer.json, a safetensors header, ...) parsed with its
// problems named: nesting past max_json_depth (refused before parsing: nlohmann copies and
// prints values recursively), invalid JSON (the parser's sentence, with the byte where it
// stopped), or a top level that is not an object.

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "gpu/text_file.hpp"

namespace baton::gpu {

/// Parses `text`, read from `source` (named in `why`), into `out`; false and a sentence when it
/// is not a JSON object.
inline bool parse_json_object(std::string_view text, const std::string& source, nlohmann::json* out, std::string* why) {
  if (json_nested_deeper_than(text)) {
    *why = source + ": not a JSON object of this kind: it nests arrays and objects deeper than " +
           std::to_string(max_json_depth) + " levels";
    return false;
  }
  try {
    *out = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    *why = source + ": not a JSON object (" + e.what() + ")";
    return false;
  }
  if (!out->is_object()) {
    *why = source + ": not a JSON object (its top level is " + out->type_name() + ")";
    return false;
  }
  return true;
}

}  // namespace baton::gpu
