// DeepSeek's layers in the CUDA executor (gpu/cuda/deepseek_path.hpp). Host code: g++ builds it
// against the CUDA runtime, the kernels are in deepseek_kernels.cu.

#include "gpu/cuda/deepseek_path.hpp"

#include <algorithm>
#include <cmath>

#include "gpu/hf_model.hpp"

namespace baton::gpu::cuda {

namespace {

/// The low-rank norms of MLA are built with transformers' default epsilon, not rms_norm_eps
/// (as the CPU executor's latent_attention_layer).
constexpr float lora_norm_eps = 1e-6f;

uint32_t route_method(const std::string& m) { return m == "greedy" ? 0 : m == "noaux_tc" ? 2 : 1; }

}  // namespace

deepseek_path::deepseek_path(const model_config& cfg, dtype type, layer_services services)
  : cfg_(cfg),
    type_(type),
    s_(std::move(services)),
    rope_factor_(rope_attention_factor(cfg)),
    scale_(attention_softmax_scale(cfg)),
    layers_(cfg.num_hidden_layers) {}

std::string deepseek_path::supports(const model_config& c) {
  auto too = [&](const char* field, uint64_t value, const char* limit) {
    return "model " + c.name + ": " + field + " " + std::to_string(value) + " is beyond the CUDA kernels' " + limit;
  };
  if (c.is_mla()) {
    const uint32_t lat = c.kv_dim();
    if (c.mla.kv_lora_rank > mla_max_lora) return too("kv_lora_rank", c.mla.kv_lora_rank, "1024");
    if (lat > mla_max_latent) return too("kv_lora_rank + qk_rope_head_dim", lat, "1408");
    if (c.mla.qk_rope_head_dim % 2) return too("qk_rope_head_dim (odd)", c.mla.qk_rope_head_dim, "even sizes");
    for (const auto& [field, value] : {std::pair{"hidden_size", c.hidden_size}, std::pair{"q_lora_rank", c.mla.q_lora_rank},
                                       std::pair{"qk_nope_head_dim", c.mla.qk_nope_head_dim}})
      if (value > head_gemv_max_in) return too(field, value, "8192");
  }
  if (c.moe.n_routed_experts) {
    if (c.moe.n_routed_experts > moe_max_experts) return too("n_routed_experts", c.moe.n_routed_experts, "512");
    if (c.moe.num_experts_per_tok > 32) return too("num_experts_per_tok", c.moe.num_experts_per_tok, "32");
    if (c.hidden_size > head_gemv_max_in) return too("hidden_size", c.hidden_size, "8192 (the router)");
  }
  return {};
}

std::string deepseek_path::upload(const model_weights& w) {
  std::string e;
  auto up = [&](device_buffer& d, std::vector<const std::vector<float>*> parts, bool matrix) {
    if (e.empty()) e = s_.upload(d, parts, matrix);
  };
  for (uint32_t l = 0; l < cfg_.num_hidden_layers && e.empty(); ++l) {
    const auto& src = w.layers[l];
    auto& d = layers_[l];
    if (cfg_.is_mla()) {
      if (cfg_.mla.q_lora_rank) {
        up(d.wq_a, {&src.wq_a}, true);
        up(d.q_a_norm, {&src.q_a_norm}, false);
        up(d.wq_b, {&src.wq_b}, true);
      } else {
        up(d.wq, {&src.wq}, true);
      }
      up(d.wkv_a, {&src.wkv_a}, true);
      up(d.kv_a_norm, {&src.kv_a_norm}, false);
      up(d.w_uk_t, {&src.w_uk_t}, true);
      up(d.w_uv, {&src.w_uv}, true);
    }
    if (!cfg_.is_moe_layer(l)) continue;
    std::vector<const std::vector<float>*> gate_up, down;
    for (size_t x = 0; x < src.experts.size(); ++x) {
      const auto& ex = src.experts[x];
      if (ex.gate.empty() || ex.up.empty() || ex.down.empty())
        return "layer " + std::to_string(l) + ": routed expert " + std::to_string(x) +
               " has no weights in this process (a load for expert parallelism keeps only its members' experts, "
               "and expert parallelism runs on the CPU executor)";
      gate_up.insert(gate_up.end(), {&ex.gate, &ex.up});  // expert x's product: [gate | up][hidden]
      down.push_back(&ex.down);
    }
    if (src.experts.size() != cfg_.moe.n_routed_experts)
      return "layer " + std::to_string(l) + ": " + std::to_string(src.experts.size()) + " routed experts, the config says " +
             std::to_string(cfg_.moe.n_routed_experts);
    up(d.router, {&src.router}, false);  // fp32, as DeepSeek computes its router
    if (!src.router_bias.empty()) up(d.router_bias, {&src.router_bias}, false);
    up(d.experts_gu, gate_up, true);
    up(d.experts_down, down, true);
  }
  return e;
}

void deepseek_path::draw(const std::function<void(device_buffer&, uint64_t, bool, float, float)>& fill) {
  const uint64_t h = cfg_.hidden_size, H = cfg_.num_attention_heads;
  auto inv_sqrt = [](uint64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); };
  for (uint32_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    auto& d = layers_[l];
    if (cfg_.is_mla()) {
      const auto& m = cfg_.mla;
      const uint64_t qd = cfg_.q_dim(), lat = cfg_.kv_dim();
      if (m.q_lora_rank) {
        fill(d.wq_a, m.q_lora_rank * h, true, inv_sqrt(h), 0.0f);
        fill(d.q_a_norm, m.q_lora_rank, false, 0.1f, 1.0f);
        fill(d.wq_b, qd * m.q_lora_rank, true, inv_sqrt(m.q_lora_rank), 0.0f);
      } else {
        fill(d.wq, qd * h, true, inv_sqrt(h), 0.0f);
      }
      fill(d.wkv_a, lat * h, true, inv_sqrt(h), 0.0f);
      fill(d.kv_a_norm, m.kv_lora_rank, false, 0.1f, 1.0f);
      fill(d.w_uk_t, H * m.kv_lora_rank * m.qk_nope_head_dim, true, inv_sqrt(m.qk_nope_head_dim), 0.0f);
      fill(d.w_uv, H * m.v_head_dim * m.kv_lora_rank, true, inv_sqrt(m.kv_lora_rank), 0.0f);
    }
    if (!cfg_.is_moe_layer(l)) continue;
    const auto& m = cfg_.moe;
    const uint64_t E = m.n_routed_experts, mf = m.moe_intermediate_size;
    fill(d.router, E * h, false, inv_sqrt(h), 0.0f);
    if (m.topk_method == "noaux_tc") fill(d.router_bias, E, false, 0.01f, 0.0f);
    fill(d.experts_gu, E * 2 * mf * h, true, inv_sqrt(h), 0.0f);
    fill(d.experts_down, E * h * mf, true, 0.5f * inv_sqrt(mf), 0.0f);
  }
}

