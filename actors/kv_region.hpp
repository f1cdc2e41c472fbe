#pragma once

// A registered memory region as messages name it: a decode rank's KV pool in a lease grant, a
// block server's write staging in a write slot. A part of actors/messages.hpp (which includes
// it), registered with the rest (actors/message_types.cpp).

#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>

namespace baton {

/// Where a decode rank's KV pool lives and how it is laid out (see gpu::kv_layout).
struct kv_region_desc {
  std::string backend;
  uint64_t region_id = 0;
  uint64_t size_bytes = 0;
  std::vector<uint8_t> packed_key;
  uint32_t num_layers = 0;
  uint32_t num_pages = 0;
  uint32_t page_size_tokens = 0;
  uint32_t kv_dim = 0;
  uint32_t kv_planes = 2;  ///< 2: K and V; 1: an MLA latent
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, kv_region_desc& x) {
  return f(caf::meta::type_name("kv_region_desc"), x.backend, x.region_id, x.size_bytes, x.packed_key,
           x.num_layers, x.num_pages, x.page_size_tokens, x.kv_dim, x.kv_planes);
}

}  // namespace baton
