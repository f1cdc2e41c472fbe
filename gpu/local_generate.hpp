#pragma once

// Blocking helpers over the asynchronous executor, for tests, benchmarks and `baton profile`:
// never call them from an actor handler.

#include <functional>
#include <string>
#include <vector>

#include "gpu/executor.hpp"
#include "gpu/sampling.hpp"

namespace baton::gpu {

struct forward_outcome {
  std::vector<std::vector<float>> logits;  ///< per sequence, as executor_sink::on_done gives them
  std::string error;                       ///< non-empty when the executor refused the job
  std::vector<int32_t> tokens;             ///< per sequence: its picked token (forward_seq::sample), or -1
  std::vector<token_logprobs> logprobs;    ///< as forward_output::logprobs
  std::vector<std::vector<token_logprobs>> scores;  ///< as forward_output::scores
  std::vector<std::vector<int32_t>> row_tokens = {};           ///< as forward_output::row_tokens
  std::vector<std::vector<token_logprobs>> row_logprobs = {};  ///< as forward_output::row_logprobs
};

/// Submits one job and waits for it.
forward_outcome run_blocking(executor& exec, forward_job job);

struct colocated_generation {
  std::vector<int32_t> tokens;                   ///< generated tokens, first one from prefill
  std::vector<std::vector<float>> step_logits;   ///< step_logits[i] chose tokens[i]
  std::vector<uint32_t> pages;                   ///< the KV pages the sequence used (freed)
  std::string error;
};

/// Called between a colocated run's prefill and its first decode step with the executor's pool
/// and the sequence's pages: a test applies there what a handoff does to the prompt's KV (its
/// wire form), and the run becomes that handoff's exact reference.
using after_prefill_fn = std::function<void(kv_cache& kv, const std::vector<uint32_t>& pages, uint32_t prompt_tokens)>;

/// The colocated reference: prefill in chunks of `chunk_tokens`, then decode one token per
/// step, all on one executor and one page table. Stops after `max_new_tokens`, or at <eos>
/// unless `ignore_eos`. `grammar`: constrained decoding, each pick one it allows (it follows
/// the picks).
colocated_generation generate_colocated(executor& exec, const std::vector<int32_t>& prompt,
                                        uint32_t max_new_tokens, uint32_t chunk_tokens,
                                        const sampling_config& sampling = {}, bool ignore_eos = false,
                                        const after_prefill_fn& after_prefill = {},
                                        std::shared_ptr<grammar_matcher> grammar = nullptr);

}  // namespace baton::gpu
