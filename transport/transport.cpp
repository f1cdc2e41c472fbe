#include "transport/transport.hpp"

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace baton::transport {

std::string xfer_error::to_string() const {
  std::string out = "request " + std::to_string(request_id);
  if (!peer.empty()) out += ", peer " + peer;
  out += ", layer " + std::to_string(layer) + ": " + what;
  out += retryable ? " (retryable)" : " (fatal)";
  return out;
}

std::byte* transport::allocate_memory(uint64_t size_bytes, xfer_error* err) {
  // Page aligned, as a backend's segments are. Large blocks are fresh mappings, so pages cost
  // nothing until touched.
  constexpr uint64_t page = 4096;
  void* p = std::aligned_alloc(page, std::max(page, (size_bytes + page - 1) / page * page));
  if (!p && err) *err = {xfer_errc::backend_error, false, 0, {}, 0, "out of memory for " + std::to_string(size_bytes) + " bytes"};
  return static_cast<std::byte*>(p);
}

void transport::free_memory(std::byte* base) { std::free(base); }

std::byte* transport::map_remote(const region_key&) { return nullptr; }

transport_stats transport::stats() { return {}; }

void transport::set_settled_listener(std::function<void()>) {}

std::shared_ptr<std::byte> transport_memory(std::shared_ptr<transport> t, uint64_t size_bytes, xfer_error* err) {
  auto* base = t->allocate_memory(size_bytes, err);
  if (!base) return nullptr;
  return {base, [t = std::move(t)](std::byte* p) { t->free_memory(p); }};
}

std::string segments_outside(const std::vector<segment>& segments, uint64_t local_bytes, uint64_t remote_bytes) {
  for (const auto& s : segments) {
    const auto past = [&](uint64_t offset, uint64_t region) {
      return offset + s.size_bytes > region || offset + s.size_bytes < offset;
    };
    if (past(s.src_offset, local_bytes) || past(s.dst_offset, remote_bytes))
      return "segment src [" + std::to_string(s.src_offset) + ", +" + std::to_string(s.size_bytes) + ") dst [" +
             std::to_string(s.dst_offset) + ", +" + std::to_string(s.size_bytes) + ") outside regions of " +
             std::to_string(local_bytes) + " / " + std::to_string(remote_bytes) + " bytes";
  }
  return {};
}

std::vector<segment> coalesce_segments(const std::vector<segment>& segments) {
  std::vector<segment> out;
  for (const auto& s : segments) {
    if (s.size_bytes == 0) continue;
    if (!out.empty()) {
      auto& last = out.back();
      if (last.src_offset + last.size_bytes == s.src_offset && last.dst_offset + last.size_bytes == s.dst_offset) {
        last.size_bytes += s.size_bytes;
        continue;
      }
    }
    out.push_back(s);
  }
  return out;
}

std::string hex_of(const uint8_t* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < n; ++i) hex += {digits[bytes[i] >> 4], digits[bytes[i] & 15]};
  return hex;
}

bool bytes_of_hex(const std::string& hex, std::vector<uint8_t>* out) {
  if (hex.size() % 2) return false;
  auto nibble = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  out->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<uint8_t>(hi << 4 | lo));
  }
  return true;
}

std::string key_to_text(const region_key& k) {
  const std::string hex = hex_of(k.packed.data(), k.packed.size());
  return k.backend + " " + std::to_string(k.region_id) + " " + std::to_string(k.size_bytes) + " " +
         (hex.empty() ? "-" : hex);
}

std::optional<region_key> key_from_text(const std::string& line) {
  std::istringstream in{line};
  region_key k;
  std::string hex;
  if (!(in >> k.backend >> k.region_id >> k.size_bytes >> hex)) return std::nullopt;
  if (hex == "-") return k;
  if (!bytes_of_hex(hex, &k.packed)) return std::nullopt;
  return k;
}

}  // namespace baton::transport
