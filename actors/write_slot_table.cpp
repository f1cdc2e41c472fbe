// The block server's table of write slots (actors/block_server.hpp): ranges of its registered
// staging that writers put blocks into, granted, claimed by the write, and released.

#include "actors/block_server.hpp"

namespace baton {

caf::expected<store_write_slot> write_slot_table::grant(const store_write_begin& b, const std::string& server,
                                                        const std::string& setup_error) {
  const auto stage = where(b.request_id, server, "store_write");
  if (!setup_error.empty() || !key_) return make_error(errc::rank_unavailable, stage + ": " + setup_error);
  // A slot of 0 bytes would share its offset with the next slot granted, and freeing it free that one's range.
  if (b.bytes == 0) return make_error(errc::bad_request, stage + ": a write slot of 0 bytes");
  auto off = pool_.acquire(b.bytes);
  if (!off)
    return make_error(errc::kv_capacity, stage + ": write staging is full (a slot of " + std::to_string(b.bytes) +
                                             " bytes asked, of " + std::to_string(pool_.capacity()) + " in all)");
  const uint64_t id = ++last_;
  slots_[id] = {{*off, b.bytes}, false};
  kv_region_desc region;
  region.backend = key_->backend;
  region.region_id = key_->region_id;
  region.size_bytes = key_->size_bytes;
  region.packed_key = key_->packed;
  return store_write_slot{id, *off, std::move(region)};
}

std::optional<write_slot_table::range> write_slot_table::find(uint64_t slot_id) const {
  auto i = slots_.find(slot_id);
  if (i == slots_.end()) return std::nullopt;
  return i->second.at;
}

std::optional<write_slot_table::range> write_slot_table::claim(uint64_t slot_id) {
  auto i = slots_.find(slot_id);
  if (i == slots_.end() || i->second.writing) return std::nullopt;
  i->second.writing = true;
  return i->second.at;
}

void write_slot_table::release(uint64_t slot_id) {
  auto i = slots_.find(slot_id);
  if (i == slots_.end()) return;
  pool_.release(i->second.at.offset);
  slots_.erase(i);
}

bool write_slot_table::reclaim(uint64_t slot_id) {
  auto i = slots_.find(slot_id);
  if (i == slots_.end() || i->second.writing) return false;
  release(slot_id);
  return true;
}

}  // namespace baton
