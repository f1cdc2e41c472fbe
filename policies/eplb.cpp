#include "policies/eplb.hpp"

#include <algorithm>
#include <numeric>

namespace baton::policies {

std::string eplb_config::validate(uint32_t num_experts) const {
  if (num_ranks == 0 || ranks_per_node == 0) return "EPLB: num_ranks and ranks_per_node must be >= 1";
  if (num_experts == 0) return "EPLB: no experts to place";
  if (uint64_t{slots_per_rank} * num_ranks < num_experts)
    return "EPLB: " + std::to_string(num_ranks) + " ranks x " + std::to_string(slots_per_rank) +
           " slots cannot hold " + std::to_string(num_experts) + " experts";
  return {};
}

expert_placement static_placement(uint32_t num_experts, const eplb_config& cfg) {
  expert_placement p;
  p.rank_experts.resize(cfg.num_ranks);
  p.replicas.resize(num_experts);
  if (cfg.num_ranks == 0) return p;  // nowhere to put them (plan_eplb's fallback for a bad config)
  for (uint32_t e = 0; e < num_experts; ++e) {
    const auto r = block_owner(e, cfg.num_ranks, num_experts);
    p.rank_experts[r].push_back(e);
    p.replicas[e].push_back(r);
  }
  return p;
}

expert_placement plan_eplb(const std::vector<double>& load, const eplb_config& cfg) {
  const auto n = static_cast<uint32_t>(load.size());
  if (!cfg.validate(n).empty()) return static_placement(n, cfg);
  // 1. Copies: every expert one; each spare slot to the expert with the most tokens per copy.
  std::vector<uint32_t> copies(n, 1);
  const uint64_t slots = uint64_t{cfg.slots_per_rank} * cfg.num_ranks;
  for (uint64_t spare = std::min<uint64_t>(slots - n, cfg.max_redundant); spare > 0; --spare) {
    uint32_t best = n;
    for (uint32_t e = 0; e < n; ++e) {
      if (copies[e] >= cfg.num_ranks) continue;  // a rank holds at most one copy of an expert
      if (best == n || load[e] / copies[e] > load[best] / copies[best]) best = e;
    }
    if (best == n || load[best] <= 0) break;  // nothing left worth copying
    ++copies[best];
  }
  // 2. Placement, heaviest copy first (longest-processing-time packing).
  std::vector<std::pair<double, uint32_t>> items;
  for (uint32_t e = 0; e < n; ++e)
    for (uint32_t c = 0; c < copies[e]; ++c) items.push_back({load[e] / copies[e], e});
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  expert_placement p;
  p.rank_experts.resize(cfg.num_ranks);
  p.replicas.resize(n);
  std::vector<double> rank_load(cfg.num_ranks, 0.0);
  for (const auto& item : items) {
    const double share = item.first;
    const uint32_t e = item.second;  // a plain variable: lambdas below capture it
    uint32_t best = cfg.num_ranks;
    auto node_has = [&](uint32_t r) {
      for (auto h : p.replicas[e])
        if (h / cfg.ranks_per_node == r / cfg.ranks_per_node) return true;
      return false;
    };
    for (uint32_t r = 0; r < cfg.num_ranks; ++r) {
      if (p.rank_experts[r].size() >= cfg.slots_per_rank) continue;
      if (std::find(p.replicas[e].begin(), p.replicas[e].end(), r) != p.replicas[e].end()) continue;
      if (best == cfg.num_ranks) {
        best = r;
        continue;
      }
      // Least loaded first; among equals, a node that has no copy yet (more nodes dispatch locally).
      const bool fresh = !node_has(r), best_fresh = !node_has(best);
      if (rank_load[r] < rank_load[best] || (rank_load[r] == rank_load[best] && fresh && !best_fresh)) best = r;
    }
    if (best == cfg.num_ranks) continue;  // unreachable when the config validates
    p.rank_experts[best].push_back(e);
    p.replicas[e].push_back(best);
    rank_load[best] += share;
  }
  for (auto& v : p.rank_experts) std::sort(v.begin(), v.end());
  for (auto& v : p.replicas) std::sort(v.begin(), v.end());
  return p;
}

std::vector<double> rank_loads(const expert_placement& p, const std::vector<double>& load) {
  std::vector<double> out(p.rank_experts.size(), 0.0);
  for (uint32_t e = 0; e < p.num_experts() && e < load.size(); ++e)
    for (auto r : p.replicas[e]) out[r] += load[e] / static_cast<double>(p.replicas[e].size());
  return out;
}

double imbalance(const std::vector<double>& rank_load) {
  if (rank_load.empty()) return 1.0;
  const double mean = std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / static_cast<double>(rank_load.size());
  return mean > 0 ? *std::max_element(rank_load.begin(), rank_load.end()) / mean : 1.0;
}

uint32_t pick_replica(const expert_placement& p, uint32_t expert, uint32_t src_rank, uint64_t token_hash,
                      const eplb_config& cfg) {
  const auto& reps = p.replicas[expert];
  const uint32_t per_node = std::max<uint32_t>(cfg.ranks_per_node, 1);
  uint32_t local[64];
  uint32_t n_local = 0;
  for (auto r : reps)
    if (r / per_node == src_rank / per_node && n_local < 64) local[n_local++] = r;
  if (n_local) return local[token_hash % n_local];
  return reps[token_hash % reps.size()];
}

}  // namespace baton::policies
