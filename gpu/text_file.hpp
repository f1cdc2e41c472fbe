#pragma once

// A whole file as text: a model directory's JSON, tokenizers, chat templates, cluster specs.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

namespace baton::gpu {

/// The file's bytes in `*out`; false when it cannot be opened.
inline bool read_text_file(const std::string& path, std::string* out) {
  std::ifstream in{path, std::ios::binary};
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

/// Whether something is at `path`, without throwing: a loop of symbolic links or a directory
/// that may not be searched is "no" (the read that follows names the path), never an exception
/// that ends the process.
inline bool path_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

/// How deep JSON may nest in a file or body Baton reads: model files nest a few levels, and a
/// value nested deeper is copied and printed recursively (nlohmann), so that ten thousand
/// brackets would overflow the stack.
inline constexpr size_t max_json_depth = 64;

/// Whether JSON text nests arrays and objects deeper than `limit` (strings skipped), checked
/// before it is parsed.
inline bool json_nested_deeper_than(std::string_view text, size_t limit = max_json_depth) {
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if ((c == ']' || c == '}') && depth > 0) --depth;
  }
  return false;
}

}  // namespace baton::gpu
