#include "gpu/expert_parallel.hpp"

#include <algorithm>
#include <cstring>

#include "gpu/cpu_kernels.hpp"
#include "transport/all_to_all.hpp"

namespace baton::gpu {

namespace {

enum : uint32_t { kind_work = 1, kind_stop = 2 };

struct chunk_header {
  uint32_t kind, layer, count;
};

}  // namespace

uint64_t expert_slot_bytes(const model_config& cfg, uint64_t max_rows) {
  return sizeof(chunk_header) + max_rows * cfg.moe.num_experts_per_tok * (sizeof(uint32_t) + cfg.hidden_size * sizeof(float));
}

bool serve_expert_chunk(const model_config& cfg, const model_weights& w, std::span<const std::byte> chunk,
                        std::vector<std::byte>* out, std::string* why) {
  chunk_header hd{};
  if (chunk.size() < sizeof hd) return *why = "expert dispatch: a chunk of " + std::to_string(chunk.size()) + " bytes has no header", false;
  std::memcpy(&hd, chunk.data(), sizeof hd);
  const uint64_t h = cfg.hidden_size, entry = sizeof(uint32_t) + h * sizeof(float);
  if (hd.layer >= cfg.num_hidden_layers || !cfg.is_moe_layer(hd.layer) || chunk.size() != sizeof hd + hd.count * entry)
    return *why = "expert dispatch: layer " + std::to_string(hd.layer) + " with " + std::to_string(hd.count) +
                  " entries does not fit a chunk of " + std::to_string(chunk.size()) + " bytes of this model",
           false;
  const auto& lw = w.layers[hd.layer];
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
    const auto& xp = lw.experts[e];
    swiglu_mlp(x.data(), n, h, xp.gate.data(), xp.up.data(), xp.down.data(), f, gate.data(), up.data(), y.data(), nullptr);
    for (size_t i = 0; i < n; ++i) std::memcpy(out->data() + rows[i] * h * sizeof(float), y.data() + i * h, h * sizeof(float));
  }
  return true;
}

expert_group::expert_group(std::unique_ptr<transport::transport> t, std::unique_ptr<transport::all_to_all> a2a,
                           uint32_t size, std::unique_ptr<transport::all_to_all> b)
  : t_(std::move(t)), a2a_(std::move(a2a)), b_(std::move(b)), size_(size) {}

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

void expert_group::after_round() {
  // Between rounds: a new plan never splits one round's copies over two placements.
  if (eplb_.slots_per_rank && ++rounds_ % eplb_.interval_rounds == 0) replan();
}

bool expert_group::round_dual(const model_config& cfg, const model_weights& w, uint32_t layer,
                              const std::vector<std::vector<std::byte>>& entries_a,
                              const std::vector<std::vector<std::byte>>& entries_b,
                              std::vector<std::vector<std::byte>>* outputs_a,
                              std::vector<std::vector<std::byte>>* outputs_b, std::string* why) {
  auto fail = [&](const char* stage) { return *why = std::string{stage} + ", layer " + std::to_string(layer) + ": " + *why, false; };
  const auto chunks_a = with_headers(cfg, layer, entries_a), chunks_b = with_headers(cfg, layer, entries_b);
  std::vector<std::span<const std::byte>> recv_a, recv_b;
  std::vector<std::byte> own_a, own_b;
  // Both dispatches start; micro-batch A's experts run here while B's chunks travel.
  if (!a2a_->post(spans(chunks_a), why) || !b_->post(spans(chunks_b), why)) return fail("expert dispatch");
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
  if (!collect(cfg, layer, entries_a, recv_a, outputs_a, why)) return false;
  if (!b_->complete(&recv_b, why)) return fail("expert combine (micro-batch B)");
  if (!collect(cfg, layer, entries_b, recv_b, outputs_b, why)) return false;
  after_round();
  return true;
}

bool expert_group::enable_eplb(const live_eplb_config& cfg, uint32_t num_experts, std::string* why) {
  const policies::eplb_config ec{size_, size_, cfg.slots_per_rank};
  if (auto e = ec.validate(num_experts); !e.empty()) return *why = e, false;
  if (cfg.interval_rounds == 0) return *why = "EPLB: interval_rounds must be >= 1", false;
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

void expert_group::replan() {
  const policies::eplb_config ec{size_, size_, eplb_.slots_per_rank};
  placement_.resize(counts_.size());
  for (size_t l = 0; l < counts_.size(); ++l) {
    if (counts_[l].empty()) continue;
    placement_[l] = policies::plan_eplb(counts_[l], ec);
    std::fill(counts_[l].begin(), counts_[l].end(), 0.0);
  }
  ++plans_;
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
  after_round();
  return true;
}

bool run_expert_shard(const model_config& cfg, const model_weights& w, transport::all_to_all& a2a, std::string* why,
                      transport::all_to_all* b) {
  const uint32_t n = a2a.size();
  const std::vector<std::span<const std::byte>> none(n);
  std::vector<std::span<const std::byte>> recv, recv_b;
  std::vector<std::byte> out, out_b;
  for (;;) {
    if (!a2a.exchange(none, &recv, why)) return false;  // dispatch: rank 0's chunk for this shard
    chunk_header hd{};
    if (recv[0].size() >= sizeof hd) std::memcpy(&hd, recv[0].data(), sizeof hd);
    if (hd.kind == kind_stop) return true;
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

}  // namespace baton::gpu
