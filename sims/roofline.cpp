#include "sims/roofline.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>

namespace baton::sims {

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Achievable rates. H200: measured on the project's H200 (platform-notes §6: cuBLAS bf16 GEMM
// ~790 TFLOP/s, device copy 4,257 GB/s read + write, pinned PCIe 55 GB/s). H100 and H800 SXM:
// the same efficiency (80% of the 989 TFLOP/s datasheet rate, 89% of HBM) applied to their
// datasheets (3.35 TB/s HBM3); the H800's NVLink is cut to 400 GB/s. NIC: one 400 Gb/s port per
// GPU (50 GB/s), as in DeepSeek's and Mooncake's clusters. Launch overhead: 40 us per step.
// RTX 4090 and RTX PRO 6000 Blackwell (the GPUs of the measured vLLM runs, whose memory sizes
// give their KV capacity; their step times come from profile tables, not from this roofline):
// the same efficiency applied to their datasheets (165 and ~500 TFLOP/s dense bf16 with fp32
// accumulation; 1,008 and 1,792 GB/s; 24 and 96 GB), no NVLink, PCIe 4.0 and 5.0 x16.
const std::vector<gpu_spec>& gpus() {
  static const std::vector<gpu_spec> g = {
      {"H200", 790, 4257, 450, 55, 50, 141, 40},
      {"H100", 790, 2980, 450, 55, 50, 80, 40},
      {"H800", 790, 2980, 200, 55, 50, 80, 40},
      {"RTX4090", 132, 894, 25, 25, 50, 24, 40},
      {"RTXPRO6000", 400, 1590, 55, 55, 50, 96, 40},
  };
  return g;
}

model_shape gqa(std::string name, uint32_t layers, uint32_t hidden, uint32_t heads, uint32_t kv_heads,
                uint32_t head_dim, double params) {
  model_shape m;
  m.name = std::move(name);
  m.num_layers = layers;
  m.hidden = hidden;
  m.num_heads = heads;
  m.head_dim = head_dim;
  m.kv_bytes_per_token = uint64_t{layers} * 2 * kv_heads * head_dim * 2;
  m.kv_heads = kv_heads;
  // QK^T and PV: 2 FLOPs per multiply-add, each over head_dim, for every head.
  m.attn_flops_per_pair = 4.0 * layers * heads * head_dim;
  m.dense_params = params;
  return m;
}

// Shapes from each model's config.json (Hugging Face). DeepSeek-V3: MLA with a 512 + 64 = 576
// value latent per token and layer (absorbed: scores over 576, values over 512), 58 MoE layers of
// 256 routed experts (8 per token; 3 x 7168 x 2048 parameters each), 671 B parameters in all.
const std::vector<model_shape>& models() {
  static const std::vector<model_shape> m = [] {
    std::vector<model_shape> v = {
        gqa("llama-3-8b", 32, 4096, 32, 8, 128, 8.03e9),
        gqa("llama-3-70b", 80, 8192, 64, 8, 128, 70.6e9),
        gqa("qwen3-32b", 64, 5120, 64, 8, 128, 32.8e9),
    };
    model_shape ds;
    ds.name = "deepseek-v3";
    ds.num_layers = 61;
    ds.hidden = 7168;
    ds.num_heads = 128;
    ds.head_dim = 128;
    ds.kv_bytes_per_token = uint64_t{61} * 576 * 2;
    ds.attn_flops_per_pair = 2.0 * 61 * 128 * (576 + 512);
    ds.prefill_attn_flops_per_pair = 2.0 * 61 * 128 * (192 + 128);  // K (nope + rope) and V expanded
    ds.routed_params = 58.0 * 256 * 3 * 7168 * 2048;
    ds.dense_params = 671e9 - ds.routed_params;
    ds.num_experts = 256;
    ds.experts_per_token = 8;
    ds.moe_layers = 58;
    ds.bytes_per_param = 1.0;  // fp8 weights, as DeepSeek serves them
    ds.max_context = 131072;
    v.push_back(ds);
    return v;
  }();
  return m;
}

}  // namespace

double model_shape::active_params() const {
  return dense_params + (num_experts ? routed_params * experts_per_token / num_experts : 0.0);
}

std::optional<gpu_spec> named_gpu(const std::string& name) {
  for (const auto& g : gpus())
    if (lower(g.name) == lower(name)) return g;
  return std::nullopt;
}

std::vector<std::string> gpu_names() {
  std::vector<std::string> out;
  for (const auto& g : gpus()) out.push_back(g.name);
  return out;
}

std::optional<model_shape> named_model(const std::string& name) {
  for (const auto& m : models())
    if (m.name == lower(name)) return m;
  return std::nullopt;
}

std::vector<std::string> model_names() {
  std::vector<std::string> out;
  for (const auto& m : models()) out.push_back(m.name);
  return out;
}

double roofline::step_us(const std::vector<step_seq>& seqs, std::string* why) const {
  const auto b = step(seqs);
  if (why) *why = b.bound;
  return b.total_us;
}

