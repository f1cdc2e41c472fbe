// What every command that serves a model shares: loading a model directory (or a seeded shape)
// into a cluster config, the expert blocks a process keeps, serving defaults, and store
// directories (commands.hpp).

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "actors/local_cluster.hpp"
#include "deploy/commands.hpp"
#include "gpu/model_config.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/tokenizer.hpp"
#include "policies/eplb.hpp"
#include "store/block_file.hpp"

namespace baton::deploy {

void apply_serving_prefill_defaults(prefill_rank_config* cfg) {
  cfg->step_budget_us = 20000;  // 20 ms steps
  cfg->chunk_tokens = 512;      // a cap; the budget sizes the chunks
}

bool ensure_writable_dir(const std::string& dir, const std::string& flag, std::string* why) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && ::access(dir.c_str(), W_OK) == 0) return true;
  *why = flag + " " + dir + " is not a writable directory" + (ec ? ": " + ec.message() : std::string{});
  return false;
}

bool hold_store_dir(const std::string& dir, const std::string& flag, std::string* why, const std::string& lock_name) {
  std::string held_by;
  bool shared = false;
  const int fd = store::lock_block_dir(dir, &held_by, &shared, lock_name);
  if (fd < 0 || shared) {
    if (shared) store::unlock_block_dir(fd);  // this process serves the directory already
    *why = flag + " " + held_by;
    return false;
  }
  return true;  // held until the process ends (the descriptor stays open on purpose)
}

bool load_model_into(const std::string& dir, local_cluster_config* cfg, std::string* why, const gpu::expert_filter& keep) {
  // The seeded DeepSeek shapes: MLA and MoE on the byte vocabulary, no files needed.
  if (dir == "deepseek-v2-tiny" || dir == "deepseek-v3-tiny") {
    cfg->model = gpu::deepseek_tiny_config(dir == "deepseek-v3-tiny");
    cfg->weights = nullptr;  // drawn from weights_seed, identically in every process
    cfg->weights_id.clear();
    return true;
  }
  gpu::hf_model m;
  if (!gpu::load_hf_model(dir, &m, why, keep)) return false;
  auto tok = gpu::load_model_tokenizer(dir, m.config, why);
  if (!tok) return false;
  cfg->model = m.config;
  cfg->weights = m.weights;
  cfg->weights_id = m.weights_id;
  cfg->router.tokenizer = std::move(tok);
  for (auto id : m.generation.eos_token_ids)
    if (id != m.config.eos_token_id) cfg->router.extra_eos_token_ids.push_back(id);
  // The model's sampling defaults for OpenAI calls, as Hugging Face's generate() reads them
  // (do_sample false: greedy); OpenAI's temperature 1 without a generation_config.json.
  const auto& g = m.generation;
  const bool samples = !g.present || g.do_sample;
  cfg->router.default_temperature = samples ? std::clamp(g.temperature, 0.0f, 2.0f) : 0.0f;
  cfg->router.default_top_p = samples && g.top_p > 0.0f && g.top_p <= 1.0f ? g.top_p : 1.0f;
  cfg->router.default_top_k = samples ? g.top_k : 0;
  cfg->router.default_repetition_penalty = g.repetition_penalty;  // (HF applies it greedy too)
  // vLLM's reading too: the file's max_new_tokens caps a call that names no max_tokens.
  if (g.max_new_tokens > 0) cfg->router.default_max_tokens = g.max_new_tokens;
  return true;
}

gpu::expert_filter keep_blocks_of(std::vector<uint32_t> members, uint32_t group_size) {
  return [members = std::move(members), group_size](const gpu::model_config& c, uint32_t, uint32_t expert) {
    const uint32_t owner = policies::block_owner(expert, group_size, c.moe.n_routed_experts);
    return std::find(members.begin(), members.end(), owner) != members.end();
  };
}

}  // namespace baton::deploy
