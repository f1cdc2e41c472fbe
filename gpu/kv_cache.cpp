#include "gpu/kv_cache.hpp"

#include <cstring>

namespace baton::gpu {

kv_cache::kv_cache(kv_layout layout)
  : layout_(layout), memory_(layout.total_bytes() / sizeof(float)), in_use_(layout.num_pages, false) {
  free_.reserve(layout_.num_pages);
  // Highest id at the bottom so a fresh pool hands out 0, 1, 2, ... in order.
  for (uint32_t p = layout_.num_pages; p-- > 0;) free_.push_back(p);
}

std::optional<std::vector<uint32_t>> kv_cache::kv_page_alloc(uint32_t num_pages) {
  if (num_pages > free_.size()) return std::nullopt;
  std::vector<uint32_t> pages(num_pages);
  for (auto& p : pages) {
    p = free_.back();
    free_.pop_back();
    in_use_[p] = true;
  }
  return pages;
}

void kv_cache::kv_page_free(const std::vector<uint32_t>& pages) {
  for (auto p : pages) {
    if (p < layout_.num_pages && in_use_[p]) {
      in_use_[p] = false;
      free_.push_back(p);
    }
  }
}

uint64_t kv_cache::kv_layer_checksum(uint32_t layer, const std::vector<uint32_t>& pages, uint32_t num_pages) const {
  // Word-wise multiply-xorshift: ~1 word per cycle, and any flipped bit changes the result.
  uint64_t h = 0x9E3779B97F4A7C15ull ^ layer;
  const auto* base = reinterpret_cast<const unsigned char*>(memory_.data());
  for (uint32_t i = 0; i < num_pages && i < pages.size(); ++i) {
    const unsigned char* p = base + layout_.offset_bytes(layer, pages[i]);
    for (uint64_t off = 0; off < layout_.page_bytes(); off += 8) {
      uint64_t w;
      std::memcpy(&w, p + off, 8);
      h = (h ^ w) * 0xFF51AFD7ED558CCDull;
      h ^= h >> 32;
    }
  }
  return h;
}

}  // namespace baton::gpu
