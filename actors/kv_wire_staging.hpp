#pragma once

// A rank's staging for KV sent in wire form (issue 6; the codec is transport/kv_wire): one slot
// per (layer, page) of the rank's KV pool, each wide enough for the INT8 form of that page's
// layer slice (INT4 uses the front of it), in one region registered with the rank's transport.
// Made on the first request that asks for a wire form, so a cluster that never does pays nothing.
//
// The prefill rank encodes a shipped page's layer into its own slot and puts the slot to the
// decode rank's slot of the same (layer, page of the lease); the decode rank checks the layer's
// wire bytes against the sender's checksum and expands them into its pages when the layer's
// ready signal comes (on its worker thread: decode_handoff.cpp). Slots belong to pages, so
// staging needs no allocator and lives as long as the page's holder: a prefill rank's slot is
// rewritten only when its page is (a restarted attempt, or a prefix page shared by prompts,
// writes the bytes it already holds), and a repeated put into a decode rank's slot (a retried
// attempt) lands in the slot, never in a page already expanded, which is why the decode side
// does not expand in place.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/kv_cache.hpp"
#include "transport/kv_wire.hpp"
#include "transport/transport.hpp"

namespace baton {

struct kv_wire_staging {
  std::shared_ptr<std::byte> memory;
  transport::region_key key;
  uint32_t num_pages = 0;
  uint64_t page_values = 0;  ///< fp32 values of one page's layer slice (kv_layout::page_bytes() / 4)
  uint64_t slot_bytes = 0;   ///< the INT8 form of page_values, rounded up to 64 bytes

  /// Slot bytes for a pool of `layout`: the INT8 form of one page's layer, 64-byte aligned.
  static uint64_t slot_bytes_for(const gpu::kv_layout& layout) {
    return (transport::wire_bytes(transport::wire_format::int8, layout.page_bytes() / sizeof(float)) + 63) / 64 * 64;
  }
  /// The staging a rank makes for a pool of `num_pages` pages shaped as `layout`'s.
  static uint64_t bytes_for(const gpu::kv_layout& layout, uint64_t num_pages) {
    return slot_bytes_for(layout) * layout.num_layers * num_pages;
  }
  uint64_t offset(uint32_t layer, uint32_t page) const { return (uint64_t{layer} * num_pages + page) * slot_bytes; }
  std::byte* slot(uint32_t layer, uint32_t page) const { return memory.get() + offset(layer, page); }

  /// The checksum both ends take of layer `layer` in form `f`: the wire bytes of the slots of
  /// the first `n` of `pages`, in order.
  uint64_t checksum(transport::wire_format f, uint32_t layer, const std::vector<uint32_t>& pages, uint32_t n) const {
    std::vector<const std::byte*> pieces;
    for (uint32_t i = 0; i < n && i < pages.size(); ++i) pieces.push_back(slot(layer, pages[i]));
    return gpu::pieces_checksum(layer, pieces, transport::wire_bytes(f, page_values));
  }
};

}  // namespace baton
