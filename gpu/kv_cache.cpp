#include "gpu/kv_cache.hpp"

#include <algorithm>
#include <new>

#include <cstring>

namespace baton::gpu {

kv_cache::kv_cache(kv_layout layout, bool host_memory) : kv_cache(layout, kv_host_memory{}, host_memory) {}

kv_cache::kv_cache(kv_layout layout, kv_host_memory memory) : kv_cache(layout, std::move(memory), true) {}

kv_cache::kv_cache(kv_layout layout, kv_host_memory memory, bool host_memory)
  : layout_(layout),
    memory_(reinterpret_cast<float*>(memory.base)),
    keep_(std::move(memory.keep)),
    in_use_(layout.num_pages, false),
    gen_(new std::atomic<uint32_t>[layout.num_pages]()) {
  if (host_memory && !memory_) {
    memory_ = static_cast<float*>(std::calloc(std::max<uint64_t>(1, layout.total_bytes() / sizeof(float)), sizeof(float)));
    if (!memory_) throw std::bad_alloc();  // as the vector it replaced would
    keep_ = std::shared_ptr<void>{memory_, [](void* p) { std::free(p); }};
  }
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
    gen_[p].fetch_add(1, std::memory_order_acq_rel);
  }
  return pages;
}

void kv_cache::note_host_write(const std::vector<uint32_t>& pages) {
  for (auto p : pages)
    if (p < layout_.num_pages) gen_[p].fetch_add(1, std::memory_order_acq_rel);
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
  // Four independent multiply-xorshift lanes over 64-bit words (so the CPU overlaps them), folded
  // at the end: any flipped bit changes the result, at a few GB/s per core.
  uint64_t lane[4] = {0x9E3779B97F4A7C15ull ^ layer, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
  const auto* base = reinterpret_cast<const unsigned char*>(memory_);
  for (uint32_t i = 0; i < num_pages && i < pages.size(); ++i) {
    const unsigned char* p = base + layout_.offset_bytes(layer, pages[i]);
    for (uint64_t off = 0; off < layout_.page_bytes(); off += 32) {  // page_bytes is a multiple of 32
      for (int k = 0; k < 4; ++k) {
        uint64_t w;
        std::memcpy(&w, p + off + 8 * k, 8);
        lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDull;
        lane[k] ^= lane[k] >> 32;
      }
    }
  }
  uint64_t h = lane[0];
  for (int k = 1; k < 4; ++k) h = (h ^ lane[k]) * 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 29);
}

}  // namespace baton::gpu
