// `baton export-model`: a model written as a Hugging Face directory (config.json,
// model.safetensors, and a tokenizer for the built-in byte vocabulary), which every command's
// `--model DIR` loads. It makes the seeded built-in shapes into files, so that the model-directory
// path -- expert-parallel nodes loading only their own experts, sharded checkpoints, bf16
// conversion -- can be run with no download; a directory given as --model is written again in
// another dtype or expert layout.

#include <cstdio>
#include <filesystem>

#include "actors/local_cluster.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "gpu/hf_export.hpp"
#include "gpu/weights.hpp"

namespace baton::deploy {

int run_export_model(const std::vector<std::string>& args) {
  std::string model = "random", out, dtype = "f32";
  uint64_t seed = local_cluster_config{}.weights_seed;
  bool fused = false;
  flag_set flags;
  flags.add("--model", &model,
            "what to write: `random` (the seeded random model of the built-in Llama shape), `deepseek-v2-tiny`, `deepseek-v3-tiny`, or a "
            "model directory");
  flags.add("--out", &out, "the directory to write (created if missing; its model files are replaced)");
  flags.add("--dtype", &dtype, "f32 (the weights bit for bit: the directory answers as --model does), bf16 or f16");
  flags.add("--fused-experts", &fused,
            "DeepSeek: routed experts fused into gate_up_proj / down_proj (transformers 5) instead of one tensor each");
  flags.add("--weights-seed", &seed, "seed of a seeded model's weights (as `baton local --weights-seed`)");
  if (auto rc = flags.parse_command_line(args, "export-model", "baton export-model --model NAME|DIR --out DIR [flags]"))
    return *rc;
  if (out.empty()) {
    std::fprintf(stderr, "baton export-model: --out DIR is required\n");
    return 2;
  }
  gpu::hf_export_options opt;
  opt.fused_experts = fused;
  if (dtype == "f32") opt.dtype = gpu::st_dtype::f32;
  else if (dtype == "bf16") opt.dtype = gpu::st_dtype::bf16;
  else if (dtype == "f16") opt.dtype = gpu::st_dtype::f16;
  else {
    std::fprintf(stderr, "baton export-model: --dtype %s is not f32, bf16 or f16\n", dtype.c_str());
    return 2;
  }
  // In place, the weights would be rewritten before the copy of the tokenizer failed: a model
  // directory lost (its f32 weights now bf16, say) by a command that says it failed.
  if (std::error_code ec; std::filesystem::is_directory(model, ec) && std::filesystem::equivalent(model, out, ec)) {
    std::fprintf(stderr, "baton export-model: --out %s is the model directory itself; write the export elsewhere\n",
                 out.c_str());
    return 2;
  }
  local_cluster_config loaded;  // `random`: the built-in shape, drawn from the seed
  std::string why;
  if (model != "random" && !load_model_into(model, &loaded, &why)) {
    std::fprintf(stderr, "baton export-model: %s\n", why.c_str());
    return 2;
  }
  if (!loaded.weights) loaded.weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(loaded.model, seed));
  if (auto err = gpu::save_hf_model(out, loaded.model, *loaded.weights, opt); !err.empty()) {
    std::fprintf(stderr, "baton export-model: %s\n", err.c_str());
    return 1;
  }
  // A model directory's tokenizer and generation settings go with its weights: without them the
  // written directory would not load (or would end generation differently).
  if (std::filesystem::is_directory(model))
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"}) {
      const auto from = std::filesystem::path(model) / name;
      if (!std::filesystem::exists(from)) continue;
      std::error_code ec;
      std::filesystem::copy_file(from, std::filesystem::path(out) / name, std::filesystem::copy_options::overwrite_existing, ec);
      if (ec) {
        std::fprintf(stderr, "baton export-model: cannot copy %s: %s\n", from.c_str(), ec.message().c_str());
        return 1;
      }
    }
  std::printf("baton export-model: wrote %s (%s, %llu parameters, %s%s) to %s\n", model.c_str(),
              loaded.model.architecture.c_str(), static_cast<unsigned long long>(loaded.model.num_parameters()),
              dtype.c_str(), fused ? ", fused experts" : "", out.c_str());
  return 0;
}

}  // namespace baton::deploy
