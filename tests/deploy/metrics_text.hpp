#pragma once

// Reading a Prometheus text page in tests.

#include <string>

namespace baton::test {

/// The value of the line that starts with `series` ("name{labels}" or "name"), or -1.
inline double value_of(const std::string& text, const std::string& series) {
  const auto at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

}  // namespace baton::test
