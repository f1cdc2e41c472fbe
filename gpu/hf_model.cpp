#include "gpu/hf_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "gpu/safetensors.hpp"
#include "gpu/json_file.hpp"
#include "gpu/text_file.hpp"

namespace baton::gpu {

namespace {

using nlohmann::json;

const char* supported =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, DeepseekV2ForCausalLM, "
    "DeepseekV3ForCausalLM";

bool is_deepseek(const std::string& arch) {
  return arch == "DeepseekV2ForCausalLM" || arch == "DeepseekV3ForCausalLM";
}

}  // namespace

namespace {

/// YaRN's magnitude correction for a context stretched by `scale`.
float yarn_mscale(float scale, float mscale) {
  return scale <= 1.0f ? 1.0f : 0.1f * mscale * std::log(scale) + 1.0f;
}

/// YaRN: dimensions that turn fewer than beta_slow times over the original context are
/// interpolated (frequency / factor), those turning more than beta_fast times keep theirs, and a
/// linear ramp blends the ones between.
void yarn_inv_freq(const model_config& cfg, std::vector<float>& f) {
  const auto& rs = cfg.rope_scaling;
  const double dim = cfg.head_dim, base = cfg.rope_theta, old_len = rs.original_max_position_embeddings;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(old_len / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(rs.beta_fast), high = correction_dim(rs.beta_slow);
  if (rs.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // no division by zero
  for (size_t i = 0; i < f.size(); ++i) {
    const float ramp = static_cast<float>(std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0));
    const float extrapolation = 1.0f - ramp;
    const float pos_freq = std::pow(cfg.rope_theta, static_cast<float>(2 * i) / static_cast<float>(cfg.head_dim));
    f[i] = 1.0f / (rs.factor * pos_freq) * (1.0f - extrapolation) + 1.0f / pos_freq * extrapolation;
  }
}

}  // namespace

float rope_attention_factor(const model_config& cfg) {
  const auto& rs = cfg.rope_scaling;
  if (rs.type != "yarn") return 1.0f;
  if (rs.attention_factor > 0) return rs.attention_factor;
  if (rs.mscale > 0 && rs.mscale_all_dim > 0)
    return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim);
  return yarn_mscale(rs.factor, 1.0f);
}

float attention_softmax_scale(const model_config& cfg) {
  float scale = 1.0f / std::sqrt(static_cast<float>(cfg.qk_head_dim()));
  const auto& rs = cfg.rope_scaling;
  if (cfg.is_mla() && rs.type == "yarn" && rs.mscale_all_dim > 0) {
    const float m = yarn_mscale(rs.factor, rs.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

std::vector<float> rope_inv_freq(const model_config& cfg) {
  const uint32_t half = cfg.head_dim / 2;
  std::vector<float> f(half);
  for (uint32_t i = 0; i < half; ++i)
    f[i] = 1.0f / std::pow(cfg.rope_theta, static_cast<float>(2 * i) / static_cast<float>(cfg.head_dim));
  const auto& rs = cfg.rope_scaling;
  if (rs.type == "yarn") yarn_inv_freq(cfg, f);
  if (rs.type == "llama3") {
    // Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    const float old_len = static_cast<float>(rs.original_max_position_embeddings);
    const float low_wavelen = old_len / rs.low_freq_factor, high_wavelen = old_len / rs.high_freq_factor;
    for (auto& x : f) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / x;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        x = x / rs.factor;
        continue;
      }
      const float smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
      x = (1.0f - smooth) * x / rs.factor + smooth * x;
    }
  }
  return f;
}

namespace {

/// DeepSeek-V2/V3: the MLA and MoE fields, with transformers' defaults for absent ones. The
/// families differ where transformers' classes do: V2 scores experts with a softmax and ignores
/// norm_topk_prob; V3 uses sigmoid scores, the correction bias and group-limited top-k (noaux_tc).
template <class Fail, class UintField, class FloatField>
bool parse_deepseek_fields(const json& j, model_config* out, Fail fail, UintField uint_field, FloatField float_field) {
  auto& c = *out;
  const bool v3 = c.architecture == "DeepseekV3ForCausalLM";
  // Present and null means "none" (q_lora_rank, n_routed_experts ...): 0 here.
  auto count_field = [&](const char* key, uint32_t* dst) {
    if (!j.contains(key)) return true;
    if (j[key].is_null()) {
      *dst = 0;
      return true;
    }
    if (!j[key].is_number_unsigned() || j[key].get<uint64_t>() > (1ull << 31))
      return fail(std::string{key} + " must be a non-negative integer or null");
    *dst = static_cast<uint32_t>(j[key].get<uint64_t>());
    return true;
  };
  auto& m = c.mla;
  m = {1536, 512, 128, 64, 128, true};
  auto& e = c.moe;
  e = {};
  e.n_routed_experts = v3 ? 256 : 64;
  e.n_shared_experts = v3 ? 1 : 2;
  e.num_experts_per_tok = v3 ? 8 : 0;
  e.moe_intermediate_size = v3 ? 2048 : 1407;
  e.first_k_dense_replace = v3 ? 3 : 0;
  e.n_group = v3 ? 8 : 0;
  e.topk_group = v3 ? 4 : 0;
  e.routed_scaling_factor = v3 ? 2.5f : 1.0f;
  e.scoring = v3 ? "sigmoid" : "softmax";
  e.topk_method = v3 ? "noaux_tc" : "greedy";
  e.norm_topk_prob = v3;
  if (!count_field("q_lora_rank", &m.q_lora_rank) || !uint_field("kv_lora_rank", &m.kv_lora_rank, false) ||
      !uint_field("qk_nope_head_dim", &m.qk_nope_head_dim, false) ||
      !uint_field("qk_rope_head_dim", &m.qk_rope_head_dim, false) || !uint_field("v_head_dim", &m.v_head_dim, false) ||
      !count_field("n_routed_experts", &e.n_routed_experts) || !count_field("n_shared_experts", &e.n_shared_experts) ||
      !count_field("num_experts_per_tok", &e.num_experts_per_tok) ||
      !count_field("moe_intermediate_size", &e.moe_intermediate_size) ||
      !count_field("first_k_dense_replace", &e.first_k_dense_replace) || !count_field("n_group", &e.n_group) ||
      !count_field("topk_group", &e.topk_group) || !float_field(j, "routed_scaling_factor", &e.routed_scaling_factor))
    return false;
  if (v3) {
    e.norm_topk_prob = j.value("norm_topk_prob", true);
    m.rope_interleave = j.value("rope_interleave", true);
  } else {
    e.topk_method = j.value("topk_method", std::string{"greedy"});
    if (e.topk_method != "greedy" && e.topk_method != "group_limited_greedy")
      return fail("topk_method " + e.topk_method + " is not one DeepSeek-V2 defines (greedy, group_limited_greedy)");
    // transformers' DeepSeek-V2 never renormalises the chosen experts' weights, vLLM does when
    // this is true: the two would answer differently, so a V2 asking for it is refused (the
    // published V2 checkpoints say false).
    if (j.contains("norm_topk_prob") && j["norm_topk_prob"].is_boolean() && j["norm_topk_prob"].get<bool>())
      return fail("norm_topk_prob true is not supported for DeepSeek-V2 (its weights are used as scored, times "
                  "routed_scaling_factor, as transformers' DeepseekV2 does)");
  }
  // A MoE layer needs experts to route to; transformers builds a dense model otherwise.
  if (e.n_routed_experts == 0 || e.num_experts_per_tok == 0) e.n_routed_experts = 0;
  if (e.topk_method == "greedy") e.n_group = e.topk_group = 1;
  uint32_t freq = 1;
  if (!count_field("moe_layer_freq", &freq)) return false;
  if (freq != 1) return fail("moe_layer_freq " + std::to_string(freq) + " is not supported (every layer from first_k_dense_replace on is MoE)");
  if (j.value("attention_bias", false)) return fail("attention_bias is not supported for DeepSeek models");
  c.head_dim = m.qk_rope_head_dim;  // as transformers sets it: the rotary width
  c.num_key_value_heads = c.num_attention_heads;  // MLA has no separate KV heads
  return true;
}

bool parse_hf_config_unchecked(const std::string& text, const std::string& source, model_config* out, std::string* why) {
  json j;
  if (!parse_json_object(text, source, &j, why)) return false;
  auto fail = [&](const std::string& s) {
    *why = source + ": " + s;
    return false;
  };
  model_config c;
  if (!j.contains("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string())
    return fail("no \"architectures\" list");
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM" && c.architecture != "Qwen3ForCausalLM" && !is_deepseek(c.architecture))
    return fail("architecture " + c.architecture + " is not supported (supported: " + supported + ")");
  auto uint_field = [&](const char* key, uint32_t* dst, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) *why = source + ": missing " + key;
      return !required;
    }
    if (!j[key].is_number_unsigned() || j[key].get<uint64_t>() == 0 || j[key].get<uint64_t>() > (1ull << 31)) {
      *why = source + ": " + key + " must be a positive integer";
      return false;
    }
    *dst = static_cast<uint32_t>(j[key].get<uint64_t>());
    return true;
  };
  auto float_field = [&](const json& o, const char* key, float* dst) {
    if (!o.contains(key) || o[key].is_null()) return true;
    // Read wide: a float conversion of 1e39 is undefined (in practice inf, and NaN logits later).
    const double d = o[key].is_number() ? o[key].get<double>() : 0.0;
    if (!o[key].is_number() || !std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max()) {
      *why = source + ": " + key + " must be a number a float holds" +
             (o[key].is_number() ? ", got " + o[key].dump() : std::string{});
      return false;
    }
    *dst = static_cast<float>(d);
    return true;
  };
  if (!uint_field("vocab_size", &c.vocab_size, true) || !uint_field("hidden_size", &c.hidden_size, true) ||
      !uint_field("intermediate_size", &c.intermediate_size, true) ||
      !uint_field("num_hidden_layers", &c.num_hidden_layers, true) ||
      !uint_field("num_attention_heads", &c.num_attention_heads, true))
    return false;
  c.num_key_value_heads = c.num_attention_heads;
  if (!uint_field("num_key_value_heads", &c.num_key_value_heads, false)) return false;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  if (!uint_field("head_dim", &c.head_dim, false)) return false;
  c.max_position_embeddings = 2048;
  if (!uint_field("max_position_embeddings", &c.max_position_embeddings, false)) return false;
  // Mistral's sliding window (and Qwen2's and Qwen3's, when use_sliding_window is set): full
  // attention equals it only up to the window, so that is the limit.
  uint32_t window = 0;
  if (j.contains("use_sliding_window") && !j["use_sliding_window"].is_boolean() && !j["use_sliding_window"].is_null())
    return fail("use_sliding_window must be true or false");
  const bool windowed = c.architecture == "MistralForCausalLM" ||
                        ((c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM") &&
                         j.contains("use_sliding_window") && j["use_sliding_window"] == true);
  if (windowed && !uint_field("sliding_window", &window, false)) return false;
  if (window && window < c.max_position_embeddings) c.max_position_embeddings = window;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 10000.0f;
  if (!float_field(j, "rms_norm_eps", &c.rms_norm_eps) || !float_field(j, "rope_theta", &c.rope_theta)) return false;
  if (is_deepseek(c.architecture) && !parse_deepseek_fields(j, &c, fail, uint_field, float_field)) return false;
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.attention_bias = c.architecture == "Qwen2ForCausalLM" || (!is_deepseek(c.architecture) && j.value("attention_bias", false));
  c.qk_norm = c.architecture == "Qwen3ForCausalLM";
  // Features a family may switch on that Baton does not compute: refused, never ignored (ignoring
  // one would serve confident garbage). DeepSeek's attention_bias was refused above.
  // swish is SiLU's other name (x * sigmoid(x)); transformers' ACT2FN maps both to nn.SiLU.
  if (j.contains("hidden_act") && j["hidden_act"] != "silu" && j["hidden_act"] != "swish")
    return fail("hidden_act " +
                (j["hidden_act"].is_string() ? "\"" + j["hidden_act"].get<std::string>().substr(0, 64) + "\""
                                             : std::string{"of type "} + j["hidden_act"].type_name()) +
                " is not supported (silu is)");
  if (j.value("mlp_bias", false)) return fail("mlp_bias is not supported (the MLP projections have no bias)");
  if (c.attention_bias && c.architecture != "Qwen2ForCausalLM")
    return fail("attention_bias is not supported for " + c.architecture +
                " (its o_proj has a bias too; only Qwen2's q/k/v biases are)");
  // transformers 5 writes every RoPE setting, theta included, into rope_parameters; 4 wrote
  // rope_theta at the top and the scaling into rope_scaling. Accept both; with both (a model card's
  // rope_scaling added to a config transformers 5 wrote), rope_scaling's settings go over
  // rope_parameters', as transformers 5 reads them -- it was ignored, serving unscaled RoPE.
  json rope;
  std::string rope_key;  // where the settings came from, as a refusal names it
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (j.contains(key) && j[key].is_object()) {
      rope_key += (rope_key.empty() ? "" : " with ") + std::string{key};
      for (const auto& [k, v] : j[key].items()) rope[k == "type" ? "rope_type" : k] = v;
    }
  // RoPE over part of each head (Phi's, GLM's, StableLM's partial_rotary_factor): Baton rotates
  // the whole head, so a factor below 1 would serve other math.
  for (const json* o : {&j, &rope})
    if (o->is_object() && o->contains("partial_rotary_factor") && !(*o)["partial_rotary_factor"].is_null() &&
        !((*o)["partial_rotary_factor"].is_number() && (*o)["partial_rotary_factor"].get<double>() == 1.0))
      return fail("partial_rotary_factor " + (*o)["partial_rotary_factor"].dump().substr(0, 64) +
                  " is not supported (RoPE over the whole head, 1.0, is)");
  if (rope.is_object()) {
    const auto& rs = rope;
    if (!float_field(rs, "rope_theta", &c.rope_theta)) return false;
    const std::string type = rs.value("rope_type", rs.value("type", std::string{}));
    if (type == "llama3") {
      c.rope_scaling.type = type;
      if (!float_field(rs, "factor", &c.rope_scaling.factor) ||
          !float_field(rs, "low_freq_factor", &c.rope_scaling.low_freq_factor) ||
          !float_field(rs, "high_freq_factor", &c.rope_scaling.high_freq_factor))
        return false;
      if (rs.contains("original_max_position_embeddings") && rs["original_max_position_embeddings"].is_number_unsigned())
        c.rope_scaling.original_max_position_embeddings = rs["original_max_position_embeddings"].get<uint32_t>();
    } else if (type == "yarn") {
      auto& y = c.rope_scaling;
      y.type = type;
      if (!float_field(rs, "factor", &y.factor) || !float_field(rs, "beta_fast", &y.beta_fast) ||
          !float_field(rs, "beta_slow", &y.beta_slow) || !float_field(rs, "mscale", &y.mscale) ||
          !float_field(rs, "mscale_all_dim", &y.mscale_all_dim) ||
          !float_field(rs, "attention_factor", &y.attention_factor))
        return false;
      y.truncate = rs.value("truncate", true);
      if (!rs.contains("original_max_position_embeddings") || !rs["original_max_position_embeddings"].is_number_unsigned())
        return fail(rope_key + ": yarn needs original_max_position_embeddings");
      y.original_max_position_embeddings = rs["original_max_position_embeddings"].get<uint32_t>();
      if (!(y.factor >= 1.0f) || !(y.beta_fast > 0) || !(y.beta_slow > 0) || y.original_max_position_embeddings == 0)
        return fail(rope_key + ": yarn needs factor >= 1, beta_fast and beta_slow > 0 and a positive "
                                             "original_max_position_embeddings");
    } else if (!type.empty() && type != "default") {
      return fail(rope_key + " type " + type + " is not supported (llama3 and yarn are)");
    }
  }
  auto token_id = [&](const char* key, int32_t* dst) {
    if (!j.contains(key) || j[key].is_null()) return;
    if (j[key].is_number_integer()) *dst = j[key].get<int32_t>();
    else if (j[key].is_array() && !j[key].empty() && j[key][0].is_number_integer()) *dst = j[key][0].get<int32_t>();
  };
  c.bos_token_id = -1;
  c.eos_token_id = -1;
  token_id("bos_token_id", &c.bos_token_id);
  token_id("eos_token_id", &c.eos_token_id);
  c.name = j.value("_name_or_path", c.architecture);
  if (auto e = c.validate(); !e.empty()) return fail(e);
  *out = std::move(c);
  return true;
}

/// DeepSeek layers: MLA projections, then a dense MLP or a MoE block. Routed experts come one
/// tensor per expert (the Hub's layout), or fused into mlp.experts.gate_up_proj [E, 2F, H] and
/// mlp.experts.down_proj [E, H, F] (transformers 5's in-memory layout).
template <class Get, class Check>
bool load_deepseek_layers(const safetensors_set& set, const model_config& c, Get get, Check check,
                          const expert_filter& keep, std::vector<layer_weights>& layers) {
  const uint64_t h = c.hidden_size, q = c.q_dim(), lat = c.kv_dim(), heads = c.num_attention_heads;
  const auto& m = c.mla;
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    auto& L = layers[l];
    if (!get(p + "input_layernorm.weight", {h}, &L.attn_norm) ||
        !get(p + "post_attention_layernorm.weight", {h}, &L.mlp_norm))
      return false;
    if (m.q_lora_rank) {
      if (!get(p + "self_attn.q_a_proj.weight", {m.q_lora_rank, h}, &L.wq_a) ||
          !get(p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank}, &L.q_a_norm) ||
          !get(p + "self_attn.q_b_proj.weight", {q, m.q_lora_rank}, &L.wq_b))
        return false;
    } else if (!get(p + "self_attn.q_proj.weight", {q, h}, &L.wq)) {
      return false;
    }
    if (!get(p + "self_attn.kv_a_proj_with_mqa.weight", {lat, h}, &L.wkv_a) ||
        !get(p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank}, &L.kv_a_norm) ||
        !get(p + "self_attn.kv_b_proj.weight", {heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank}, &L.wkv_b) ||
        !get(p + "self_attn.o_proj.weight", {h, c.attn_out_dim()}, &L.wo))
      return false;
    const uint64_t f = c.mlp_intermediate(l);
    const std::string mlp = c.is_moe_layer(l) ? p + "mlp.shared_experts." : p + "mlp.";
    if (f && (!get(mlp + "gate_proj.weight", {f, h}, &L.w_gate) || !get(mlp + "up_proj.weight", {f, h}, &L.w_up) ||
              !get(mlp + "down_proj.weight", {h, f}, &L.w_down)))
      return false;
    if (!c.is_moe_layer(l)) continue;
    const uint64_t e_count = c.moe.n_routed_experts, mf = c.moe.moe_intermediate_size;
    if (!get(p + "mlp.gate.weight", {e_count, h}, &L.router)) return false;
    if (c.moe.topk_method == "noaux_tc" && !get(p + "mlp.gate.e_score_correction_bias", {e_count}, &L.router_bias))
      return false;
    L.experts.resize(e_count);
    auto kept = [&](uint64_t e) { return !keep || keep(c, l, static_cast<uint32_t>(e)); };
    if (set.find(p + "mlp.experts.gate_up_proj")) {
      // Fused: only the kept experts' slices are widened to fp32.
      const st_tensor *gate_up = nullptr, *down = nullptr;
      if (!check(p + "mlp.experts.gate_up_proj", {e_count, 2 * mf, h}, &gate_up) ||
          !check(p + "mlp.experts.down_proj", {e_count, h, mf}, &down))
        return false;
      for (uint64_t e = 0; e < e_count; ++e) {
        if (!kept(e)) continue;
        L.experts[e].gate = to_f32(*gate_up, e * 2 * mf * h, mf * h);
        L.experts[e].up = to_f32(*gate_up, e * 2 * mf * h + mf * h, mf * h);
        L.experts[e].down = to_f32(*down, e * h * mf, h * mf);
      }
      continue;
    }
    for (uint64_t e = 0; e < e_count; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      auto& ex = L.experts[e];
      if (kept(e) ? !get(x + "gate_proj.weight", {mf, h}, &ex.gate) || !get(x + "up_proj.weight", {mf, h}, &ex.up) ||
                        !get(x + "down_proj.weight", {h, mf}, &ex.down)
                  : !check(x + "gate_proj.weight", {mf, h}, nullptr) || !check(x + "up_proj.weight", {mf, h}, nullptr) ||
                        !check(x + "down_proj.weight", {h, mf}, nullptr))
        return false;
    }
  }
  return true;
}

bool load_hf_model_unchecked(const std::string& dir, hf_model* out, std::string* why, const expert_filter& keep) {
  std::string config_text;
  if (!read_text_file(dir + "/config.json", &config_text)) {
    *why = dir + "/config.json: cannot read it";
    return false;
  }
  hf_model m;
  if (!parse_hf_config(config_text, dir + "/config.json", &m.config, why)) return false;
  auto set = safetensors_set::open_dir(dir, why);
  if (!set) return false;
  const auto& c = m.config;
  std::set<std::string> used;  // the tensors read: any other in the files is one the math would leave out
  // Finds a tensor with exactly `shape`; names the tensor on any mismatch.
  auto check = [&](const std::string& name, const std::vector<uint64_t>& shape, const st_tensor** found) {
    used.insert(name);
    const auto* t = set->find(name);
    if (!t) {
      *why = dir + ": missing tensor " + name;
      return false;
    }
    if (t->shape != shape) {
      auto fmt = [](const std::vector<uint64_t>& s) {
        std::string o = "[";
        for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
        return o + "]";
      };
      *why = dir + ": tensor " + name + " has shape " + fmt(t->shape) + ", config.json implies " + fmt(shape);
      return false;
    }
    if (found) *found = t;
    return true;
  };
  // Fetches a tensor with exactly `shape`, as fp32.
  auto get = [&](const std::string& name, const std::vector<uint64_t>& shape, std::vector<float>* dst) {
    const st_tensor* t = nullptr;
    if (!check(name, shape, &t)) return false;
    *dst = to_f32(*t);
    return true;
  };
  auto w = std::make_shared<model_weights>();
  const uint64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), f = c.intermediate_size, v = c.vocab_size;
  if (!get("model.embed_tokens.weight", {v, h}, &w->embed) || !get("model.norm.weight", {h}, &w->final_norm))
    return false;
  if (!c.tie_word_embeddings && !get("lm_head.weight", {v, h}, &w->lm_head)) return false;
  w->layers.resize(c.num_hidden_layers);
  if (c.is_mla() && !load_deepseek_layers(*set, c, get, check, keep, w->layers)) return false;
  for (uint32_t l = 0; !c.is_mla() && l < c.num_hidden_layers; ++l) {  // the Llama-like families
    const std::string p = "model.layers." + std::to_string(l) + ".";
    auto& L = w->layers[l];
    if (!get(p + "input_layernorm.weight", {h}, &L.attn_norm) ||
        !get(p + "post_attention_layernorm.weight", {h}, &L.mlp_norm) ||
        !get(p + "self_attn.q_proj.weight", {q, h}, &L.wq) || !get(p + "self_attn.k_proj.weight", {kv, h}, &L.wk) ||
        !get(p + "self_attn.v_proj.weight", {kv, h}, &L.wv) || !get(p + "self_attn.o_proj.weight", {h, q}, &L.wo) ||
        !get(p + "mlp.gate_proj.weight", {f, h}, &L.w_gate) || !get(p + "mlp.up_proj.weight", {f, h}, &L.w_up) ||
        !get(p + "mlp.down_proj.weight", {h, f}, &L.w_down))
      return false;
    if (c.attention_bias &&
        (!get(p + "self_attn.q_proj.bias", {q}, &L.bq) || !get(p + "self_attn.k_proj.bias", {kv}, &L.bk) ||
         !get(p + "self_attn.v_proj.bias", {kv}, &L.bv)))
      return false;
    if (c.qk_norm && (!get(p + "self_attn.q_norm.weight", {c.head_dim}, &L.q_norm) ||
                      !get(p + "self_attn.k_norm.weight", {c.head_dim}, &L.k_norm)))
      return false;
  }
  // A Llama-like model's weights hold nothing its math leaves out: Qwen3's q/k norms under
  // LlamaForCausalLM, or biases, were dropped in silence (a trial), serving another model. Left
  // alone: old checkpoints' rotary_emb.inv_freq (computed here), a tied lm_head saved anyway.
  // (DeepSeek's files hold multi-token-prediction layers past num_hidden_layers: not checked.)
  if (!c.is_mla()) {
    std::vector<std::string> unused;
    for (const auto& name : set->names())
      if (!used.count(name) && !name.ends_with("rotary_emb.inv_freq") &&
          !(c.tie_word_embeddings && name == "lm_head.weight"))
        unused.push_back(name);
    if (!unused.empty()) {
      *why = dir + ": tensor " + unused[0] + (unused.size() > 1 ? " (and " + std::to_string(unused.size() - 1) + " more)" : "") +
             " is in the weights, but " + c.architecture + " as config.json describes it does not use it: serving "
             "without it would compute another model (is `architectures` right? Qwen3 has q_norm and k_norm, Qwen2 "
             "biases on q/k/v)";
      return false;
    }
  }
  // Every end-of-sequence id a file lists (a number or a list of them).
  const auto eos_ids = [](const json& o, std::vector<int32_t>* ids) {
    if (!o.contains("eos_token_id")) return;
    if (o["eos_token_id"].is_number_integer()) ids->push_back(o["eos_token_id"].get<int32_t>());
    else if (o["eos_token_id"].is_array())
      for (const auto& e : o["eos_token_id"])
        if (e.is_number_integer()) ids->push_back(e.get<int32_t>());
  };
  auto& d = m.generation;
  if (std::string text; read_text_file(dir + "/generation_config.json", &text)) {
    const std::string source = dir + "/generation_config.json";
    json g;
    if (!parse_json_object(text, source, &g, why)) return false;
    d.present = true;
    // Each field's type, checked before it is read (a mistyped one threw, naming neither).
    struct typed_field {
      const char* key;
      bool (json::*is)() const noexcept;
      const char* wanted;
    };
    for (const auto& f : {typed_field{"temperature", &json::is_number, "a number"},
                          typed_field{"top_p", &json::is_number, "a number"},
                          typed_field{"top_k", &json::is_number_unsigned, "a whole number >= 0"},
                          typed_field{"repetition_penalty", &json::is_number, "a number"},
                          typed_field{"do_sample", &json::is_boolean, "true or false"},
                          typed_field{"max_new_tokens", &json::is_number_unsigned, "a whole number >= 0"}})
      if (g.contains(f.key) && !g[f.key].is_null() && !(g[f.key].*f.is)()) {
        *why = source + ": " + f.key + " must be " + f.wanted + ", got " + g[f.key].dump().substr(0, 64);
        return false;
      }
    if (g.contains("temperature") && g["temperature"].is_number()) d.temperature = g["temperature"].get<float>();
    if (g.contains("top_p") && g["top_p"].is_number()) d.top_p = g["top_p"].get<float>();
    if (g.contains("top_k") && g["top_k"].is_number_unsigned()) d.top_k = g["top_k"].get<uint32_t>();
    if (g.contains("repetition_penalty") && g["repetition_penalty"].is_number()) {
      d.repetition_penalty = g["repetition_penalty"].get<float>();
      if (!(d.repetition_penalty >= 0.01f && d.repetition_penalty <= 100.0f)) {  // what a request may ask
        *why = source + ": repetition_penalty must be in [0.01, 100], got " + g["repetition_penalty"].dump();
        return false;
      }
    }
    d.do_sample = g.value("do_sample", false);
    if (g.contains("max_new_tokens") && g["max_new_tokens"].is_number_unsigned())
      d.max_new_tokens = static_cast<uint32_t>(std::min<uint64_t>(g["max_new_tokens"].get<uint64_t>(), 1u << 31));
    eos_ids(g, &d.eos_token_ids);
  }
  // Without a list there, config.json's (Llama 3 Instruct lists <|eot_id|> after <|end_of_text|>):
  // the model config keeps the first, the rest end generation too.
  if (d.eos_token_ids.empty()) {
    json cj;
    if (parse_json_object(config_text, dir + "/config.json", &cj, why)) eos_ids(cj, &d.eos_token_ids);
  }
  finish_mla_weights(c, *w);
  m.weights = std::move(w);
  m.weights_id = set->fingerprint(config_text);  // config.json too: RoPE settings, say, change the KV
  *out = std::move(m);
  return true;
}

}  // namespace

// nlohmann throws on a mistyped field that value() reads; nothing leaves here as an exception.
bool parse_hf_config(const std::string& text, const std::string& source, model_config* out, std::string* why) {
  try {
    return parse_hf_config_unchecked(text, source, out, why);
  } catch (const nlohmann::json::exception& e) {
    *why = source + ": " + e.what();
    return false;
  }
}

bool load_hf_model(const std::string& dir, hf_model* out, std::string* why, const expert_filter& keep) {
  try {
    return load_hf_model_unchecked(dir, out, why, keep);
  } catch (const std::bad_alloc&) {
    *why = dir + ": the weights do not fit in this machine's memory";
    return false;
  } catch (const std::exception& e) {  // nlohmann's mistyped fields, std::filesystem's errors
    *why = dir + ": " + e.what();
    return false;
  }
}

}  // namespace baton::gpu
