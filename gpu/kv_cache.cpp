#include "gpu/kv_cache.hpp"

#include <unistd.h>

#include <algorithm>
#include <new>
#include <string>

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

namespace {

constexpr int checksum_lanes = 8;

/// Folds `bytes` into the lanes: each lane a multiply-xorshift over every eighth 64-bit word, so a
/// flipped bit anywhere changes the result. A tail shorter than a 64-byte stripe goes word by
/// word into the first lanes, a last partial word zero-padded.
[[gnu::always_inline]] inline void mix_bytes(uint64_t* lanes, const unsigned char* p, uint64_t bytes) {
  uint64_t lane[checksum_lanes];  // a local copy: `p` may alias `lanes`, which would keep them in memory
  std::memcpy(lane, lanes, sizeof lane);
  uint64_t off = 0;
  for (; off + 8 * checksum_lanes <= bytes; off += 8 * checksum_lanes)
    for (int k = 0; k < checksum_lanes; ++k) {
      uint64_t w;
      std::memcpy(&w, p + off + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDull;
      lane[k] ^= lane[k] >> 32;
    }
  for (int k = 0; off < bytes; off += 8, ++k) {
    uint64_t w = 0;
    std::memcpy(&w, p + off, std::min<uint64_t>(8, bytes - off));
    lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDull;
    lane[k] ^= lane[k] >> 32;
  }
  std::memcpy(lanes, lane, sizeof lane);
}

void mix_bytes_portable(uint64_t* lane, const unsigned char* p, uint64_t bytes) { mix_bytes(lane, p, bytes); }

#if defined(__x86_64__)
/// The same arithmetic where the CPU multiplies 64-bit words in vectors (AVX-512DQ): the eight
/// lanes become one vector, 35-39 GB/s on this VM's EPYC against 10 for four scalar lanes. Chosen
/// at run time, so the build stays portable, and equal bit for bit to the portable form.
[[gnu::target("avx512f,avx512dq,avx512vl")]] void mix_bytes_avx512(uint64_t* lane, const unsigned char* p, uint64_t bytes) {
  mix_bytes(lane, p, bytes);
}
#endif

using mix_fn = void (*)(uint64_t*, const unsigned char*, uint64_t);

mix_fn pick_mix() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return mix_bytes_avx512;
#endif
  return mix_bytes_portable;
}

}  // namespace

namespace {
/// The checksum over `n` pages of `page_bytes`, page i at `at(i)`: one definition for pool pages
/// and for a block file's layer in a server's staging.
template <class PageAt>
uint64_t checksum_pages(uint32_t layer, uint32_t n, uint64_t page_bytes, PageAt at) {
  static const mix_fn mix = pick_mix();
  uint64_t lane[checksum_lanes];
  for (int k = 0; k < checksum_lanes; ++k) lane[k] = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(k + 1) ^ layer;
  for (uint32_t i = 0; i < n; ++i) mix(lane, reinterpret_cast<const unsigned char*>(at(i)), page_bytes);
  uint64_t h = lane[0];
  for (int k = 1; k < checksum_lanes; ++k) h = (h ^ lane[k]) * 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 29);
}
}  // namespace

std::string kv_pools_fit_memory(const model_config& m, uint64_t num_pages, uint32_t page_size_tokens, uint32_t pools,
                                uint64_t extra_bytes) {
  const auto lay = model_kv_layout(m, 1, page_size_tokens);
  const long phys = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (phys <= 0 || page <= 0) return {};  // unknown: nothing to compare with
  const uint64_t memory = static_cast<uint64_t>(phys) * static_cast<uint64_t>(page);
  const long double want =
      static_cast<long double>(num_pages) * lay.page_bytes() * lay.num_layers * pools + static_cast<long double>(extra_bytes);
  if (want <= static_cast<long double>(memory)) return {};
  return std::to_string(pools) + " KV pool(s) of " + std::to_string(num_pages) + " pages (" +
         std::to_string(lay.page_bytes() * lay.num_layers) + " bytes each, every layer)" +
         (extra_bytes ? " and " + std::to_string(extra_bytes >> 20) + " MiB of wire-form staging" : std::string{}) +
         " need " + std::to_string(static_cast<unsigned long long>(want / (1 << 20))) + " MiB, more than this machine's " +
         std::to_string(memory >> 20) + " MiB: lower --kv-pages";
}

uint64_t layer_checksum(uint32_t layer, const std::byte* first_page, uint32_t num_pages, uint64_t page_bytes) {
  return checksum_pages(layer, num_pages, page_bytes, [&](uint32_t i) { return first_page + uint64_t{i} * page_bytes; });
}

uint64_t pieces_checksum(uint32_t layer, const std::vector<const std::byte*>& pieces, uint64_t piece_bytes) {
  return checksum_pages(layer, static_cast<uint32_t>(pieces.size()), piece_bytes, [&](uint32_t i) { return pieces[i]; });
}

uint64_t kv_cache::kv_layer_checksum(uint32_t layer, const std::vector<uint32_t>& pages, uint32_t num_pages) const {
  const auto* base = reinterpret_cast<const std::byte*>(memory_);
  return checksum_pages(layer, std::min<uint32_t>(num_pages, static_cast<uint32_t>(pages.size())), layout_.page_bytes(),
                        [&](uint32_t i) { return base + layout_.offset_bytes(layer, pages[i]); });
}

}  // namespace baton::gpu
