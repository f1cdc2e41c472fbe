#include "gpu/hf_export.hpp"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "gpu/bpe_tokenizer.hpp"

namespace baton::gpu {

namespace {

using nlohmann::json;

/// The fields every family writes alike.
json common_config(const model_config& c) {
  return {{"architectures", {c.architecture}},
          {"_name_or_path", c.name},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rms_norm_eps", c.rms_norm_eps},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"bos_token_id", c.bos_token_id},
          {"eos_token_id", c.eos_token_id},
          {"hidden_act", "silu"}};
}

json deepseek_config(const model_config& c) {
  const bool v3 = c.architecture == "DeepseekV3ForCausalLM";
  json j = common_config(c);
  j.update({{"model_type", v3 ? "deepseek_v3" : "deepseek_v2"},
            {"num_key_value_heads", c.num_attention_heads},
            {"rope_parameters", {{"rope_theta", c.rope_theta}, {"rope_type", "default"}}},
            {"q_lora_rank", c.mla.q_lora_rank ? json(c.mla.q_lora_rank) : json()},
            {"kv_lora_rank", c.mla.kv_lora_rank},
            {"qk_nope_head_dim", c.mla.qk_nope_head_dim},
            {"qk_rope_head_dim", c.mla.qk_rope_head_dim},
            {"v_head_dim", c.mla.v_head_dim},
            {"head_dim", c.mla.qk_rope_head_dim},
            {"n_routed_experts", c.moe.n_routed_experts ? json(c.moe.n_routed_experts) : json()},
            {"n_shared_experts", c.moe.n_shared_experts},
            {"num_experts_per_tok", c.moe.num_experts_per_tok},
            {"moe_intermediate_size", c.moe.moe_intermediate_size},
            {"first_k_dense_replace", c.moe.first_k_dense_replace},
            {"routed_scaling_factor", c.moe.routed_scaling_factor},
            {"norm_topk_prob", c.moe.norm_topk_prob},
            {"rope_interleave", c.mla.rope_interleave},
            {"n_group", c.moe.n_group},
            {"topk_group", c.moe.topk_group},
            {"topk_method", v3 ? std::string{"noaux_tc"} : c.moe.topk_method}});
  return j;
}

json llama_like_config(const model_config& c) {
  json j = common_config(c);
  j.update({{"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_dim},
            {"rope_theta", c.rope_theta},
            {"attention_bias", c.attention_bias}});
  return j;
}

bool is_byte_vocabulary(const model_config& c) {
  return c.vocab_size == 259 && c.bos_token_id == 256 && c.eos_token_id == 257;
}

}  // namespace

std::string hf_config_json(const model_config& c, std::string* why) {
  if (auto e = c.validate(); !e.empty()) return *why = "the model's shape: " + e, std::string{};
  if (!c.rope_scaling.type.empty())
    return *why = "RoPE scaling (" + c.rope_scaling.type + ") is not written by the export", std::string{};
  return (c.is_mla() ? deepseek_config(c) : llama_like_config(c)).dump(2) + "\n";
}

std::vector<st_write_tensor> hf_tensors(const model_config& c, const model_weights& w, const hf_export_options& o) {
  const uint64_t h = c.hidden_size, v = c.vocab_size;
  const auto d = o.dtype;
  std::vector<st_write_tensor> t = {{"model.embed_tokens.weight", {v, h}, w.embed, d},
                                    {"model.norm.weight", {h}, w.final_norm, d}};
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {v, h}, w.lm_head, d});
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const auto& L = w.layers[l];
    t.push_back({p + "input_layernorm.weight", {h}, L.attn_norm, d});
    t.push_back({p + "post_attention_layernorm.weight", {h}, L.mlp_norm, d});
    if (!c.is_mla()) {
      const uint64_t q = c.q_dim(), kv = c.kv_dim(), f = c.intermediate_size;
      t.push_back({p + "self_attn.q_proj.weight", {q, h}, L.wq, d});
      t.push_back({p + "self_attn.k_proj.weight", {kv, h}, L.wk, d});
      t.push_back({p + "self_attn.v_proj.weight", {kv, h}, L.wv, d});
      t.push_back({p + "self_attn.o_proj.weight", {h, q}, L.wo, d});
      if (c.attention_bias) {
        t.push_back({p + "self_attn.q_proj.bias", {q}, L.bq, d});
        t.push_back({p + "self_attn.k_proj.bias", {kv}, L.bk, d});
        t.push_back({p + "self_attn.v_proj.bias", {kv}, L.bv, d});
      }
      if (c.qk_norm) {
        t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, L.q_norm, d});
        t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, L.k_norm, d});
      }
      t.push_back({p + "mlp.gate_proj.weight", {f, h}, L.w_gate, d});
      t.push_back({p + "mlp.up_proj.weight", {f, h}, L.w_up, d});
      t.push_back({p + "mlp.down_proj.weight", {h, f}, L.w_down, d});
      continue;
    }
    const auto& m = c.mla;
    const uint64_t heads = c.num_attention_heads;
    if (m.q_lora_rank) {
      t.push_back({p + "self_attn.q_a_proj.weight", {m.q_lora_rank, h}, L.wq_a, d});
      t.push_back({p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank}, L.q_a_norm, d});
      t.push_back({p + "self_attn.q_b_proj.weight", {c.q_dim(), m.q_lora_rank}, L.wq_b, d});
    } else {
      t.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), h}, L.wq, d});
    }
    t.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_dim(), h}, L.wkv_a, d});
    t.push_back({p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank}, L.kv_a_norm, d});
    t.push_back({p + "self_attn.kv_b_proj.weight", {heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank},
                 L.wkv_b, d});
    t.push_back({p + "self_attn.o_proj.weight", {h, c.attn_out_dim()}, L.wo, d});
    const uint64_t f = c.mlp_intermediate(l);
    const std::string mlp = c.is_moe_layer(l) ? p + "mlp.shared_experts." : p + "mlp.";
    if (f) {
      t.push_back({mlp + "gate_proj.weight", {f, h}, L.w_gate, d});
      t.push_back({mlp + "up_proj.weight", {f, h}, L.w_up, d});
      t.push_back({mlp + "down_proj.weight", {h, f}, L.w_down, d});
    }
    if (!c.is_moe_layer(l)) continue;
    const uint64_t e_count = c.moe.n_routed_experts, mf = c.moe.moe_intermediate_size;
    t.push_back({p + "mlp.gate.weight", {e_count, h}, L.router, d});
    // The correction bias stays fp32 in real V3 checkpoints too: its values differ in late digits.
    if (!L.router_bias.empty()) t.push_back({p + "mlp.gate.e_score_correction_bias", {e_count}, L.router_bias});
    if (o.fused_experts) {
      std::vector<float> gate_up, down;
      for (const auto& x : L.experts) {
        gate_up.insert(gate_up.end(), x.gate.begin(), x.gate.end());
        gate_up.insert(gate_up.end(), x.up.begin(), x.up.end());
        down.insert(down.end(), x.down.begin(), x.down.end());
      }
      t.push_back({p + "mlp.experts.gate_up_proj", {e_count, 2 * mf, h}, std::move(gate_up), d});
      t.push_back({p + "mlp.experts.down_proj", {e_count, h, mf}, std::move(down), d});
      continue;
    }
    for (uint64_t e = 0; e < e_count; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      t.push_back({x + "gate_proj.weight", {mf, h}, L.experts[e].gate, d});
      t.push_back({x + "up_proj.weight", {mf, h}, L.experts[e].up, d});
      t.push_back({x + "down_proj.weight", {h, mf}, L.experts[e].down, d});
    }
  }
  return t;
}