std::string deepseek_path::reserve(uint32_t rows) {
  const uint64_t R = rows, tb = dtype_bytes(type_), h = cfg_.hidden_size, H = cfg_.num_attention_heads;
  std::string e;
  auto grow = [&](device_buffer& b, uint64_t bytes) {
    if (e.empty() && b.grow(std::max<uint64_t>(bytes, 16)) != cudaSuccess)
      e = "allocate DeepSeek scratch (" + std::to_string(bytes) + " bytes for " + std::to_string(rows) + " rows)";
  };
  if (cfg_.is_mla()) {
    const auto& m = cfg_.mla;
    const uint64_t lat = cfg_.kv_dim();
    grow(qa_, R * m.q_lora_rank * 4);
    grow(qa_t_, R * m.q_lora_rank * tb);
    grow(q_, R * cfg_.q_dim() * 4);
    grow(kva_, R * lat * 4);
    grow(q_lat_, R * H * lat * 4);
    grow(o_lat_, R * H * m.kv_lora_rank * 4);
  }
  if (cfg_.moe.n_routed_experts) {
    const auto& m = cfg_.moe;
    const uint64_t E = m.n_routed_experts, k = m.num_experts_per_tok, pairs = R * k, mf = m.moe_intermediate_size;
    if (type_ != dtype::f32) grow(hn32_, R * h * 4);  // fp32 jobs route from hn itself
    grow(logits_, R * E * 4);
    grow(chosen_, pairs * 4);
    grow(weight_, pairs * 4);
    grow(slot_, pairs * 4);
    grow(slot_row_, pairs * 4);
    grow(offsets_, (E + 1) * 4);
    grow(tile_expert_, uint64_t{moe_max_tiles(static_cast<uint32_t>(pairs), static_cast<uint32_t>(E))} * 4);
    grow(tile_first_, uint64_t{moe_max_tiles(static_cast<uint32_t>(pairs), static_cast<uint32_t>(E))} * 4);
    grow(num_tiles_, 4);
    grow(gu2_, pairs * 2 * mf * 4);
    grow(act2_, pairs * mf * tb);
    grow(ye_, pairs * h * 4);
    grow(shared_out_, R * h * 4);
  }
  return e;
}

