#include "gpu/hf_model.hpp"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gpu/safetensors.hpp"

namespace baton::gpu {

namespace {

using nlohmann::json;

const char* supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

bool read_text(const std::string& path, std::string* out) {
  std::ifstream in{path};
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

}  // namespace

std::vector<float> rope_inv_freq(const model_config& cfg) {
  const uint32_t half = cfg.head_dim / 2;
  std::vector<float> f(half);
  for (uint32_t i = 0; i < half; ++i)
    f[i] = 1.0f / std::pow(cfg.rope_theta, static_cast<float>(2 * i) / static_cast<float>(cfg.head_dim));
  const auto& rs = cfg.rope_scaling;
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

bool parse_hf_config_unchecked(const std::string& text, const std::string& source, model_config* out, std::string* why) {
  auto j = json::parse(text, nullptr, false);
  auto fail = [&](const std::string& s) {
    *why = source + ": " + s;
    return false;
  };
  if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
  model_config c;
  if (!j.contains("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string())
    return fail("no \"architectures\" list");
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM" && c.architecture != "Qwen3ForCausalLM")
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
    if (!o[key].is_number()) {
      *why = source + ": " + key + " must be a number";
      return false;
    }
    *dst = o[key].get<float>();
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
  // Mistral's sliding window: full attention equals it only up to the window, so that is the limit.
  uint32_t window = 0;
  if (c.architecture == "MistralForCausalLM" && !uint_field("sliding_window", &window, false)) return false;
  if (window && window < c.max_position_embeddings) c.max_position_embeddings = window;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 10000.0f;
  if (!float_field(j, "rms_norm_eps", &c.rms_norm_eps) || !float_field(j, "rope_theta", &c.rope_theta)) return false;
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.attention_bias = c.architecture == "Qwen2ForCausalLM" || j.value("attention_bias", false);
  c.qk_norm = c.architecture == "Qwen3ForCausalLM";
  // transformers 5 writes every RoPE setting, theta included, into rope_parameters; 4 wrote
  // rope_theta at the top and the scaling into rope_scaling. Accept both.
  const char* rope_key = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? "rope_parameters"
                                                                                           : "rope_scaling";
  if (j.contains(rope_key) && j[rope_key].is_object()) {
    const auto& rs = j[rope_key];
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
    } else if (!type.empty() && type != "default") {
      return fail(std::string{rope_key} + " type " + type + " is not supported (llama3 is)");
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

bool load_hf_model_unchecked(const std::string& dir, hf_model* out, std::string* why) {
  std::string text;
  if (!read_text(dir + "/config.json", &text)) {
    *why = dir + "/config.json: cannot read it";
    return false;
  }
  hf_model m;
  if (!parse_hf_config(text, dir + "/config.json", &m.config, why)) return false;
  auto set = safetensors_set::open_dir(dir, why);
  if (!set) return false;
  const auto& c = m.config;
  // Fetches a tensor with exactly `shape`, as fp32; names the tensor on any mismatch.
  auto get = [&](const std::string& name, std::vector<uint64_t> shape, std::vector<float>* dst) {
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
    *dst = to_f32(*t);
    return true;
  };
  auto w = std::make_shared<model_weights>();
  const uint64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), f = c.intermediate_size, v = c.vocab_size;
  if (!get("model.embed_tokens.weight", {v, h}, &w->embed) || !get("model.norm.weight", {h}, &w->final_norm))
    return false;
  if (!c.tie_word_embeddings && !get("lm_head.weight", {v, h}, &w->lm_head)) return false;
  w->layers.resize(c.num_hidden_layers);
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
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
  if (read_text(dir + "/generation_config.json", &text)) {
    auto g = json::parse(text, nullptr, false);
    if (g.is_discarded() || !g.is_object()) {
      *why = dir + "/generation_config.json: not a JSON object";
      return false;
    }
    auto& d = m.generation;
    if (g.contains("temperature") && g["temperature"].is_number()) d.temperature = g["temperature"].get<float>();
    if (g.contains("top_p") && g["top_p"].is_number()) d.top_p = g["top_p"].get<float>();
    if (g.contains("top_k") && g["top_k"].is_number_unsigned()) d.top_k = g["top_k"].get<uint32_t>();
    d.do_sample = g.value("do_sample", false);
    if (g.contains("eos_token_id")) {
      if (g["eos_token_id"].is_number_integer()) d.eos_token_ids.push_back(g["eos_token_id"].get<int32_t>());
      else if (g["eos_token_id"].is_array())
        for (const auto& e : g["eos_token_id"])
          if (e.is_number_integer()) d.eos_token_ids.push_back(e.get<int32_t>());
    }
  }
  m.weights = std::move(w);
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

bool load_hf_model(const std::string& dir, hf_model* out, std::string* why) {
  try {
    return load_hf_model_unchecked(dir, out, why);
  } catch (const nlohmann::json::exception& e) {
    *why = dir + ": " + e.what();
    return false;
  }
}

}  // namespace baton::gpu
