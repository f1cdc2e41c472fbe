#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpu/model_config.hpp"

namespace baton::gpu {

/// Byte layout of a paged KV pool, shipped to peers so they can address pages they do not own.
///
/// Memory is layer-major: [layer][page][plane][slot][kv_dim] fp32, the planes being K and V, or
/// the one latent plane of multi-head latent attention (DeepSeek), which serves as both. One
/// layer of many pages is therefore one strided region, which is what a per-layer send (and a
/// per-layer store prefetch) reads; transports and the store move pages as bytes and never
/// need to know which kind they carry.
struct kv_layout {
  uint32_t num_layers = 0;
  uint32_t num_pages = 0;
  uint32_t page_size_tokens = 16;
  uint32_t kv_dim = 0;  ///< floats per token per plane (model_config::kv_dim)
  uint32_t planes = 2;  ///< 2: K and V; 1: an MLA latent (model_config::kv_planes)

  uint64_t page_bytes() const { return uint64_t{planes} * page_size_tokens * kv_dim * sizeof(float); }
  uint64_t layer_stride_bytes() const { return page_bytes() * num_pages; }
  uint64_t total_bytes() const { return layer_stride_bytes() * num_layers; }
  /// Byte offset of (layer, page) inside the pool.
  uint64_t offset_bytes(uint32_t layer, uint32_t page) const {
    return layer * layer_stride_bytes() + page * page_bytes();
  }
};

/// The layout of `num_pages` pages of `page_size_tokens` tokens for model `m`.
inline kv_layout model_kv_layout(const model_config& m, uint32_t num_pages, uint32_t page_size_tokens) {
  return {m.num_hidden_layers, num_pages, page_size_tokens, m.kv_dim(), m.kv_planes()};
}

/// Page memory a pool takes from elsewhere than the heap: a transport's own memory, which peers
/// write incoming KV into with plain stores (transport::allocate_memory). `keep` frees it when
/// the pool goes. Not necessarily zeroed: every slot is written before it is read.
struct kv_host_memory {
  std::byte* base = nullptr;
  std::shared_ptr<void> keep;
};
/// Gives a pool of `size_bytes` its memory; a null base falls back to the heap.
using kv_memory_source = std::function<kv_host_memory(uint64_t size_bytes)>;

/// A pool of KV pages and its allocator.
///
/// Ownership: the allocator (kv_page_alloc / kv_page_free) belongs to the one actor that owns
/// the pool; the page memory is written by that actor's executor thread and by transports
/// (incoming KV), each only on pages the owner handed to them.
class kv_cache {
public:
  /// `host_memory` false: the allocator alone, no page memory (device-resident benchmarks of
  /// the CUDA executor, whose pools would not fit in host memory); data() is then null.
  explicit kv_cache(kv_layout layout, bool host_memory = true);
  /// Pages in `memory` (at least layout.total_bytes()); on the heap when its base is null.
  kv_cache(kv_layout layout, kv_host_memory memory);
  kv_cache(const kv_cache&) = delete;
  kv_cache& operator=(const kv_cache&) = delete;

  const kv_layout& layout() const { return layout_; }
  std::byte* data() { return reinterpret_cast<std::byte*>(memory_); }
  uint64_t size_bytes() const { return layout_.total_bytes(); }

  /// Pointer to the K (or V, with two planes) vector of token slot `slot` of `page` in `layer`;
  /// with one plane, k_at is the latent.
  float* k_at(uint32_t layer, uint32_t page, uint32_t slot) {
    return memory_ + (layout_.offset_bytes(layer, page) / sizeof(float)) +
           uint64_t{slot} * layout_.kv_dim;
  }
  float* v_at(uint32_t layer, uint32_t page, uint32_t slot) {
    return k_at(layer, page, slot) + uint64_t{layout_.page_size_tokens} * layout_.kv_dim;
  }

  /// Takes `num_pages` free pages, or nothing when fewer are free (no partial allocation).
  /// Pages come from a LIFO free list, so a pool with history hands out non-contiguous pages.
  std::optional<std::vector<uint32_t>> kv_page_alloc(uint32_t num_pages);
  void kv_page_free(const std::vector<uint32_t>& pages);
  uint32_t num_free_pages() const { return static_cast<uint32_t>(free_.size()); }
  /// A 64-bit checksum of layer `layer` of the first `num_pages` of `pages` (whole pages, in
  /// order): both ends of a KV transfer compute it to prove the layer landed intact.
  uint64_t kv_layer_checksum(uint32_t layer, const std::vector<uint32_t>& pages, uint32_t num_pages) const;
  /// A page's host-content generation: it changes when the page is allocated and when
  /// note_host_write names it. A device executor that mirrors pages keeps its copy while the
  /// generation it uploaded is current. Readable from any thread.
  uint32_t generation(uint32_t page) const { return gen_[page].load(std::memory_order_acquire); }
  /// The host bytes of these pages were rewritten outside the executor (a loader, a test).
  void note_host_write(const std::vector<uint32_t>& pages);
  uint32_t pages_for_tokens(uint32_t num_tokens) const {
    return (num_tokens + layout_.page_size_tokens - 1) / layout_.page_size_tokens;
  }

private:
  kv_cache(kv_layout layout, kv_host_memory memory, bool host_memory);

  kv_layout layout_;
  /// calloc'd by default: zero, and committed only where written (a large pool costs nothing
  /// until used, which lets sims model hundreds of ranks whose KV is never written).
  float* memory_ = nullptr;
  std::shared_ptr<void> keep_;  ///< frees memory_
  std::vector<uint32_t> free_;        ///< back() is handed out next
  std::vector<bool> in_use_;          ///< guards against double free
  std::unique_ptr<std::atomic<uint32_t>[]> gen_;  ///< per page, see generation()
};

/// Empty, or why `pools` KV pools of `num_pages` pages each for `m` cannot fit this machine's
/// memory (asking for them would end in bad_alloc or in swapping, not in a sentence).
/// `extra_bytes`: memory the pools' holders take besides (wire-form staging), named in the error.
std::string kv_pools_fit_memory(const model_config& m, uint64_t num_pages, uint32_t page_size_tokens, uint32_t pools,
                                uint64_t extra_bytes = 0);

/// kv_cache::kv_layer_checksum of `num_pages` pages of one layer lying one after another from
/// `first_page` (as a block file stores them): a block server checks a layer with it before it
/// sends the layer anywhere.
uint64_t layer_checksum(uint32_t layer, const std::byte* first_page, uint32_t num_pages, uint64_t page_bytes);

/// The same checksum over `pieces` of `piece_bytes` each, in order, wherever they lie: both ends
/// of a handoff in wire form (transport/kv_wire) checksum a layer's staged bytes with it.
uint64_t pieces_checksum(uint32_t layer, const std::vector<const std::byte*>& pieces, uint64_t piece_bytes);

}  // namespace baton::gpu
