#include "gpu/byte_tokenizer.hpp"

#include <cstdio>

namespace baton::gpu {

std::vector<int32_t> byte_tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() + 1);
  out.push_back(bos_);
  for (unsigned char ch : text) out.push_back(ch);
  return out;
}

std::string byte_tokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string out;
  for (auto t : tokens)
    if (t >= 0 && t < 256) out.push_back(static_cast<char>(t));
  return out;
}

namespace {

/// Length of the well-formed UTF-8 sequence of two to four bytes at `p` (Unicode's table 3-7: no
/// overlong forms, no surrogates, nothing past U+10FFFF); 0 when there is none.
size_t utf8_sequence(const unsigned char* p, size_t left) {
  const unsigned char c = p[0];
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
  if (n == 0 || left < n || p[1] < lo || p[1] > hi) return 0;
  if (c == 0xc2 && p[1] < 0xa0) return 0;  // U+0080..U+009F: C1 control characters, not for a terminal
  for (size_t i = 2; i < n; ++i)
    if (p[i] < 0x80 || p[i] > 0xbf) return 0;
  return n;
}

}  // namespace

std::string byte_tokenizer::escape(std::string_view bytes) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    const unsigned char ch = p[i];
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
      out.push_back(static_cast<char>(ch));
      ++i;
    } else if (const size_t n = ch >= 0x80 ? utf8_sequence(p + i, bytes.size() - i) : 0; n > 0) {
      out.append(bytes.substr(i, n));  // a character the terminal can show
      i += n;
    } else {
      switch (ch) {
        case '\n': out += "\\n"; break;
        case '\t': out += "\\t"; break;
        case '\r': out += "\\r"; break;
        case '\\': out += "\\\\"; break;
        default: {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\x%02x", ch);
          out += buf;
        }
      }
      ++i;
    }
  }
  return out;
}

}  // namespace baton::gpu