void deepseek_path::write_latent(uint32_t l, const void* hn, const row_args& a, void* kv_layer) {
  const auto& m = cfg_.mla;
  const auto& d = layers_[l];
  const uint32_t n = a.rows, h = cfg_.hidden_size, qd = cfg_.q_dim(), lat = cfg_.kv_dim();
  if (m.q_lora_rank) {
    s_.gemm(hn, d.wq_a.ptr, qa_.as<float>(), n, m.q_lora_rank, h, 0.0f);
    s_.check(launch_rmsnorm_cast({qa_.as<float>(), nullptr, d.q_a_norm.as<float>(), qa_t_.ptr, n, m.q_lora_rank,
                                  lora_norm_eps, type_},
                                 s_.stream),
             "q_a norm");
    s_.gemm(qa_t_.ptr, d.wq_b.ptr, q_.as<float>(), n, qd, m.q_lora_rank, 0.0f);
  } else {
    s_.gemm(hn, d.wq.ptr, q_.as<float>(), n, qd, h, 0.0f);
  }
  s_.gemm(hn, d.wkv_a.ptr, kva_.as<float>(), n, lat, h, 0.0f);
  s_.check(launch_mla_finish({kva_.as<float>(), d.kv_a_norm.as<float>(), q_.as<float>(), q_lat_.as<float>(), s_.inv_freq,
                              a.positions, a.kv_slot, kv_layer, n, cfg_.num_attention_heads, m.kv_lora_rank,
                              m.qk_nope_head_dim, m.qk_rope_head_dim, lora_norm_eps, rope_factor_, m.rope_interleave,
                              type_},
                             s_.stream),
           "latent norm/rope/store");
}

void deepseek_path::attend(uint32_t l, const row_args& a, const void* kv_layer, const void* wo, float* x, void* attn_out) {
  const auto& m = cfg_.mla;
  const auto& d = layers_[l];
  const uint32_t n = a.rows, H = cfg_.num_attention_heads, lat = cfg_.kv_dim(), qk = cfg_.qk_head_dim();
  // The latent query's first kv_lora_rank values: W_UK_h^T q_nope (mla_finish wrote the rotated rest).
  s_.check(launch_head_gemv({q_.as<float>(), cfg_.q_dim(), qk, d.w_uk_t.ptr, type_, q_lat_.ptr, uint64_t{H} * lat, lat,
                             dtype::f32, n, H, m.qk_nope_head_dim, m.kv_lora_rank},
                            s_.stream),
           "absorb W_UK");
  s_.check(launch_latent_attention({q_lat_.as<float>(), kv_layer, a.positions, a.page_table, a.row_pages, o_lat_.as<float>(),
                                    n, H, m.kv_lora_rank, m.qk_rope_head_dim, a.page_size_tokens, a.page_elems, scale_, type_,
                                    a.splits, a.split_positions, a.partial},
                                   s_.stream),
           "latent attention");
  s_.check(launch_head_gemv({o_lat_.as<float>(), uint64_t{H} * m.kv_lora_rank, m.kv_lora_rank, d.w_uv.ptr, type_, attn_out,
                             uint64_t{H} * m.v_head_dim, m.v_head_dim, type_, n, H, m.kv_lora_rank, m.v_head_dim},
                            s_.stream),
           "apply W_UV");
  s_.gemm(attn_out, wo, x, n, cfg_.hidden_size, cfg_.attn_out_dim(), 1.0f);
}