std::string byte_vocabulary_tokenizer_json(const model_config& c) {
  if (!is_byte_vocabulary(c)) return {};
  json vocab = json::object();
  const auto& symbols = byte_level_symbols();
  for (int b = 0; b < 256; ++b) vocab[symbols[b]] = b;
  json added = json::array();
  const char* specials[] = {"<bos>", "<eos>", "<pad>"};
  for (int i = 0; i < 3; ++i) added.push_back({{"id", 256 + i}, {"content", specials[i]}, {"special", true}});
  // No merges and no split pattern: every byte is its own token, as the built-in byte tokenizer.
  json j = {{"version", "1.0"},
            {"added_tokens", added},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  return j.dump(1) + "\n";
}

std::string save_hf_model(const std::string& dir, const model_config& c, const model_weights& w,
                          const hf_export_options& o) {
  std::string why;
  const auto config = hf_config_json(c, &why);
  if (config.empty()) return why;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return dir + ": cannot create it: " + ec.message();
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream out{dir + "/" + name, std::ios::trunc};
    out << text;
    out.close();
    return out ? std::string{} : dir + "/" + name + ": cannot write it";
  };
  if (auto e = write("config.json", config); !e.empty()) return e;
  if (auto e = write_safetensors(dir + "/model.safetensors", hf_tensors(c, w, o)); !e.empty()) return e;
  if (const auto tok = byte_vocabulary_tokenizer_json(c); !tok.empty()) {
    if (auto e = write("tokenizer.json", tok); !e.empty()) return e;
    if (auto e = write("tokenizer_config.json", json{{"add_bos_token", true}, {"bos_token", "<bos>"},
                                                     {"eos_token", "<eos>"}}.dump(2) + "\n");
        !e.empty())
      return e;
  }
  return {};
}

}  // namespace baton::gpu