step_breakdown roofline::step(const std::vector<step_seq>& seqs) const {
  double tokens = 0, kv_read = 0, largest = 0, attn = 0;
  for (const auto& s : seqs) {
    const auto q = static_cast<double>(s.tokens), c = static_cast<double>(s.context);
    tokens += q;
    // Causal: new token i attends to context + i + 1 positions.
    const double p = q * c + q * (q + 1) / 2.0;
    const double per_pair = q > 1 && model.prefill_attn_flops_per_pair > 0 ? model.prefill_attn_flops_per_pair
                                                                            : model.attn_flops_per_pair;
    attn += per_pair * p;
    kv_read += c + q;
    largest = std::max(largest, 2.0 * model.dense_params * q + per_pair * p);
  }
  step_breakdown b;
  const auto& m = model;
  // Routed weights a set of `picks` expert choices touches among `experts` experts (each read once).
  auto touched = [&](double experts, double picks) {
    return experts > 0 ? experts * (m.routed_params / m.num_experts) * (1.0 - std::pow(1.0 - 1.0 / experts, picks)) : 0.0;
  };
  if (ep.size <= 1 || m.num_experts == 0) {
    const double flops = (2.0 * m.active_params() * tokens + attn) / tp;
    // Weights: dense ones always; routed experts only as far as this step's tokens touch them.
    const double routed = touched(m.num_experts, tokens * m.experts_per_token);
    // Per GPU: its share of the weights, and its shard of the KV (all of it for MLA: every TP
    // rank reads the whole latent).
    const double bytes = (m.dense_params + routed) * m.bytes_per_param / tp + kv_read * m.kv_bytes_per_token / m.kv_shards(tp);
    const double compute_us = flops / (gpu.matmul_tflops * 1e6), memory_us = bytes / (gpu.hbm_gbps * 1e3);
    // Two all-reduces of the activations per layer (ring: 2 (tp - 1) / tp of the bytes each way).
    const double comm_us = tp > 1 ? 2.0 * m.num_layers * tokens * m.hidden * 2.0 * 2.0 * (tp - 1) / tp /
                                        (gpu.nvlink_gbps * 1e3)
                                  : 0.0;
    b.bound = compute_us >= memory_us ? "compute" : "memory";
    b.gpu_us = std::max(compute_us, memory_us);
    b.total_us = b.gpu_us + comm_us + gpu.step_overhead_us;
    return b;
  }
  // Expert parallel: every GPU attends for 1/n of the tokens with the whole dense model, and runs
  // its experts for the tokens routed to them; the busiest GPU (imbalance) sets the pace.
  const double n = ep.size;
  const double routed_active = m.routed_params * m.experts_per_token / m.num_experts;
  // Data-parallel attention splits sequences, not one sequence's tokens: a GPU takes at least
  // the largest sequence of the step whole.
  const double flops = std::max((2.0 * m.dense_params * tokens + attn) / n, largest / std::min<double>(n, ep.attention_tp)) +
                       2.0 * routed_active * tokens / n * ep.imbalance;
  const double experts_per_gpu = (m.num_experts + ep.redundant_experts) / n;
  const double bytes = m.dense_params * m.bytes_per_param +
                       touched(experts_per_gpu, tokens * m.experts_per_token / n * ep.imbalance) * m.bytes_per_param +
                       kv_read * m.kv_bytes_per_token / n;
  const double compute_us = flops / (gpu.matmul_tflops * 1e6), memory_us = bytes / (gpu.hbm_gbps * 1e3);
  b.gpu_us = std::max(compute_us, memory_us);
  // Per MoE layer each GPU sends its tokens' expert copies out (dispatch) and takes the results
  // back (combine); copies for experts on its node ride NVLink, the rest a NIC.
  const double nodes = std::ceil(n / ep.gpus_per_node);
  const double cross = ep.cross_node_fraction >= 0 ? ep.cross_node_fraction : (nodes - 1) / nodes;
  const double in_node = std::min<double>(n, ep.gpus_per_node);
  const double intra = (1.0 - cross) * (in_node - 1) / in_node;  // a copy on its own GPU moves nothing
  const double per_gpu = tokens / n * m.experts_per_token * m.hidden * (ep.dispatch_bytes + ep.combine_bytes);
  b.all_to_all_us = m.moe_layers * per_gpu * (cross / (gpu.nic_gbps * 1e3) + intra / (gpu.nvlink_gbps * 1e3));
  b.cross_node_bytes = m.moe_layers * per_gpu * cross * n;
  b.intra_node_bytes = m.moe_layers * per_gpu * intra * n;
  const double busy = ep.dual_batch_overlap ? std::max(b.gpu_us, b.all_to_all_us) : b.gpu_us + b.all_to_all_us;
  b.bound = b.all_to_all_us > b.gpu_us ? "all-to-all" : compute_us >= memory_us ? "compute" : "memory";
  b.total_us = busy + gpu.step_overhead_us;
  return b;
}

uint64_t roofline::kv_capacity_tokens() const {
  const double total = gpu.hbm_gb * 1e9 * gpus() * 0.9;
  double weights = (model.dense_params + model.routed_params) * model.bytes_per_param;
  if (ep.size > 1 && model.num_experts)  // dense weights on every GPU, plus the redundant copies
    weights += (model.dense_params * (ep.size - 1) +
                model.routed_params / model.num_experts * ep.redundant_experts) * model.bytes_per_param;
  if (total <= weights) return 0;
  // Tensor parallelism keeps a token's KV in kv_shards(tp) pieces; more ranks than pieces (MLA:
  // every rank) hold copies, which take memory too. (Expert parallelism: data-parallel attention,
  // one copy per sequence as modelled here.)
  const double copies = ep.size > 1 ? 1.0 : static_cast<double>(tp) / model.kv_shards(tp);
  return static_cast<uint64_t>((total - weights) / (static_cast<double>(model.kv_bytes_per_token) * copies));
}

double roofline::kv_transfer_us(uint64_t tokens) const {
  // Each GPU sends its distinct shard over its own NIC (copies need not travel twice).
  const uint32_t senders = ep.size > 1 ? gpus() : model.kv_shards(tp);
  return static_cast<double>(tokens) * model.kv_bytes_per_token / senders / (gpu.nic_gbps * 1e3);
}

}  // namespace baton::sims
