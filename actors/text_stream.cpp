#include "actors/text_stream.hpp"

#include <algorithm>

namespace baton {

size_t streamable_prefix(std::string_view text, const std::vector<std::string>& stop) {
  size_t end = text.size();
  // An unfinished UTF-8 character: its lead byte is among the last three bytes and announces
  // more continuation bytes than follow it.
  for (size_t back = 1; back <= 3 && back <= end; ++back) {
    const auto c = static_cast<unsigned char>(text[end - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking for the lead
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) end -= back;
    break;
  }
  size_t hold = 0;
  for (const auto& s : stop)
    for (size_t k = std::min(s.size() - (s.empty() ? 0 : 1), end); k > hold; --k)
      if (text.compare(end - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  return end - hold;
}

}  // namespace baton
