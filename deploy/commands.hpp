#pragma once

#include <string>
#include <vector>

#include "gpu/hf_model.hpp"

namespace baton {
struct local_cluster_config;
struct prefill_rank_config;
}

namespace baton::deploy {

/// `baton local`: a whole disaggregated cluster in this process on the built-in model,
/// answering sample prompts. Returns the process exit code.
int run_local(const std::vector<std::string>& args);

/// `baton node --role decode|prefill|store`: ranks or a block server in their own process,
/// joined to a head over CAF's network layer, with KV over UCX.
int run_node(const std::vector<std::string>& args);

/// Loads a Hugging Face model directory (config, weights and tokenizer) into a cluster config;
/// `deepseek-v2-tiny` and `deepseek-v3-tiny` name seeded DeepSeek shapes instead (drawn whole from
/// the seed later: `keep` applies to directories). `keep` chooses the routed experts to load.
bool load_model_into(const std::string& dir, local_cluster_config* cfg, std::string* why,
                     const gpu::expert_filter& keep = {});

/// Whether `expert` is in the contiguous block of one of `members` in a group of `group_size`
/// (policies::block_owner): an expert-parallel process's filter for load_model_into.
gpu::expert_filter keep_blocks_of(std::vector<uint32_t> members, uint32_t group_size);

/// How serving prefill ranks chunk prompts, in the head and in prefill nodes alike (seed 000
/// §3.1 level 4: chunks sized to a 20 ms predicted step, at most 512 tokens).
void apply_serving_prefill_defaults(prefill_rank_config* cfg);

/// Creates `dir` if needed; false and a sentence naming `flag` and the directory when it is not a
/// writable directory (a block server would otherwise only say so per request).
bool ensure_writable_dir(const std::string& dir, const std::string& flag, std::string* why);
/// Holds `dir`'s lock (store::lock_block_dir) until the process ends: a second process given the
/// same store directory is refused at its start, naming the first's pid (two block servers on one
/// directory each hold the disk to their own budget and delete what the other lists).
bool hold_store_dir(const std::string& dir, const std::string& flag, std::string* why, const std::string& lock_name = ".lock");

/// `baton profile`: measures the CPU executor over a grid of prefill and decode shapes, fits
/// the cost models and writes them, with the samples and held-out error, to a profile file.
int run_profile(const std::vector<std::string>& args);

/// `baton gateway`: the OpenAI-compatible HTTP gateway in front of a remote router.
int run_gateway(const std::vector<std::string>& args);

/// API keys from the environment (BATON_API_KEYS, comma-separated, blanks around each key
/// trimmed): how the launcher hands them to gateways without putting them on a command line.
/// Appended to `keys`; false (and `why`) when the variable is set but holds no key.
bool api_keys_from_env(std::vector<std::string>* keys, std::string* why);

struct gateway_config;
/// A gateway's keys: the plain ones from the environment (api_keys_from_env), and the named
/// ones of a keys file (`keys_file`, deploy/api_keys.hpp), or else of BATON_API_KEYS_JSON (the
/// file's text, as `baton launch` hands it to gateways on other hosts). False and why, naming
/// the file, when one does not read.
bool load_gateway_keys(const std::string& keys_file, gateway_config* gc, std::string* why);

/// `baton launch SPEC`: every node of a cluster spec as processes (ssh for other hosts).
int run_launch(const std::vector<std::string>& args);

/// `baton deploy k8s|slurm SPEC`: Kubernetes manifests or a Slurm batch script for a spec.
int run_deploy(const std::vector<std::string>& args);

/// `baton generate`: one or more prompts to a running cluster, streamed to stdout.
int run_generate(const std::vector<std::string>& args);

/// `baton status`: the nodes a head's directory knows and the ranks its router sees.
int run_status(const std::vector<std::string>& args);
/// `baton export-model`: writes a seeded built-in model (or a model directory again) as a Hugging
/// Face directory that `--model DIR` loads.
int run_export_model(const std::vector<std::string>& args);

/// `baton sim run|goodput|compare`: trace replay through the actors on modelled GPUs.
int run_sim(const std::vector<std::string>& args);

}  // namespace baton::deploy
