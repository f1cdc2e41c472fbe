#pragma once

// A roofline step-time model for simulated GPUs (issue 8): a job's time is the larger of its
// FLOPs over the GPU's achievable matrix rate and its bytes (weights once per step, plus the KV
// it reads) over the achievable HBM bandwidth, plus tensor-parallel all-reduces over NVLink and a
// fixed per-step launch overhead. Pure: numbers in, microseconds out. Named GPUs and model shapes
// below; every constant says where it comes from.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace baton::sims {

struct gpu_spec {
  std::string name;
  double matmul_tflops = 0;   ///< achievable dense bf16 (not the datasheet peak)
  double hbm_gbps = 0;        ///< achievable HBM bandwidth, GB/s (1e9 B/s)
  double nvlink_gbps = 0;     ///< per-GPU NVLink bandwidth for TP all-reduce, one direction
  double pcie_gbps = 0;       ///< host <-> device, pinned
  double nic_gbps = 0;        ///< one NIC's share for KV transfer between nodes
  double hbm_gb = 0;          ///< memory per GPU
  double step_overhead_us = 0;  ///< launches and scheduling per step (CUDA graphs assumed for decode)
};

/// H200, H100, H800 (SXM), RTX4090, RTXPRO6000; case-insensitive. Empty for an unknown name.
std::optional<gpu_spec> named_gpu(const std::string& name);
std::vector<std::string> gpu_names();

struct model_shape {
  std::string name;
  uint32_t num_layers = 0;
  uint32_t hidden = 0;
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  /// Bytes of KV per token, all layers (GQA: 2 x kv_heads x head_dim x 2 B; MLA: latent x 2 B).
  uint64_t kv_bytes_per_token = 0;
  /// GQA: KV heads, the most ways tensor parallelism can split a token's KV. 0: MLA, whose
  /// latent every head reads, so every TP rank holds (and reads) all of it.
  uint32_t kv_heads = 0;
  /// Distinct shards of a token's KV over `tp` ranks (ranks beyond them hold copies).
  uint32_t kv_shards(uint32_t tp) const { return kv_heads ? std::min(tp, kv_heads) : 1; }
  /// Attention FLOPs per (query token, context token) pair, all layers.
  double attn_flops_per_pair = 0;
  /// The same for prompt rows (a sequence with more than one new token), when they are computed
  /// another way: MLA prefill expands K and V per head rather than attending over the absorbed
  /// latent (0: attn_flops_per_pair).
  double prefill_attn_flops_per_pair = 0;
  double dense_params = 0;        ///< parameters every token uses (attention, shared experts, embeddings)
  double routed_params = 0;       ///< MoE: all routed experts' parameters (0: dense model)
  uint32_t num_experts = 0;       ///< routed experts
  uint32_t experts_per_token = 0;
  uint32_t moe_layers = 0;        ///< layers with routed experts (dispatch and combine each)
  double bytes_per_param = 2.0;   ///< bf16
  uint32_t max_context = 131072;
  double active_params() const;   ///< per token
};

/// llama-3-8b, llama-3-70b, qwen3-32b, deepseek-v3; case-insensitive. Empty for an unknown name.
std::optional<model_shape> named_model(const std::string& name);
std::vector<std::string> model_names();

/// One sequence's part of a step: `tokens` new tokens on top of `context` already in its KV.
struct step_seq {
  uint32_t tokens = 0;
  uint32_t context = 0;
};

/// Expert parallelism of an instance (seed 000 §3.3): `size` GPUs, attention data-parallel over
/// them (each group of attention_tp GPUs attends for its share of the sequences, whole sequences:
/// the largest one bounds the step; dense weights on every GPU), the routed
/// experts sharded over them, and per MoE layer a dispatch (fp8 activations) and a combine (bf16)
/// all-to-all, over NVLink inside a node and the NICs across nodes.
struct ep_layout {
  uint32_t size = 1;             ///< 1: no expert parallelism (the instance is tp GPUs)
  uint32_t gpus_per_node = 8;
  double imbalance = 1.0;        ///< the busiest GPU's routed tokens over the mean (EPLB's measure)
  double cross_node_fraction = -1;  ///< of dispatched copies; < 0: uniform ((nodes - 1) / nodes)
  uint32_t redundant_experts = 0;   ///< extra expert copies per MoE layer over the instance (memory)
  /// GPUs that share one sequence's attention (tensor + sequence parallel inside a data-parallel
  /// group): DeepSeek-V3 runs attention as TP4 with SP in both stages (its report, §3.4).
  uint32_t attention_tp = 4;
  /// Dual-batch overlap: two micro-batches alternate, one's all-to-all under the other's compute.
  bool dual_batch_overlap = true;
  double dispatch_bytes = 1.0, combine_bytes = 2.0;  ///< per activation value
};

/// Where a step's time goes, per GPU of the instance (they run in lockstep).
struct step_breakdown {
  double total_us = 0;
  double gpu_us = 0;          ///< the busiest GPU's compute or memory time
  double all_to_all_us = 0;   ///< dispatch + combine over every MoE layer
  double cross_node_bytes = 0, intra_node_bytes = 0;  ///< the whole instance's all-to-all traffic
  std::string bound;          ///< compute, memory or all-to-all
};

struct roofline {
  gpu_spec gpu;
  model_shape model;
  uint32_t tp = 1;  ///< tensor-parallel degree of the instance: FLOPs, weights and KV split tp ways
  ep_layout ep;     ///< ep.size > 1: an expert-parallel instance of ep.size GPUs (tp is then 1)

  uint32_t gpus() const { return ep.size > 1 ? ep.size : tp; }
  /// The step's time in microseconds; `why`, if given, says which bound won.
  double step_us(const std::vector<step_seq>& seqs, std::string* why = nullptr) const;
  step_breakdown step(const std::vector<step_seq>& seqs) const;
  /// KV tokens one instance holds: HBM left after the weights (90% usable), over the KV size.
  uint64_t kv_capacity_tokens() const;
  /// Time to move n tokens of KV over one NIC (disaggregated handoff), microseconds.
  double kv_transfer_us(uint64_t tokens) const;
};

}  // namespace baton::sims
