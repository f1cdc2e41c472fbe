#include "gpu/kv_cache.hpp"

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

}  // namespace baton::gpu
