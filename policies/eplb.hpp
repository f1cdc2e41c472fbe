#pragma once

// Expert-parallel load balancing (EPLB; seed 000 §3.3, seed 001 §3): where the routed experts of
// one MoE layer live across the EP ranks of an engine. Each rank has a fixed number of expert
// slots (its memory budget); slots beyond one per expert hold redundant copies of hot experts,
// and a token bound for an expert goes to one of its copies, preferring one on its own node so
// dispatch stays off the network.
//
// From per-window activation counts, plan_eplb() gives the hottest experts the extra copies
// (each copy takes an equal share of its expert's tokens), then places copies heaviest first
// on the least-loaded rank that has a free slot and no copy of that expert yet, spreading an
// expert's copies over nodes. Pure: counts in, a placement out; the runtime applies a new
// placement between steps (routing picks experts; placement only decides where they run, so
// tokens never change).

#include <cstdint>
#include <string>
#include <vector>

namespace baton::policies {

struct eplb_config {
  uint32_t num_ranks = 8;       ///< EP size
  uint32_t ranks_per_node = 8;  ///< dispatch inside a node rides NVLink, across nodes the NIC
  uint32_t slots_per_rank = 0;  ///< expert copies a rank can hold; >= ceil(experts / num_ranks)
  uint32_t max_redundant = UINT32_MAX;  ///< extra copies in all, at most (default: every spare slot)
  std::string validate(uint32_t num_experts) const;
};

struct expert_placement {
  std::vector<std::vector<uint32_t>> rank_experts;  ///< per rank: the experts it holds, ascending
  std::vector<std::vector<uint32_t>> replicas;      ///< per expert: the ranks holding a copy, ascending
  uint32_t num_experts() const { return static_cast<uint32_t>(replicas.size()); }
};

/// The rank holding `expert` when `num_experts` sit in contiguous blocks over `num_ranks`:
/// expert e on rank e * num_ranks / num_experts.
inline uint32_t block_owner(uint32_t expert, uint32_t num_ranks, uint32_t num_experts) {
  return static_cast<uint32_t>(uint64_t{expert} * num_ranks / num_experts);
}

/// Experts in contiguous blocks, one copy each (what an engine does without EPLB; block_owner).
expert_placement static_placement(uint32_t num_experts, const eplb_config& cfg);

/// The EPLB plan for `load` (tokens per expert over the last window).
expert_placement plan_eplb(const std::vector<double>& load, const eplb_config& cfg);

/// Each rank's share of `load` when every expert's tokens split evenly over its copies.
std::vector<double> rank_loads(const expert_placement& p, const std::vector<double>& load);

/// The hottest rank's load over the mean: 1 is perfect balance; the MoE step waits for the max.
double imbalance(const std::vector<double>& rank_load);

/// The copy of `expert` that serves a token from `src_rank`: among the copies on the token's
/// node if there are any (dispatch inside the node), else among all; `token_hash` spreads tokens
/// evenly over the candidates, deterministically.
uint32_t pick_replica(const expert_placement& p, uint32_t expert, uint32_t src_rank, uint64_t token_hash,
                      const eplb_config& cfg);

}  // namespace baton::policies
