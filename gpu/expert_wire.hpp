#pragma once

// The wire format of expert parallelism and the helpers both forms share (gpu/expert_parallel.cpp:
// the lead and its shards; gpu/expert_peers.cpp: data-parallel groups): chunk headers, EPLB's
// install pieces and their schedule, serving a dispatch chunk, and checking a combine. Internal:
// included by those two files only.

#include <algorithm>
#include <cstring>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpu/cpu_kernels.hpp"
#include "gpu/expert_parallel.hpp"

namespace baton::gpu::expert_wire {

enum : uint32_t { kind_work = 1, kind_stop = 2, kind_install = 3, kind_evict = 4, kind_idle = 5 };

struct chunk_header {
  uint32_t kind, layer, count;
};

/// A piece of one expert's weights: [gate | up | down] as floats, `total` in all.
struct install_header {
  uint32_t kind, layer, expert, reserved;
  uint64_t offset, total;
};

inline uint64_t expert_floats(const model_config& cfg) {
  return 3 * uint64_t{cfg.moe.moe_intermediate_size} * cfg.hidden_size;
}

/// Calls fn(matrix, offset in it, offset in the piece, floats) for each stretch of the floats
/// [offset, offset + n) of an expert's [gate | up | down] that lies in one matrix.
template <class Expert, class Fn>
inline void for_each_stretch(Expert& x, uint64_t part, uint64_t offset, uint64_t n, Fn fn) {
  for (uint64_t i = 0; i < n;) {
    const uint64_t at = offset + i, m = at / part, in = at % part, take = std::min(n - i, part - in);
    fn(m == 0 ? x.gate : m == 1 ? x.up : x.down, in, i, take);
    i += take;
  }
}

inline void drop_expert(expert_weights& x) {
  std::vector<float>{}.swap(x.gate);  // the memory goes, not just the size
  std::vector<float>{}.swap(x.up);
  std::vector<float>{}.swap(x.down);
}

/// Writes an install piece (see the header) into `ex`, one layer's experts; false and a sentence
/// when it does not fit.
inline bool install_piece(const model_config& cfg, uint32_t layer, std::vector<expert_weights>& ex,
                   std::span<const std::byte> chunk, std::string* why) {
  const auto bad = [&](const std::string& what) { return *why = "EPLB control chunk: " + what, false; };
  install_header ih{};
  if (chunk.size() < sizeof ih) return bad("an install piece without its header");
  std::memcpy(&ih, chunk.data(), sizeof ih);
  if (ih.kind != kind_install || ih.layer != layer)
    return bad("a piece of kind " + std::to_string(ih.kind) + " for layer " + std::to_string(ih.layer) +
               " where layer " + std::to_string(layer) + "'s experts were due");
  const uint64_t floats = expert_floats(cfg), n = (chunk.size() - sizeof ih) / sizeof(float);
  if (ih.expert >= ex.size() || ih.total != floats || ih.offset + n > floats || (chunk.size() - sizeof ih) % sizeof(float))
    return bad("an install piece of expert " + std::to_string(ih.expert) + " at " + std::to_string(ih.offset) +
               " that does not fit its " + std::to_string(floats) + " floats");
  auto& x = ex[ih.expert];
  const uint64_t part = floats / 3;
  if (ih.offset == 0) x.gate.assign(part, 0.0f), x.up.assign(part, 0.0f), x.down.assign(part, 0.0f);
  if (x.gate.size() != part) return bad("a piece of expert " + std::to_string(ih.expert) + " before its first");
  for_each_stretch(x, part, ih.offset, n, [&](std::vector<float>& dst, uint64_t in, uint64_t i, uint64_t take) {
    std::memcpy(dst.data() + in, chunk.data() + sizeof ih + i * sizeof(float), take * sizeof(float));
  });
  return true;
}

/// An install piece of `x` (expert `e` of layer `l`): floats [offset, offset + n) of its
/// [gate | up | down], after the header.
inline std::vector<std::byte> make_piece(const model_config& cfg, const expert_weights& x, uint32_t l, uint32_t e,
                                  uint64_t offset, uint64_t n) {
  const uint64_t floats = expert_floats(cfg);
  const install_header hd{kind_install, l, e, 0, offset, floats};
  std::vector<std::byte> chunk(sizeof hd + n * sizeof(float));
  std::memcpy(chunk.data(), &hd, sizeof hd);
  for_each_stretch(x, floats / 3, offset, n, [&](const std::vector<float>& src, uint64_t in, uint64_t i, uint64_t take) {
    std::memcpy(chunk.data() + sizeof hd + i * sizeof(float), src.data() + in, take * sizeof(float));
  });
  return chunk;
}

/// The floats an install piece carries: what a slot holds after the piece's header.
inline uint64_t piece_floats(uint64_t slot_bytes) {
  return slot_bytes > sizeof(install_header) ? (slot_bytes - sizeof(install_header)) / sizeof(float) : 0;
}

/// What a re-plan moves, and in which order, the same on every side that walks it: per rank the
/// experts it newly holds (`install`) and those it drops (`evict`); next() gives each exchange's
/// piece per rank -- one slot-sized stretch of one expert -- until every rank has its experts.
class move_schedule {
public:
  struct piece {
    uint32_t expert;
    uint64_t offset, floats;
  };
  /// `have[r]` and `want[r]` ascending; ranks below `first` move nothing.
  move_schedule(const std::vector<std::vector<uint32_t>>& have, const std::vector<std::vector<uint32_t>>& want,
                uint32_t first, uint64_t expert_floats, uint64_t per_piece)
    : install(want.size()), evict(want.size()), floats_(expert_floats), per_piece_(per_piece),
      next_expert_(want.size(), 0), next_offset_(want.size(), 0) {
    for (uint32_t r = first; r < want.size(); ++r) {
      std::set_difference(want[r].begin(), want[r].end(), have[r].begin(), have[r].end(), std::back_inserter(install[r]));
      std::set_difference(have[r].begin(), have[r].end(), want[r].begin(), want[r].end(), std::back_inserter(evict[r]));
    }
  }
  /// The next exchange's pieces (none for a rank that has all its experts); false when done.
  bool next(std::vector<std::optional<piece>>* out) {
    out->assign(install.size(), std::nullopt);
    bool any = false;
    for (uint32_t r = 0; r < install.size(); ++r) {
      if (next_expert_[r] >= install[r].size()) continue;
      const uint64_t off = next_offset_[r], n = std::min(per_piece_, floats_ - off);
      (*out)[r] = piece{install[r][next_expert_[r]], off, n};
      if ((next_offset_[r] += n) == floats_) next_offset_[r] = 0, ++next_expert_[r];
      any = true;
    }
    return any;
  }
  std::vector<std::vector<uint32_t>> install, evict;

private:
  uint64_t floats_, per_piece_;
  std::vector<size_t> next_expert_;
  std::vector<uint64_t> next_offset_;
};

/// The experts of `ex` (one layer's) that have weights, ascending.
inline std::vector<uint32_t> with_weights(const std::vector<expert_weights>& ex, uint32_t num_experts) {
  std::vector<uint32_t> out;
  for (uint32_t e = 0; e < ex.size() && e < num_experts; ++e)
    if (!ex[e].gate.empty()) out.push_back(e);
  return out;
}

/// Live EPLB's settings for a group of `ranks`, checked the same way for both forms.
inline std::string check_live_eplb(const live_eplb_config& cfg, uint32_t ranks, uint32_t num_experts) {
  if (auto e = policies::eplb_config{ranks, ranks, cfg.slots_per_rank}.validate(num_experts); !e.empty()) return e;
  if (cfg.interval_rounds == 0) return "EPLB: interval_rounds must be >= 1";
  return {};
}


/// serve_expert_chunk over any store of expert weights: `find(layer, expert)`.
template <class Find>
inline bool serve_chunk(const model_config& cfg, const Find& find, std::span<const std::byte> chunk, std::vector<std::byte>* out,
                 std::string* why) {
  chunk_header hd{};
  if (chunk.size() < sizeof hd) return *why = "expert dispatch: a chunk of " + std::to_string(chunk.size()) + " bytes has no header", false;
  std::memcpy(&hd, chunk.data(), sizeof hd);
  const uint64_t h = cfg.hidden_size, entry = sizeof(uint32_t) + h * sizeof(float);
  if (hd.layer >= cfg.num_hidden_layers || !cfg.is_moe_layer(hd.layer) || chunk.size() != sizeof hd + hd.count * entry)
    return *why = "expert dispatch: layer " + std::to_string(hd.layer) + " with " + std::to_string(hd.count) +
                  " entries does not fit a chunk of " + std::to_string(chunk.size()) + " bytes of this model",
           false;
  // Entries grouped by expert (ascending), each expert's rows run together as in the executor.
  std::vector<std::vector<uint32_t>> by_expert(cfg.moe.n_routed_experts);
  for (uint32_t i = 0; i < hd.count; ++i) {
    uint32_t e;
    std::memcpy(&e, chunk.data() + sizeof hd + i * entry, sizeof e);
    if (e >= cfg.moe.n_routed_experts) return *why = "expert dispatch: expert " + std::to_string(e) + " does not exist", false;
    by_expert[e].push_back(i);
  }
  out->assign(hd.count * h * sizeof(float), std::byte{0});
  const size_t f = cfg.moe.moe_intermediate_size;
  std::vector<float> x, gate, up, y;
  for (uint32_t e = 0; e < by_expert.size(); ++e) {
    const auto& rows = by_expert[e];
    if (rows.empty()) continue;
    const size_t n = rows.size();
    x.resize(n * h);
    for (size_t i = 0; i < n; ++i)
      std::memcpy(x.data() + i * h, chunk.data() + sizeof hd + rows[i] * entry + sizeof(uint32_t), h * sizeof(float));
    gate.resize(n * f);
    up.resize(n * f);
    y.resize(n * h);
    const expert_weights* xp = find(hd.layer, e);
    if (!xp || xp->gate.empty() || xp->up.empty() || xp->down.empty())
      return *why = "expert dispatch: expert " + std::to_string(e) + " of layer " + std::to_string(hd.layer) +
                    " is not held here (the placement and the weights disagree)",
             false;
    swiglu_mlp(x.data(), n, h, xp->gate.data(), xp->up.data(), xp->down.data(), f, gate.data(), up.data(), y.data(), nullptr);
    for (size_t i = 0; i < n; ++i) std::memcpy(out->data() + rows[i] * h * sizeof(float), y.data() + i * h, h * sizeof(float));
  }
  return true;
}


/// Chunks with their headers, for one micro-batch's dispatch.
inline std::vector<std::vector<std::byte>> with_headers(const model_config& cfg, uint32_t layer,
                                                 const std::vector<std::vector<std::byte>>& entries) {
  const uint64_t entry = sizeof(uint32_t) + uint64_t{cfg.hidden_size} * sizeof(float);
  std::vector<std::vector<std::byte>> chunks(entries.size());
  for (size_t d = 0; d < entries.size(); ++d) {
    const chunk_header hd{kind_work, layer, static_cast<uint32_t>(entries[d].size() / entry)};
    chunks[d].resize(sizeof hd + entries[d].size());
    std::memcpy(chunks[d].data(), &hd, sizeof hd);
    if (!entries[d].empty()) std::memcpy(chunks[d].data() + sizeof hd, entries[d].data(), entries[d].size());
  }
  return chunks;
}

inline std::vector<std::span<const std::byte>> spans(const std::vector<std::vector<std::byte>>& v) {
  return {v.begin(), v.end()};
}

/// Checks each EP rank's combined answer against the rows it was sent, and keeps it.
inline bool collect(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries,
             const std::vector<std::span<const std::byte>>& recv, std::vector<std::vector<std::byte>>* outputs,
             std::string* why) {
  const uint64_t entry = sizeof(uint32_t) + uint64_t{cfg.hidden_size} * sizeof(float);
  outputs->assign(entries.size(), {});
  for (size_t d = 0; d < entries.size(); ++d) {
    if (recv[d].size() * entry != entries[d].size() * cfg.hidden_size * sizeof(float))
      return *why = "expert combine, layer " + std::to_string(layer) + ": EP rank " + std::to_string(d) + " answered " +
                    std::to_string(recv[d].size()) + " bytes for " + std::to_string(entries[d].size() / entry) + " rows",
             false;
    (*outputs)[d].assign(recv[d].begin(), recv[d].end());
  }
  return true;
}

}  // namespace baton::gpu::expert_wire
