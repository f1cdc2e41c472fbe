#pragma once

// The CUDA executor's plan of one job on the host (cuda_executor.cpp): the small arrays it packs
// for the device, what makes two decode jobs one CUDA graph's, and runs of consecutive pages.
// Internal to the executor; no CUDA types, so it compiles anywhere.

#include <compare>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace baton::gpu::cuda {

/// Calls fn(first, count) for each run of consecutive page ids in `pages`: a run is one region
/// of a layer in both pools, so it moves in one copy (128 KiB copies reach half of PCIe).
template <typename Fn>
void for_runs(const std::vector<uint32_t>& pages, Fn fn) {
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    fn(i, j - i);
    i = j;
  }
}

/// What makes two decode jobs one graph's: their row counts and the work they ask for.
struct graph_key {
  uint32_t rows, head_rows, splits;
  uint64_t mirrored_slots;
  bool picks, draws, logits;
  auto operator<=>(const graph_key&) const = default;
};

/// A job's small arrays, packed once into pinned memory and copied to the device in one go.
struct job_args {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> positions, row_pages, page_table, tiles, tile_count, want_rows, upload, mirror;
  std::vector<uint32_t> flash_tiles, flash_count;  ///< prefill rows' tiles for the tensor-core attention
  std::vector<uint64_t> kv_slot;
  std::vector<uint64_t> mirror_slots;  ///< slots mirrored one by one (decode rows), not as whole pages
};

}  // namespace baton::gpu::cuda
