#pragma once

// A whole file as text: a model directory's JSON, tokenizers, chat templates, cluster specs.

#include <fstream>
#include <sstream>
#include <string>

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

}  // namespace baton::gpu
