#include "gpu/expert_parallel.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <optional>

#include "gpu/cpu_kernels.hpp"
#include "gpu/expert_wire.hpp"
#include "transport/all_to_all.hpp"

namespace baton::gpu {

using namespace expert_wire;

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
  watch_shards({});
}

void expert_group::watch_shards(std::function<std::string(uint32_t)> gone) {
  gone_ = std::move(gone);
  for (auto* c : {a2a_.get(), b_.get()})
    if (c) c->set_abort([this, c](uint32_t s) { return judge(*c, s); });
}

std::string expert_group::judge(transport::all_to_all& c, uint32_t s) {
  std::string why = c.peer_aborted(s) ? std::string{"the shard failed"} : gone_ ? gone_(s) : std::string{};
  if (!why.empty()) {  // out for good: the rank is told (failure()) and steps aside
    std::lock_guard<std::mutex> lock{failure_mutex_};
    if (failure_.empty()) failure_ = "expert shard " + std::to_string(s) + " of " + std::to_string(size_) + ": " + why;
  }
  return why;
}

bool expert_group::check_shards() {
  if (a2a_)
    for (uint32_t s = 1; s < size_ && failure().empty(); ++s) judge(*a2a_, s);
  return !failure().empty();
}

std::string expert_group::failure() const {
  std::lock_guard<std::mutex> lock{failure_mutex_};
  return failure_;
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
    return *why = "expert dispatch (micro-batch A), layer " + std::to_string(layer) + ": " + *why, lost(why);
  return true;
}

bool expert_group::exchange_dual(const model_config& cfg, const model_weights& w,
                                 std::vector<std::vector<std::byte>> entries_b,
                                 std::vector<std::vector<std::byte>>* outputs_a, std::string* why) {
  const uint32_t layer = dual_layer_;
  auto fail = [&](const char* stage) { return *why = std::string{stage} + ", layer " + std::to_string(layer) + ": " + *why, lost(why); };
  dual_b_ = std::move(entries_b);
  std::vector<std::span<const std::byte>> recv_a, recv_b;
  std::vector<std::byte> own_a, own_b;
  // B's dispatch starts; A's experts run here while B's chunks travel.
  if (!b_->post(spans(with_headers(cfg, layer, dual_b_)), why)) return fail("expert dispatch (micro-batch B)");
  if (!a2a_->complete(&recv_a, why)) return fail("expert dispatch (micro-batch A)");
  if (!serve_expert_chunk(cfg, w, recv_a[0], &own_a, why)) return fail("EP rank 0 serving micro-batch A");
  std::vector<std::span<const std::byte>> send(size_);
  send[0] = own_a;
  if (!a2a_->post(send, why)) return fail("expert combine (micro-batch A)");
  // B's experts run while A's outputs travel back.
  if (!b_->complete(&recv_b, why)) return fail("expert dispatch (micro-batch B)");
  if (!serve_expert_chunk(cfg, w, recv_b[0], &own_b, why)) return fail("EP rank 0 serving micro-batch B");
  send.assign(size_, {});
  send[0] = own_b;
  if (!b_->post(send, why)) return fail("expert combine (micro-batch B)");
  if (!a2a_->complete(&recv_a, why)) return fail("expert combine (micro-batch A)");
  if (!collect(cfg, layer, dual_a_, recv_a, outputs_a, why)) return fail("expert combine (micro-batch A)");
  return true;
}

bool expert_group::finish_dual(const model_config& cfg, const model_weights& w,
                               std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  std::vector<std::span<const std::byte>> recv_b;
  const std::string where = "expert combine (micro-batch B), layer " + std::to_string(dual_layer_) + ": ";
  if (!b_->complete(&recv_b, why) || !collect(cfg, dual_layer_, dual_b_, recv_b, outputs_b, why))
    return *why = where + *why, lost(why);
  return after_round(cfg, w, why) || lost(why);
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
  const auto at = [&](const char* stage) { return *why = std::string{stage} + ", layer " + std::to_string(layer) + ": " + *why, lost(why); };
  if (!a2a_->exchange(spans(chunks), &recv, why)) return at("expert dispatch");
  std::vector<std::byte> own;
  if (!serve_expert_chunk(cfg, w, recv[0], &own, why)) return at("EP rank 0 serving");
  std::vector<std::span<const std::byte>> send(size_);
  send[0] = own;
  if (!a2a_->exchange(send, &recv, why)) return at("expert combine");
  if (!collect(cfg, layer, entries, recv, outputs, why)) return at("expert combine");
  return after_round(cfg, w, why) || lost(why);
}

bool expert_group::lost(std::string* why) {
  {
    std::lock_guard<std::mutex> lock{failure_mutex_};
    if (failure_.empty()) failure_ = "the lead: " + *why;
  }
  for (auto* c : {a2a_.get(), b_.get()})
    if (c) c->signal_abort();  // ends an open exchange too (abandon)
  return false;
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

}  // namespace baton::gpu
