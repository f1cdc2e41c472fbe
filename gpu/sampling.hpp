#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace baton::gpu {

class grammar_matcher;  // gpu/grammar.hpp

struct sampling_config {
  float temperature = 0.0f;  ///< 0 = greedy (argmax, lowest id on ties)
  uint64_t seed = 0;         ///< with temperature > 0: same seed, same tokens, on any rank
  uint32_t top_k = 0;        ///< sample among the k most likely (0 = all)
  float top_p = 1.0f;        ///< ... and within them the smallest set holding this much probability
  float repetition_penalty = 1.0f;  ///< Hugging Face's: a seen token's logit divided (>0) or multiplied (<0)
  /// OpenAI's: subtracted from the logit of a token the output has produced before, once...
  float presence_penalty = 0.0f;
  /// ... and once for every time it did.
  float frequency_penalty = 0.0f;
  /// Where the output starts in the history: the prompt's length. Presence and frequency count
  /// only what follows (as vLLM and SGLang do; a prompt's words are not repeats), the repetition
  /// penalty counts the whole history (as Hugging Face does).
  uint32_t output_from = 0;
  /// OpenAI's logit_bias: bias_values[i] is added to the logit of token bias_tokens[i] (after the
  /// penalties) for the pick; log-probabilities stay those of the raw logits, as vLLM reports
  /// them. The tokens are distinct (the router refuses a repeat); one outside the row is ignored.
  std::vector<int32_t> bias_tokens = {};
  std::vector<float> bias_values = {};
  /// vLLM's min_p: a draw keeps only the tokens at least this fraction as likely as the most
  /// likely one (after temperature, before top-k and top-p). 0 = off; a greedy pick is unchanged.
  float min_p = 0.0f;
  /// Tokens never picked here (their logits taken as NaN): the end tokens while a request's
  /// min_tokens is not reached yet (actors/executor_bridge.hpp, sampling_at).
  std::vector<int32_t> banned_tokens = {};
  bool penalised() const { return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f; }
  /// Whether the pick reads changed logits (penalties, biases or bans): never one of the
  /// device's picks.
  bool adjusted() const { return penalised() || !bias_tokens.empty() || !banned_tokens.empty(); }
};

/// The uniform draw in [0, 1) of a sequence's token at `position` (splitmix64 of both): the same on
/// every rank and backend.
double draw_uniform(uint64_t seed, uint32_t position);

/// A sampler's working memory, kept between calls by one thread: a draw over a 150K vocabulary
/// needs 1.2 MB of probabilities and 600 KB of candidate ids, which a batch's rows would
/// otherwise allocate and fault in afresh, row after row.
struct sampling_scratch {
  std::vector<float> penalised;
  std::vector<std::pair<int32_t, uint32_t>> counts;  ///< (token, times in the output) for the penalties
  std::vector<double> p;
  std::vector<uint32_t> idx;
  std::vector<float> masked;     ///< a row with the tokens a grammar forbids made NaN
  std::vector<uint8_t> allowed;  ///< the grammar's mask
};

/// Picks the token for position `position` of a sequence; `history` is every token before it
/// (prompt and output), needed only for the penalties. The random draw depends only on (seed,
/// position), never on which rank samples or what shares the batch, so a request sampled partly
/// on a prefill rank and partly on a decode rank gets the same tokens as on one rank.
/// Order: penalties, biases, bans, then temperature, min-p, top-k, top-p, draw (greedy:
/// penalties, biases, bans, then argmax).
/// Reads `logits` in place (a row of a batch's logits needs no copy); `scratch`, when given, is
/// reused instead of allocating.
int32_t sample_token(std::span<const float> logits, const sampling_config& cfg, uint32_t position,
                     std::span<const int32_t> history, sampling_scratch* scratch = nullptr);
/// The same over a whole vector; `history` null when there is none.
int32_t sample_token(const std::vector<float>& logits, const sampling_config& cfg, uint32_t position,
                     const std::vector<int32_t>* history = nullptr);

/// What OpenAI's `logprobs` asks for about one picked token: its log-probability and the most
/// likely tokens' at that step, from the raw logits (a log-softmax before temperature, top-k,
/// top-p and penalties, as vLLM and OpenAI report them).
struct token_logprobs {
  float logprob = 0.0f;             ///< the picked token's (-inf when its logit was NaN)
  std::vector<int32_t> top_tokens;  ///< the most likely tokens, most likely first (ties: lower id)
  std::vector<float> top_logprobs;  ///< theirs
  /// The token's rank as vLLM v1 counts it: the tokens whose logit is at least its own, itself
  /// included (a tie at the top ranks both 2). A NaN logit ranks after every other token (vLLM
  /// would say 0). 0: no token asked (out of the vocabulary).
  uint32_t rank = 0;
};

/// The most tokens `logprobs_of` reports besides the pick (OpenAI's top_logprobs limit).
inline constexpr uint32_t max_top_logprobs = 20;

/// token_logprobs of `token` under `logits`, with the `top_n` (<= max_top_logprobs) most likely.
/// A NaN logit has probability 0, as sample_token treats it.
token_logprobs logprobs_of(std::span<const float> logits, int32_t token, uint32_t top_n);

/// A sequence's request to have its next token picked by the executor that computed its logits
/// (gpu/executor.hpp, forward_seq::sample), by sample_token's rules. The CUDA backend picks greedy
/// rows on the device, so that a decode step moves one token per sequence off the GPU instead of
/// a row of logits (65 MB per step at batch 128 with a 128K vocabulary).
struct seq_sampling {
  sampling_config cfg;
  uint32_t position = 0;         ///< the sampled token's position (the draw's input)
  std::vector<int32_t> history;  ///< every token before it, when cfg.penalised(); else unused
  bool want_logprobs = false;    ///< report the pick's token_logprobs (forward_output::logprobs)...
  uint32_t top_logprobs = 0;     ///< ... with this many alternatives
  /// Constrained decoding: the pick is one of the tokens this grammar allows after the output so
  /// far (null: any). Its owner (a rank) keeps it at this position until the pick is made.
  std::shared_ptr<const grammar_matcher> grammar = nullptr;
  /// Whether the pick is an argmax of the raw logits, which needs no history and no draw (nor
  /// the row on the host afterwards, for log-probabilities).
  bool plain_greedy() const { return cfg.temperature <= 0.0f && !cfg.adjusted() && !want_logprobs && !grammar; }
  /// Whether the pick is a draw over the whole vocabulary at a temperature -- nothing that
  /// adjusted() names, no top-k, top-p or min_p, no log-probabilities, no grammar: one pass to
  /// sum, one to find the draw, which the CUDA backend runs on the device. A new sampling field
  /// that changes the pick must make this (and plain_greedy) false, or the GPU ignores it.
  bool plain_draw() const {
    return cfg.temperature > 0.0f && cfg.top_k == 0 && cfg.top_p >= 1.0f && cfg.min_p <= 0.0f && !cfg.adjusted() &&
           !want_logprobs && !grammar;
  }
};

/// sample_token for one forward_seq::sample; with a grammar, over the tokens it allows (the
/// others' logits made NaN, so never picked; log-probabilities stay the raw row's). A greedy pick
/// the grammar allows is the pick, without its mask: the argmax of the allowed tokens is the
/// argmax of all of them whenever the grammar allows it. No token allowed (the vocabulary cannot
/// spell what must come; an answer that is over still allows its end tokens): the grammar's first
/// end token, and the rank then fails the request, since the grammar refuses that pick.
int32_t sample_token(std::span<const float> logits, const seq_sampling& s, sampling_scratch* scratch = nullptr);

}  // namespace baton::gpu
