#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton::gpu {

/// The built-in model's tokenizer: one token per byte (ids 0-255), then <bos> and <eos>.
/// A trained BPE tokenizer replaces it for real models; both put <bos> first.
class byte_tokenizer {
public:
  byte_tokenizer(int32_t bos_id, int32_t eos_id) : bos_(bos_id), eos_(eos_id) {}
  std::vector<int32_t> encode(std::string_view text) const;
  /// Bytes of the non-special tokens, in order (may be partial UTF-8: it is byte-level).
  std::string decode(const std::vector<int32_t>& tokens) const;
  /// For terminals, one line: printable ASCII and well-formed UTF-8 as they are; newline, tab,
  /// carriage return and backslash as \n, \t, \r and \\; any other byte as \xNN (a control
  /// character, or a byte of a character cut off or malformed).
  static std::string escape(std::string_view bytes);

private:
  int32_t bos_;
  int32_t eos_;
};

}  // namespace baton::gpu
