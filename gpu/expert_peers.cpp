// Data-parallel attention's expert groups (expert_peers in gpu/expert_parallel.hpp): every
// member serves its experts to all, in lockstep rounds over two all-to-alls.

#include "gpu/expert_parallel.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>

#include "gpu/expert_wire.hpp"
#include "transport/all_to_all.hpp"

namespace baton::gpu {

using namespace expert_wire;

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
  group_->left[member].store(true, std::memory_order_seq_cst);  // ends a wait for it (set_abort)
  mark_broken("data-parallel group of " + group_->names[rank_] + ": member " + group_->names[member] + " is lost: " + why);
  nudge_all();  // a wait asleep for it looks again now
}

void expert_peers::nudge_all() {
  group_->a2a[rank_]->nudge();
  if (dual_batch()) group_->b[rank_]->nudge();
}

void expert_peers::retire(const std::string& why) {
  for (uint32_t m = 0; m < size(); ++m)
    if (m != rank_ && !group_->a2a[m]) group_->left[m].store(true, std::memory_order_seq_cst);
  mark_broken("data-parallel group of " + group_->names[rank_] + " re-forms: " + why);
  nudge_all();
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

void expert_peers::doze(std::chrono::microseconds d, const std::function<bool()>& ready) {
  group_->a2a[rank_]->doze(d, ready);  // a step starts on the first channel (join)
}

void expert_peers::nudge() { group_->a2a[rank_]->nudge(); }

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
      // Sequentially consistent: a sleeping wait's last look, against the nudge after a flag.
      a2a->set_abort([g = g.get(), c = a2a.get()](uint32_t s) {
        return g->left[s].load(std::memory_order_seq_cst)          ? std::string{"it has stopped"}
               : g->out_of_step[s].load(std::memory_order_seq_cst) ? std::string{"it is out of step"}
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
