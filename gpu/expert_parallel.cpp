#include "gpu/expert_parallel.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <optional>

#include "gpu/cpu_kernels.hpp"
#include "transport/all_to_all.hpp"

namespace baton::gpu {

namespace {

enum : uint32_t { kind_work = 1, kind_stop = 2, kind_install = 3, kind_evict = 4, kind_idle = 5 };

struct chunk_header {
  uint32_t kind, layer, count;
};

/// A piece of one expert's weights: [gate | up | down] as floats, `total` in all.
struct install_header {
  uint32_t kind, layer, expert, reserved;
  uint64_t offset, total;
};

uint64_t expert_floats(const model_config& cfg) {
  return 3 * uint64_t{cfg.moe.moe_intermediate_size} * cfg.hidden_size;
}

/// Calls fn(matrix, offset in it, offset in the piece, floats) for each stretch of the floats
/// [offset, offset + n) of an expert's [gate | up | down] that lies in one matrix.
template <class Expert, class Fn>
void for_each_stretch(Expert& x, uint64_t part, uint64_t offset, uint64_t n, Fn fn) {
  for (uint64_t i = 0; i < n;) {
    const uint64_t at = offset + i, m = at / part, in = at % part, take = std::min(n - i, part - in);
    fn(m == 0 ? x.gate : m == 1 ? x.up : x.down, in, i, take);
    i += take;
  }
}

void drop_expert(expert_weights& x) {
  std::vector<float>{}.swap(x.gate);  // the memory goes, not just the size
  std::vector<float>{}.swap(x.up);
  std::vector<float>{}.swap(x.down);
}

/// Writes an install piece (see the header) into `ex`, one layer's experts; false and a sentence
/// when it does not fit.
bool install_piece(const model_config& cfg, uint32_t layer, std::vector<expert_weights>& ex,
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
std::vector<std::byte> make_piece(const model_config& cfg, const expert_weights& x, uint32_t l, uint32_t e,
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
uint64_t piece_floats(uint64_t slot_bytes) {
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
std::vector<uint32_t> with_weights(const std::vector<expert_weights>& ex, uint32_t num_experts) {
  std::vector<uint32_t> out;
  for (uint32_t e = 0; e < ex.size() && e < num_experts; ++e)
    if (!ex[e].gate.empty()) out.push_back(e);
  return out;
}

/// Live EPLB's settings for a group of `ranks`, checked the same way for both forms.
std::string check_live_eplb(const live_eplb_config& cfg, uint32_t ranks, uint32_t num_experts) {
  if (auto e = policies::eplb_config{ranks, ranks, cfg.slots_per_rank}.validate(num_experts); !e.empty()) return e;
  if (cfg.interval_rounds == 0) return "EPLB: interval_rounds must be >= 1";
  return {};
}

}  // namespace

std::vector<uint32_t> held_experts(const model_config& cfg, const model_weights& w, uint32_t layer) {
  if (layer >= w.layers.size()) return {};
  return with_weights(w.layers[layer].experts, cfg.moe.n_routed_experts);
}

void keep_expert_block(const model_config& cfg, model_weights& w, uint32_t rank, uint32_t size) {
  for (uint32_t l = 0; l < w.layers.size(); ++l)
    for (uint32_t e = 0; e < w.layers[l].experts.size(); ++e)
      if (policies::block_owner(e, size, cfg.moe.n_routed_experts) != rank) drop_expert(w.layers[l].experts[e]);
}

uint64_t expert_slot_bytes(const model_config& cfg, uint64_t max_rows) {
  return sizeof(chunk_header) + max_rows * cfg.moe.num_experts_per_tok * (sizeof(uint32_t) + cfg.hidden_size * sizeof(float));
}

namespace {

/// serve_expert_chunk over any store of expert weights: `find(layer, expert)`.
template <class Find>
bool serve_chunk(const model_config& cfg, const Find& find, std::span<const std::byte> chunk, std::vector<std::byte>* out,
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

}  // namespace

bool serve_expert_chunk(const model_config& cfg, const model_weights& w, std::span<const std::byte> chunk,
                        std::vector<std::byte>* out, std::string* why) {
  const auto find = [&](uint32_t l, uint32_t e) -> const expert_weights* {
    return e < w.layers[l].experts.size() ? &w.layers[l].experts[e] : nullptr;
  };
  return serve_chunk(cfg, find, chunk, out, why);
}

expert_group::expert_group(std::unique_ptr<transport::transport> t, std::unique_ptr<transport::all_to_all> a2a,
                           uint32_t size, std::unique_ptr<transport::all_to_all> b)
  : t_(std::move(t)), a2a_(std::move(a2a)), b_(std::move(b)), size_(size) {
  // A shard that failed says so (run_expert_shard): the lead stops waiting for it at once.
  for (auto* c : {a2a_.get(), b_.get()})
    if (c) c->set_abort([c](uint32_t s) { return c->peer_aborted(s) ? std::string{"the shard failed"} : std::string{}; });
}

expert_group::~expert_group() {
  if (!a2a_) return;
  const chunk_header stop{kind_stop, 0, 0};
  std::vector<std::byte> bytes(sizeof stop);
  std::memcpy(bytes.data(), &stop, sizeof stop);
  std::vector<std::span<const std::byte>> send(size_, std::span<const std::byte>{bytes}), recv;
  std::string why;
  a2a_->exchange(send, &recv, &why);  // best effort: a shard that is gone already needs no stop
  a2a_.reset();                       // before the transport they use
  b_.reset();
}

namespace {

/// Chunks with their headers, for one micro-batch's dispatch.
std::vector<std::vector<std::byte>> with_headers(const model_config& cfg, uint32_t layer,
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

std::vector<std::span<const std::byte>> spans(const std::vector<std::vector<std::byte>>& v) {
  return {v.begin(), v.end()};
}

/// Checks each EP rank's combined answer against the rows it was sent, and keeps it.
bool collect(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries,
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

}  // namespace

bool expert_group::after_round(const model_config& cfg, const model_weights& w, std::string* why) {
  // Between rounds: a new plan never splits one round's copies over two placements.
  if (eplb_.slots_per_rank && ++rounds_ % eplb_.interval_rounds == 0) return replan(cfg, w, why);
  return true;
}

bool expert_group::control(const std::vector<std::vector<std::byte>>& chunks, std::string* why) {
  const chunk_header idle{kind_idle, 0, 0};
  std::vector<std::byte> idle_bytes(sizeof idle);
  std::memcpy(idle_bytes.data(), &idle, sizeof idle);
  std::vector<std::span<const std::byte>> send(size_), recv;
  for (uint32_t d = 1; d < size_; ++d) send[d] = !chunks[d].empty() ? std::span<const std::byte>{chunks[d]} : idle_bytes;
  if (!a2a_->exchange(send, &recv, why)) return false;
  const std::vector<std::span<const std::byte>> none(size_);
  return a2a_->exchange(none, &recv, why);  // the shards' empty answers: they are done with it
}

bool expert_group::round_dual(const model_config& cfg, const model_weights& w, uint32_t layer,
                              const std::vector<std::vector<std::byte>>& entries_a,
                              const std::vector<std::vector<std::byte>>& entries_b,
                              std::vector<std::vector<std::byte>>* outputs_a,
                              std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  return dual_begin(cfg, layer, entries_a, why) && exchange_dual(cfg, w, entries_b, outputs_a, why) &&
         finish_dual(cfg, w, outputs_b, why);
}

bool expert_group::post_dual_a(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                               std::string* why) {
  ++split_rounds_;
  return dual_begin(cfg, layer, std::move(entries_a), why);
}

bool expert_group::dual_begin(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                              std::string* why) {
  if (!b_) return *why = "expert group: no second channel for dual-batch overlap", false;
  dual_layer_ = layer;
  dual_a_ = std::move(entries_a);
  if (!a2a_->post(spans(with_headers(cfg, layer, dual_a_)), why))
    return *why = "expert dispatch (micro-batch A), layer " + std::to_string(layer) + ": " + *why, false;
  return true;
}

bool expert_group::exchange_dual(const model_config& cfg, const model_weights& w,
                                 std::vector<std::vector<std::byte>> entries_b,
                                 std::vector<std::vector<std::byte>>* outputs_a, std::string* why) {
  const uint32_t layer = dual_layer_;
  auto fail = [&](const char* stage) { return *why = std::string{stage} + ", layer " + std::to_string(layer) + ": " + *why, false; };
  dual_b_ = std::move(entries_b);
  std::vector<std::span<const std::byte>> recv_a, recv_b;
  std::vector<std::byte> own_a, own_b;
  // B's dispatch starts; A's experts run here while B's chunks travel.
  if (!b_->post(spans(with_headers(cfg, layer, dual_b_)), why)) return fail("expert dispatch (micro-batch B)");
  if (!a2a_->complete(&recv_a, why)) return fail("expert dispatch (micro-batch A)");
  if (!serve_expert_chunk(cfg, w, recv_a[0], &own_a, why)) return false;
  std::vector<std::span<const std::byte>> send(size_);
  send[0] = own_a;
  if (!a2a_->post(send, why)) return fail("expert combine (micro-batch A)");
  // B's experts run while A's outputs travel back.
  if (!b_->complete(&recv_b, why)) return fail("expert dispatch (micro-batch B)");
  if (!serve_expert_chunk(cfg, w, recv_b[0], &own_b, why)) return false;
  send.assign(size_, {});
  send[0] = own_b;
  if (!b_->post(send, why)) return fail("expert combine (micro-batch B)");
  if (!a2a_->complete(&recv_a, why)) return fail("expert combine (micro-batch A)");
  return collect(cfg, layer, dual_a_, recv_a, outputs_a, why);
}

bool expert_group::finish_dual(const model_config& cfg, const model_weights& w,
                               std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  std::vector<std::span<const std::byte>> recv_b;
  if (!b_->complete(&recv_b, why))
    return *why = "expert combine (micro-batch B), layer " + std::to_string(dual_layer_) + ": " + *why, false;
  if (!collect(cfg, dual_layer_, dual_b_, recv_b, outputs_b, why)) return false;
  return after_round(cfg, w, why);
}

bool expert_group::enable_eplb(const live_eplb_config& cfg, uint32_t num_experts, std::string* why) {
  if (auto e = check_live_eplb(cfg, size_, num_experts); !e.empty()) return *why = e, false;
  eplb_ = cfg;
  return true;
}

uint32_t expert_group::route(uint32_t layer, uint32_t expert, uint32_t num_experts, uint64_t copy_hash) {
  if (counts_.size() <= layer) counts_.resize(layer + 1);
  if (counts_[layer].size() < num_experts) counts_[layer].resize(num_experts, 0.0);
  counts_[layer][expert] += 1;
  uint32_t d = owner(expert, num_experts);
  if (layer < placement_.size() && !placement_[layer].replicas.empty())
    d = policies::pick_replica(placement_[layer], expert, 0, copy_hash, {size_, size_, eplb_.slots_per_rank});
  if (rank_copies_.size() < size_) rank_copies_.resize(size_, 0);
  ++rank_copies_[d];
  return d;
}

std::vector<uint64_t> expert_group::take_rank_copies() {
  auto out = rank_copies_;
  out.resize(size_, 0);
  rank_copies_.assign(size_, 0);
  return out;
}

bool expert_group::replan(const model_config& cfg, const model_weights& w, std::string* why) {
  const policies::eplb_config ec{size_, size_, eplb_.slots_per_rank};
  const uint32_t num_experts = cfg.moe.n_routed_experts;
  placement_.resize(counts_.size());
  const uint64_t per_piece = piece_floats(a2a_->config().slot_bytes);  // as many floats as a slot holds
  if (per_piece == 0) return *why = "EPLB: the all-to-all slot cannot carry expert weights", false;
  for (uint32_t l = 0; l < counts_.size(); ++l) {
    if (counts_[l].empty()) continue;
    auto next = policies::plan_eplb(counts_[l], ec);
    std::fill(counts_[l].begin(), counts_[l].end(), 0.0);
    // What each shard holds now: the placement, or its contiguous block until a plan placed this layer.
    const auto& have = placement_[l].rank_experts.empty() ? policies::static_placement(num_experts, ec).rank_experts
                                                          : placement_[l].rank_experts;
    // Make: every shard gets the experts it newly holds, one piece per exchange (pieces for
    // several shards travel together); the lead (rank 0) moves nothing.
    move_schedule moves{have, next.rank_experts, 1, expert_floats(cfg), per_piece};
    const auto& to_evict = moves.evict;
    std::vector<std::optional<move_schedule::piece>> pieces;
    while (moves.next(&pieces)) {
      std::vector<std::vector<std::byte>> chunks(size_);
      for (uint32_t r = 1; r < size_; ++r)
        if (const auto& p = pieces[r]) {
          chunks[r] = make_piece(cfg, w.layers[l].experts[p->expert], l, p->expert, p->offset, p->floats);
          bytes_installed_ += p->floats * sizeof(float);
        }
      if (!control(chunks, why)) return *why = "EPLB, layer " + std::to_string(l) + ": sending weights: " + *why, false;
    }
    placement_[l] = std::move(next);
    // Break: the experts no longer placed on a shard leave it, within its slot budget again.
    std::vector<std::vector<std::byte>> chunks(size_);
    for (uint32_t r = 1; r < size_; ++r) {
      if (to_evict[r].empty()) continue;
      const chunk_header hd{kind_evict, l, static_cast<uint32_t>(to_evict[r].size())};
      chunks[r].resize(sizeof hd + to_evict[r].size() * sizeof(uint32_t));
      std::memcpy(chunks[r].data(), &hd, sizeof hd);
      std::memcpy(chunks[r].data() + sizeof hd, to_evict[r].data(), to_evict[r].size() * sizeof(uint32_t));
      experts_evicted_ += to_evict[r].size();
    }
    if (std::any_of(chunks.begin(), chunks.end(), [](auto& c) { return !c.empty(); }) && !control(chunks, why))
      return *why = "EPLB, layer " + std::to_string(l) + ": dropping experts: " + *why, false;
  }
  ++plans_;
  return true;
}

bool expert_group::round(const model_config& cfg, const model_weights& w, uint32_t layer,
                         const std::vector<std::vector<std::byte>>& entries, std::vector<std::vector<std::byte>>* outputs,
                         std::string* why) {
  const auto chunks = with_headers(cfg, layer, entries);
  std::vector<std::span<const std::byte>> recv;
  if (!a2a_->exchange(spans(chunks), &recv, why)) return *why = "expert dispatch, layer " + std::to_string(layer) + ": " + *why, false;
  std::vector<std::byte> own;
  if (!serve_expert_chunk(cfg, w, recv[0], &own, why)) return false;
  std::vector<std::span<const std::byte>> send(size_);
  send[0] = own;
  if (!a2a_->exchange(send, &recv, why)) return *why = "expert combine, layer " + std::to_string(layer) + ": " + *why, false;
  if (!collect(cfg, layer, entries, recv, outputs, why)) return false;
  return after_round(cfg, w, why);
}

namespace {

/// A shard's side of an install or evict chunk (see the header); false and a sentence when it is
/// malformed.
bool apply_control(const model_config& cfg, model_weights& w, std::span<const std::byte> chunk, std::string* why) {
  chunk_header hd{};
  std::memcpy(&hd, chunk.data(), sizeof hd);
  const auto bad = [&](const std::string& what) { return *why = "EPLB control chunk: " + what, false; };
  if (hd.layer >= w.layers.size() || !cfg.is_moe_layer(hd.layer)) return bad("layer " + std::to_string(hd.layer) + " has no experts");
  auto& ex = w.layers[hd.layer].experts;
  if (hd.kind == kind_evict) {
    if (chunk.size() != sizeof hd + uint64_t{hd.count} * sizeof(uint32_t)) return bad("an evict list of the wrong size");
    for (uint32_t i = 0; i < hd.count; ++i) {
      uint32_t e;
      std::memcpy(&e, chunk.data() + sizeof hd + i * sizeof e, sizeof e);
      if (e >= ex.size()) return bad("expert " + std::to_string(e) + " does not exist");
      drop_expert(ex[e]);
    }
    return true;
  }
  return install_piece(cfg, hd.layer, ex, chunk, why);
}

/// run_expert_shard's loop; false and why when the group fails.
bool serve_as_shard(const model_config& cfg, model_weights& w, transport::all_to_all& a2a, std::string* why,
                    transport::all_to_all* b) {
  const uint32_t n = a2a.size();
  // Only this rank's contiguous block stays (the lead's EPLB plans move experts in and out).
  keep_expert_block(cfg, w, a2a.config().rank, n);
  const std::vector<std::span<const std::byte>> none(n);
  std::vector<std::span<const std::byte>> recv, recv_b;
  std::vector<std::byte> out, out_b;
  for (;;) {
    if (!a2a.exchange(none, &recv, why)) return false;  // dispatch: rank 0's chunk for this shard
    chunk_header hd{};
    if (recv[0].size() >= sizeof hd) std::memcpy(&hd, recv[0].data(), sizeof hd);
    if (hd.kind == kind_stop) return true;
    if (hd.kind == kind_install || hd.kind == kind_evict || hd.kind == kind_idle) {
      if (hd.kind != kind_idle && !apply_control(cfg, w, recv[0], why)) return false;
      if (!a2a.exchange(none, &recv, why)) return false;  // answered, empty
      continue;
    }
    if (b && !b->post(none, why)) return false;  // micro-batch B's dispatch travels meanwhile
    if (!serve_expert_chunk(cfg, w, recv[0], &out, why)) return false;
    std::vector<std::span<const std::byte>> send(n);
    if (b) {
      if (!b->complete(&recv_b, why)) return false;
      send[0] = out;
      if (!a2a.post(send, why)) return false;  // A's outputs travel while B's experts compute
      if (!serve_expert_chunk(cfg, w, recv_b[0], &out_b, why)) return false;
      if (!a2a.complete(&recv, why)) return false;
      send[0] = out_b;
      if (!b->exchange(send, &recv_b, why)) return false;
      continue;
    }
    send[0] = out;
    if (!a2a.exchange(send, &recv, why)) return false;  // combine
  }
}

}  // namespace

bool run_expert_shard(const model_config& cfg, model_weights& w, transport::all_to_all& a2a, std::string* why,
                      transport::all_to_all* b) {
  if (serve_as_shard(cfg, w, a2a, why, b)) return true;
  a2a.signal_abort();  // the lead's wait ends now, naming this shard, not at its timeout
  if (b) b->signal_abort();
  return false;
}

struct expert_peers::shared {
  std::vector<std::string> names;
  std::vector<std::unique_ptr<transport::transport>> transports;
  std::vector<std::unique_ptr<transport::all_to_all>> a2a;  ///< destroyed before the transports
  std::vector<std::unique_ptr<transport::all_to_all>> b;    ///< dual-batch overlap's second channel, or empty
  std::unique_ptr<std::atomic<bool>[]> left;                ///< [member]: stopped taking part
  std::unique_ptr<std::atomic<bool>[]> out_of_step;         ///< [member]: its group state broke
  ~shared() {
    a2a.clear();
    b.clear();
  }
};

expert_peers::expert_peers(std::shared_ptr<shared> group, uint32_t rank, const model_config& cfg)
  : group_(std::move(group)), rank_(rank), num_experts_(cfg.moe.n_routed_experts) {
  for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l)
    if (cfg.is_moe_layer(l)) moe_layers_.push_back(l);
  store_.resize(cfg.num_hidden_layers);
}

expert_peers::~expert_peers() { leave(); }

uint32_t expert_peers::size() const { return static_cast<uint32_t>(group_->names.size()); }

void expert_peers::leave() {
  if (group_->left[rank_].exchange(true, std::memory_order_acq_rel)) return;
  group_->a2a[rank_]->signal_abort();  // members in other processes learn it at once
  if (dual_batch()) group_->b[rank_]->signal_abort();
}

bool expert_peers::dual_batch() const { return !group_->b.empty(); }

std::string expert_peers::failure() const {
  if (group_->left[rank_].load(std::memory_order_acquire))
    return "data-parallel group: member " + group_->names[rank_] + " has stopped";
  if (auto b = broken(); !b.empty()) return b;
  return gone_peer();
}

std::string expert_peers::broken() const {
  std::lock_guard<std::mutex> lock{broken_mutex_};
  return broken_;
}

void expert_peers::mark_broken(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock{broken_mutex_};
    broken_ = why;
  }
  group_->out_of_step[rank_].store(true, std::memory_order_release);
}

void expert_peers::peer_lost(uint32_t member, const std::string& why) {
  // Members in this process have flags of their own (`left` is also leave()'s guard).
  if (member >= size() || member == rank_ || group_->a2a[member]) return;
  group_->left[member].store(true, std::memory_order_release);  // ends a wait for it (set_abort)
  mark_broken("data-parallel group of " + group_->names[rank_] + ": member " + group_->names[member] + " is lost: " + why);
}

void expert_peers::fault_break_for_test(const std::string& why) {
  mark_broken("data-parallel group, member " + group_->names[rank_] + ": " + why);
}

void expert_peers::hold_block(const model_config& cfg, const model_weights& w) {
  for (uint32_t l : moe_layers_) {
    store_[l].assign(cfg.moe.n_routed_experts, {});
    for (uint32_t e = 0; e < cfg.moe.n_routed_experts && e < w.layers[l].experts.size(); ++e)
      if (owner(e, cfg.moe.n_routed_experts) == rank_) store_[l][e] = w.layers[l].experts[e];
  }
}

void expert_peers::take_block(const model_config& cfg, model_weights& w) {
  for (uint32_t l : moe_layers_) {
    store_[l].assign(cfg.moe.n_routed_experts, {});
    for (uint32_t e = 0; e < cfg.moe.n_routed_experts && e < w.layers[l].experts.size(); ++e)
      if (owner(e, cfg.moe.n_routed_experts) == rank_) store_[l][e] = std::exchange(w.layers[l].experts[e], {});
  }
}

std::vector<uint32_t> expert_peers::held(uint32_t layer) const {
  return layer < store_.size() ? with_weights(store_[layer], num_experts_) : std::vector<uint32_t>{};
}

bool expert_peers::enable_eplb(const live_eplb_config& cfg, uint32_t num_experts, std::string* why) {
  if (auto e = check_live_eplb(cfg, size(), num_experts); !e.empty()) return *why = e, false;
  // The members swap their counts in one exchange: every MoE layer's, as doubles.
  const uint64_t counts = moe_layers_.size() * uint64_t{num_experts} * sizeof(double);
  if (const uint64_t slot = group_->a2a[rank_]->config().slot_bytes; counts > slot)
    return *why = "EPLB: the members' counts (" + std::to_string(counts) + " bytes) do not fit the all-to-all slot of " +
                  std::to_string(slot),
           false;
  eplb_ = cfg;
  return true;
}

uint32_t expert_peers::route(uint32_t layer, uint32_t expert, uint32_t num_experts, uint64_t copy_hash) {
  if (eplb_.slots_per_rank) {
    if (counts_.size() <= layer) counts_.resize(layer + 1);
    if (counts_[layer].size() < num_experts) counts_[layer].resize(num_experts, 0.0);
    counts_[layer][expert] += 1;
  }
  if (layer < placement_.size() && !placement_[layer].replicas.empty())
    return policies::pick_replica(placement_[layer], expert, rank_, copy_hash, {size(), size(), eplb_.slots_per_rank});
  return owner(expert, num_experts);
}

std::string expert_peers::gone_peer() const {
  for (uint32_t r = 0; r < size(); ++r)
    if (r != rank_ && group_->left[r].load(std::memory_order_acquire))
      return "data-parallel group of " + group_->names[rank_] + ": member " + group_->names[r] + " has stopped";
    else if (r != rank_ && group_->out_of_step[r].load(std::memory_order_acquire))
      return "data-parallel group of " + group_->names[rank_] + ": member " + group_->names[r] + " is out of step";
    else if (r != rank_ && group_->a2a[rank_]->peer_aborted(r))
      return "data-parallel group of " + group_->names[rank_] + ": member " + group_->names[r] + " has left the group";
  return {};
}

std::string expert_peers::refuse_round(uint32_t layer) const {
  if (auto b = broken(); !b.empty()) return b;
  if (moe_layers_.empty() || layer != moe_layers_[next_])
    return "data-parallel group: " + group_->names[rank_] + " was asked for MoE layer " + std::to_string(layer) +
           " where its step is at another";
  return next_ == 0 ? gone_peer() : std::string{};  // a step starts only with every member there
}

bool expert_peers::round(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries,
                         std::vector<std::vector<std::byte>>* outputs, std::string* why) {
  if (auto refused = refuse_round(layer); !refused.empty()) return *why = refused, false;
  if (dual_batch()) {  // every member runs both channels: the rows go as micro-batch A
    std::vector<std::vector<std::byte>> none_b;
    return exchange_round(cfg, layer, entries, nullptr, outputs, &none_b, why);
  }
  return exchange_round(cfg, layer, entries, nullptr, outputs, nullptr, why);
}

bool expert_peers::round_dual(const model_config& cfg, uint32_t layer,
                              const std::vector<std::vector<std::byte>>& entries_a,
                              const std::vector<std::vector<std::byte>>& entries_b,
                              std::vector<std::vector<std::byte>>* outputs_a,
                              std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  if (!dual_batch()) return *why = "data-parallel group: " + group_->names[rank_] + " has no second channel", false;
  if (auto refused = refuse_round(layer); !refused.empty()) return *why = refused, false;
  return exchange_round(cfg, layer, entries_a, &entries_b, outputs_a, outputs_b, why);
}

bool expert_peers::post_dual_a(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                               std::string* why) {
  if (!dual_batch()) return *why = "data-parallel group: " + group_->names[rank_] + " has no second channel", false;
  if (auto refused = refuse_round(layer); !refused.empty()) return *why = refused, false;
  ++split_rounds_;
  return dual_start(cfg, layer, std::move(entries_a), why);
}

bool expert_peers::fail_round(uint32_t layer, const std::string& stage, const std::string& what, std::string* why) {
  *why = "data-parallel group, member " + group_->names[rank_] + ", " + stage + " of MoE layer " + std::to_string(layer) +
         ": " + what;
  mark_broken(*why);
  group_->a2a[rank_]->signal_abort();  // the members in other processes stop waiting for this one
  if (dual_batch()) group_->b[rank_]->signal_abort();
  return false;
}

bool expert_peers::dual_start(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                              std::string* why) {
  dual_layer_ = layer;
  dual_a_ = std::move(entries_a);
  dual_too_big_.clear();
  dual_refused_.clear();
  const auto chunks_a = dispatch_chunks(cfg, layer, dual_a_, &dual_too_big_);
  if (!group_->a2a[rank_]->post(spans(chunks_a), why)) return fail_round(layer, "dispatch (micro-batch A)", *why, why);
  return true;
}

bool expert_peers::exchange_dual(const model_config& cfg, std::vector<std::vector<std::byte>> entries_b,
                                 std::vector<std::vector<std::byte>>* outputs_a, std::string* why) {
  auto& a2a = *group_->a2a[rank_];
  auto& b = *group_->b[rank_];
  const uint32_t layer = dual_layer_;
  dual_b_ = std::move(entries_b);
  std::vector<std::span<const std::byte>> recv, recv_b;
  // B's dispatch travels while A's experts run, A's combine while B's run.
  const auto chunks_b = dispatch_chunks(cfg, layer, dual_b_, &dual_too_big_);
  if (!b.post(spans(chunks_b), why)) return fail_round(layer, "dispatch (micro-batch B)", *why, why);
  if (!a2a.complete(&recv, why)) return fail_round(layer, "dispatch (micro-batch A)", *why, why);
  const auto served_a = serve_all(cfg, layer, recv, &dual_refused_);
  if (!a2a.post(spans(served_a), why)) return fail_round(layer, "combine (micro-batch A)", *why, why);
  if (!b.complete(&recv_b, why)) return fail_round(layer, "dispatch (micro-batch B)", *why, why);
  const auto served_b = serve_all(cfg, layer, recv_b, &dual_refused_);
  if (!b.post(spans(served_b), why)) return fail_round(layer, "combine (micro-batch B)", *why, why);
  if (!a2a.complete(&recv, why)) return fail_round(layer, "combine (micro-batch A)", *why, why);
  if (!dual_refused_.empty()) return fail_round(layer, "dispatch", dual_refused_, why);
  if (!dual_too_big_.empty()) {
    // This member's rows did not fit: the round still ends here, in step with the others, and
    // the job fails alone (finish_dual is not called for it).
    std::vector<std::vector<std::byte>> unused;
    if (!finish_dual(cfg, &unused, why)) return false;
    return *why = dual_too_big_, false;
  }
  if (!collect(cfg, layer, dual_a_, recv, outputs_a, why)) return fail_round(layer, "combine", *why, why);
  return true;
}

bool expert_peers::finish_dual(const model_config& cfg, std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  const uint32_t layer = dual_layer_;
  std::vector<std::span<const std::byte>> recv_b;
  if (!group_->b[rank_]->complete(&recv_b, why)) return fail_round(layer, "combine (micro-batch B)", *why, why);
  if (dual_too_big_.empty() && !collect(cfg, layer, dual_b_, recv_b, outputs_b, why))
    return fail_round(layer, "combine", *why, why);
  return end_round(cfg, why);
}

bool expert_peers::end_round(const model_config& cfg, std::string* why) {
  ++rounds_;
  next_ = (next_ + 1) % moe_layers_.size();
  // Between steps, on every member at the same round: a new plan never splits a step.
  if (next_ == 0 && eplb_.slots_per_rank && rounds_ - planned_at_ >= eplb_.interval_rounds) {
    planned_at_ = rounds_;
    if (!replan(cfg, why)) return fail_round(moe_layers_.back(), "EPLB", *why, why);
  }
  return true;
}

bool expert_peers::join(const model_config& cfg, std::string* why) {
  if (auto b = broken(); !b.empty()) return *why = b, false;
  if (moe_layers_.empty()) return true;
  if (next_ == 0) {
    if (!group_->a2a[rank_]->peer_started()) return true;
    ++joined_;
  }
  const std::vector<std::vector<std::byte>> none(size());
  std::vector<std::vector<std::byte>> outputs, outputs_b;
  do {
    if (!exchange_round(cfg, moe_layers_[next_], none, dual_batch() ? &none : nullptr, &outputs,
                        dual_batch() ? &outputs_b : nullptr, why))
      return false;
  } while (next_ != 0);
  return true;
}

std::vector<std::vector<std::byte>> expert_peers::dispatch_chunks(const model_config& cfg, uint32_t layer,
                                                                  const std::vector<std::vector<std::byte>>& entries,
                                                                  std::string* too_big) const {
  auto chunks = with_headers(cfg, layer, entries);
  const uint64_t slot = group_->a2a[rank_]->config().slot_bytes;
  for (uint32_t d = 0; d < size(); ++d)
    if (chunks[d].size() > slot) {
      // The job fails alone: this member still takes its part in the round, with no rows.
      *too_big = "data-parallel group, member " + group_->names[rank_] + ", MoE layer " + std::to_string(layer) + ": " +
                 std::to_string(chunks[d].size()) + " bytes of rows for " + group_->names[d] + " exceed the slot of " +
                 std::to_string(slot) + " (a job larger than the group was sized for)";
      return with_headers(cfg, layer, std::vector<std::vector<std::byte>>(size()));
    }
  return chunks;
}

std::vector<std::vector<std::byte>> expert_peers::serve_all(const model_config& cfg, uint32_t layer,
                                                            const std::vector<std::span<const std::byte>>& recv,
                                                            std::string* refused) {
  // A chunk this member cannot serve gets no answer, but the combine still runs: its sender
  // fails this round at once (an answer of the wrong size) instead of at the timeout.
  const auto find = [this](uint32_t l, uint32_t e) -> const expert_weights* {
    return l < store_.size() && e < store_[l].size() ? &store_[l][e] : nullptr;
  };
  std::vector<std::vector<std::byte>> served(size());
  std::string why;
  for (uint32_t s = 0; s < size(); ++s) {
    chunk_header hd{};
    if (recv[s].size() >= sizeof hd) std::memcpy(&hd, recv[s].data(), sizeof hd);
    if (hd.kind != kind_work || hd.layer != layer)
      *refused = "member " + group_->names[s] + " is out of step (it sent kind " + std::to_string(hd.kind) +
                 " for layer " + std::to_string(hd.layer) + ")";
    else if (!serve_chunk(cfg, find, recv[s], &served[s], &why))
      *refused = "serving " + group_->names[s] + ": " + why;
    else
      copies_served_ += hd.count;
    if (!refused->empty()) return std::vector<std::vector<std::byte>>(size());
  }
  return served;
}

bool expert_peers::exchange_round(const model_config& cfg, uint32_t layer,
                                  const std::vector<std::vector<std::byte>>& entries,
                                  const std::vector<std::vector<std::byte>>* entries_b,
                                  std::vector<std::vector<std::byte>>* outputs,
                                  std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  // Any failure leaves the members out of step for good: later rounds fail with the same words
  // (fail_round).
  if (dual_batch()) {  // in three steps, as the executor runs them to overlap attention
    const std::vector<std::vector<std::byte>> none(size());
    return dual_start(cfg, layer, entries, why) && exchange_dual(cfg, entries_b ? *entries_b : none, outputs, why) &&
           finish_dual(cfg, outputs_b, why);
  }
  auto& a2a = *group_->a2a[rank_];
  std::string too_big, refused;
  std::vector<std::span<const std::byte>> recv;
  const auto chunks = dispatch_chunks(cfg, layer, entries, &too_big);
  if (!a2a.exchange(spans(chunks), &recv, why)) return fail_round(layer, "dispatch", *why, why);
  const auto served = serve_all(cfg, layer, recv, &refused);
  if (!a2a.exchange(spans(served), &recv, why)) return fail_round(layer, "combine", *why, why);
  if (!refused.empty()) return fail_round(layer, "dispatch", refused, why);
  if (too_big.empty() && !collect(cfg, layer, entries, recv, outputs, why)) return fail_round(layer, "combine", *why, why);
  if (!end_round(cfg, why)) return false;
  if (!too_big.empty()) return *why = too_big, false;  // the job fails; the group does not
  return true;
}

bool expert_peers::replan(const model_config& cfg, std::string* why) {
  auto& a2a = *group_->a2a[rank_];
  const uint32_t n = size(), experts = num_experts_;
  const policies::eplb_config ec{n, n, eplb_.slots_per_rank};
  // 1. Every member's copies per MoE layer and expert, summed in member order: the same input,
  //    so every member computes the same plan.
  std::vector<double> mine(moe_layers_.size() * experts, 0.0);
  for (size_t i = 0; i < moe_layers_.size(); ++i) {
    const uint32_t l = moe_layers_[i];
    if (l < counts_.size())
      for (uint32_t e = 0; e < counts_[l].size() && e < experts; ++e) mine[i * experts + e] = counts_[l][e];
  }
  counts_.clear();
  const std::span<const std::byte> bytes{reinterpret_cast<const std::byte*>(mine.data()), mine.size() * sizeof(double)};
  std::vector<std::span<const std::byte>> recv;
  if (!a2a.exchange(std::vector<std::span<const std::byte>>(n, bytes), &recv, why)) return false;
  std::vector<double> total(mine.size(), 0.0);
  for (uint32_t s = 0; s < n; ++s) {
    if (recv[s].size() != bytes.size())
      return *why = "member " + group_->names[s] + " sent " + std::to_string(recv[s].size()) + " bytes of counts, not " +
                    std::to_string(bytes.size()),
             false;
    for (size_t i = 0; i < total.size(); ++i) {
      double v;
      std::memcpy(&v, recv[s].data() + i * sizeof v, sizeof v);
      total[i] += v;
    }
  }
  placement_.resize(cfg.num_hidden_layers);
  const uint64_t per_piece = piece_floats(a2a.config().slot_bytes);
  if (per_piece == 0) return *why = "the all-to-all slot cannot carry expert weights", false;
  for (size_t i = 0; i < moe_layers_.size(); ++i) {
    const uint32_t l = moe_layers_[i];
    const auto now = placement_[l].replicas.empty() ? policies::static_placement(experts, ec) : placement_[l];
    auto next = policies::plan_eplb({total.begin() + i * experts, total.begin() + (i + 1) * experts}, ec);
    // 2. Make: every member gets the experts it newly holds from their lowest current holder,
    //    one piece per member per exchange. Every member walks the same schedule.
    move_schedule moves{now.rank_experts, next.rank_experts, 0, expert_floats(cfg), per_piece};
    const auto& to_evict = moves.evict;
    std::vector<std::optional<move_schedule::piece>> pieces;
    while (moves.next(&pieces)) {
      std::vector<std::vector<std::byte>> chunks(n);
      for (uint32_t d = 0; d < n; ++d)
        if (const auto& p = pieces[d]; p && now.replicas[p->expert].front() == rank_)
          chunks[d] = make_piece(cfg, store_[l][p->expert], l, p->expert, p->offset, p->floats);
      if (!a2a.exchange(spans(chunks), &recv, why)) return *why = "sending expert weights: " + *why, false;
      for (uint32_t s = 0; s < n; ++s) {
        if (recv[s].empty()) continue;
        if (!install_piece(cfg, l, store_[l], recv[s], why)) return *why = "from " + group_->names[s] + ": " + *why, false;
        bytes_installed_ += recv[s].size() - sizeof(install_header);
      }
    }
    // 3. The placement switches; 4. break: what this member no longer holds leaves it.
    for (uint32_t e : to_evict[rank_]) drop_expert(store_[l][e]);
    experts_evicted_ += to_evict[rank_].size();
    placement_[l] = std::move(next);
  }
  ++plans_;
  return true;
}

std::vector<std::shared_ptr<expert_peers>> make_peer_group(
    const std::vector<std::string>& names, const std::vector<uint32_t>& local, const model_config& cfg,
    const peer_group_config& group, const peer_transport_maker& make_transport, const peer_rendezvous& rendezvous,
    std::string* why) {
  using none = std::vector<std::shared_ptr<expert_peers>>;
  const auto size = static_cast<uint32_t>(names.size());
  if (size < 2) return *why = "a data-parallel group needs at least 2 members", none{};
  if (cfg.moe.n_routed_experts < size)
    return *why = "model " + cfg.name + " has " + std::to_string(cfg.moe.n_routed_experts) + " routed experts, fewer than " +
                  std::to_string(size) + " data-parallel members",
           none{};
  auto g = std::make_shared<expert_peers::shared>();
  g->names = names;
  g->a2a.resize(size);  // null: a member in another process
  if (group.dual_batch) g->b.resize(size);
  g->left = std::make_unique<std::atomic<bool>[]>(size);
  g->out_of_step = std::make_unique<std::atomic<bool>[]>(size);
  const int channels = group.dual_batch ? 2 : 1;
  std::vector<std::vector<std::pair<uint32_t, transport::region_key>>> mine(channels);
  for (uint32_t r : local) {
    if (r >= size || g->a2a[r]) return *why = "data-parallel member index " + std::to_string(r) + " is out of place", none{};
    std::string err;
    auto t = make_transport(names[r], &err);
    if (!t) return *why = "data-parallel member " + names[r] + ": no transport: " + err, none{};
    for (int c = 0; c < channels; ++c) {
      auto& a2a = (c == 0 ? g->a2a : g->b)[r];
      a2a = std::make_unique<transport::all_to_all>(*t, names,
                                                    transport::all_to_all_config{r, size, group.slot_bytes, group.timeout});
      // A member that stopped or broke is seen at once, even in the middle of a step: in this
      // process by its flags, elsewhere by the abort word it put into this member's region.
      a2a->set_abort([g = g.get(), c = a2a.get()](uint32_t s) {
        return g->left[s].load(std::memory_order_acquire)          ? std::string{"it has stopped"}
               : g->out_of_step[s].load(std::memory_order_acquire) ? std::string{"it is out of step"}
               : c->peer_aborted(s)                                ? std::string{"it has left the group"}
                                                                   : std::string{};
      });
      if (!a2a->error().empty()) {
        g->transports.push_back(std::move(t));  // after the all-to-alls registered on it
        return *why = a2a->error(), none{};
      }
      mine[c].emplace_back(r, a2a->key());
    }
    g->transports.push_back(std::move(t));
  }
  for (int c = 0; c < channels; ++c) {
    std::vector<transport::region_key> keys;
    if (!rendezvous(c, mine[c], &keys, why)) return none{};
    if (keys.size() != size)
      return *why = "data-parallel rendezvous: " + std::to_string(keys.size()) + " keys for " + std::to_string(size) +
                    " members",
             none{};
    for (uint32_t r : local) (c == 0 ? g->a2a : g->b)[r]->connect(keys);
  }
  none members;
  for (uint32_t r : local) members.push_back(std::make_shared<expert_peers>(g, r, cfg));
  return members;
}

std::vector<std::shared_ptr<expert_peers>> make_peer_group(const std::vector<std::string>& names,
                                                           const model_config& cfg, const peer_group_config& group,
                                                           const peer_transport_maker& make_transport,
                                                           std::string* why) {
  std::vector<uint32_t> all(names.size());
  for (uint32_t r = 0; r < all.size(); ++r) all[r] = r;
  const auto in_process = [](uint32_t, const std::vector<std::pair<uint32_t, transport::region_key>>& mine,
                             std::vector<transport::region_key>* keys, std::string*) {
    keys->assign(mine.size(), {});
    for (const auto& [r, key] : mine) (*keys)[r] = key;
    return true;
  };
  return make_peer_group(names, all, cfg, group, make_transport, in_process, why);
}

}  // namespace baton::gpu
