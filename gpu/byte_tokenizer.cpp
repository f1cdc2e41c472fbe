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

std::string byte_tokenizer::escape(std::string_view bytes) {
  std::string out;
  for (unsigned char ch : bytes) {
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
      out.push_back(static_cast<char>(ch));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", ch);
      out += buf;
    }
  }
  return out;
}

}  // namespace baton::gpu