void deepseek_path::moe(uint32_t l, uint32_t n, float* x, const float* mlp_norm, const void* hn, const shared_mlp& sh) {
  const auto& m = cfg_.moe;
  const auto& d = layers_[l];
  const uint32_t h = cfg_.hidden_size, E = m.n_routed_experts, k = m.num_experts_per_tok, mf = m.moe_intermediate_size;
  const uint32_t pairs = n * k, tiles = moe_max_tiles(pairs, E);
  // The router reads the normed residual in fp32 whatever the executor's type.
  const float* hn32 = static_cast<const float*>(hn);
  if (type_ != dtype::f32) {
    s_.check(launch_rmsnorm_cast({x, nullptr, mlp_norm, hn32_.ptr, n, h, cfg_.rms_norm_eps, dtype::f32}, s_.stream),
             "router input norm");
    hn32 = hn32_.as<float>();
  }
  s_.check(launch_head_gemv({hn32, h, 0, d.router.ptr, dtype::f32, logits_.ptr, E, 0, dtype::f32, n, 1, h, E}, s_.stream),
           "router");
  s_.check(launch_moe_route({logits_.as<float>(), d.router_bias.as<float>(), chosen_.as<uint32_t>(), weight_.as<float>(), n,
                             E, k, m.n_group, m.topk_group, m.scoring == "sigmoid", route_method(m.topk_method),
                             m.norm_topk_prob, m.routed_scaling_factor},
                            s_.stream),
           "route");
  s_.check(launch_moe_plan({chosen_.as<uint32_t>(), n, k, E, slot_.as<uint32_t>(), slot_row_.as<uint32_t>(),
                            offsets_.as<uint32_t>(), tile_expert_.as<uint32_t>(), tile_first_.as<uint32_t>(),
                            num_tiles_.as<uint32_t>()},
                           s_.stream),
           "plan the grouped products");
  const grouped_gemm_params gate_up{hn, h, slot_row_.as<uint32_t>(), d.experts_gu.ptr, gu2_.as<float>(),
                                    offsets_.as<uint32_t>(), tile_expert_.as<uint32_t>(), tile_first_.as<uint32_t>(),
                                    num_tiles_.as<uint32_t>(), tiles, 2 * mf, h, type_, tensor_cores_};
  s_.check(launch_grouped_gemm(gate_up, s_.stream), "experts' gate/up");
  s_.check(launch_swiglu({gu2_.as<float>(), act2_.ptr, pairs, mf, type_}, s_.stream), "experts' swiglu");
  grouped_gemm_params down = gate_up;
  down.a = act2_.ptr;
  down.a_stride = mf;
  down.a_rows = nullptr;
  down.w = d.experts_down.ptr;
  down.y = ye_.as<float>();
  down.n = h;
  down.k = mf;
  s_.check(launch_grouped_gemm(down, s_.stream), "experts' down");
  if (sh.f) {
    s_.gemm(hn, sh.gate_up, sh.gu, n, 2 * sh.f, h, 0.0f);
    s_.check(launch_swiglu({sh.gu, sh.act, n, sh.f, type_}, s_.stream), "shared experts' swiglu");
    s_.gemm(sh.act, sh.down, shared_out_.as<float>(), n, h, sh.f, 0.0f);
  }
  s_.check(launch_moe_combine({x, ye_.as<float>(), slot_.as<uint32_t>(), weight_.as<float>(),
                               sh.f ? shared_out_.as<float>() : nullptr, n, k, h},
                              s_.stream),
           "combine the experts");
}

}  // namespace baton::gpu::cuda
