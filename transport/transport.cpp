#include "transport/transport.hpp"

#include <sstream>

namespace baton::transport {

std::string xfer_error::to_string() const {
  std::string out = "request " + std::to_string(request_id);
  if (!peer.empty()) out += ", peer " + peer;
  out += ", layer " + std::to_string(layer) + ": " + what;
  out += retryable ? " (retryable)" : " (fatal)";
  return out;
}

std::string key_to_text(const region_key& k) {
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (auto b : k.packed) hex += {digits[b >> 4], digits[b & 15]};
  return k.backend + " " + std::to_string(k.region_id) + " " + std::to_string(k.size_bytes) + " " +
         (hex.empty() ? "-" : hex);
}

std::optional<region_key> key_from_text(const std::string& line) {
  std::istringstream in{line};
  region_key k;
  std::string hex;
  if (!(in >> k.backend >> k.region_id >> k.size_bytes >> hex)) return std::nullopt;
  if (hex == "-") return k;
  if (hex.size() % 2) return std::nullopt;
  for (size_t i = 0; i < hex.size(); i += 2) {
    auto nibble = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    k.packed.push_back(static_cast<uint8_t>(hi << 4 | lo));
  }
  return k;
}

}  // namespace baton::transport
